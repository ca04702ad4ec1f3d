"""A PyTorch training loop under distmem's OOM guard, on every rank of an mpirun job.

    mpirun -np 4 python examples/guard_torch.py --global-batch 256 --micro-batch 64
    mpirun -np 2 python examples/guard_torch.py --device cuda --find-batch-size

Each rank computes its share of the global batch in micro-batches; one tiny all-reduce per step tells
every rank whether any of them ran out of memory; if one did, all drop the step and retry with half the
micro-batch (twice the accumulation), so the global batch and the learning-rate schedule stay as they
were. ``--simulate-oom RANK:STEP`` makes that rank raise torch's OOM once at that step (a CPU cannot
run out of memory on demand); on a GPU a real OOM takes the same path.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distmem.cli.checks import at_least, parse_example, rank_step, run_example  # noqa: E402
from distmem.console import echo  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--global-batch", type=at_least(1), default=256)
    p.add_argument("--micro-batch", type=at_least(1), default=64)
    p.add_argument("--steps", type=at_least(1), default=20)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--find-batch-size", action="store_true", help="probe the micro-batch first (all ranks agree)")
    p.add_argument("--simulate-oom", default=None, type=rank_step, metavar="RANK:STEP")
    args = parse_example(p)
    import torch  # noqa: E402 - after the arguments are checked: a bad one costs no torch import
    import torch.nn.functional as F
    import distmem.guard
    from distmem.comm import get_comm

    comm = get_comm()  # mpi4py under mpirun; Horovod or torch.distributed when initialised; else one process
    rank, size = comm.rank, comm.size
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)  # identical initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    local = args.global_batch // size
    fault = args.simulate_oom

    micro = args.micro_batch
    if args.find_batch_size:
        def trial(b):  # one local forward/backward, no collective
            x = torch.randn(b, 512, device=device)
            F.cross_entropy(model(x), torch.zeros(b, dtype=torch.long, device=device)).backward()
            model.zero_grad(set_to_none=True)

        micro = distmem.guard.find_batch_size(trial, start=local, lower=1, comm=comm)

    state = {"step": 0}

    def loss_of(x, y):
        if fault and (rank, state["step"]) == fault and not state.get("fault_done"):
            state["fault_done"] = True
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (simulated)")
        return F.cross_entropy(model(x), y)

    step = distmem.guard.step(loss_of, params=list(model.parameters()), apply=lambda _: opt.step(),
                              micro_batch_size=micro, global_batch_size=args.global_batch, comm=comm)
    g = torch.Generator().manual_seed(rank)
    for i in range(args.steps):
        state["step"] = i
        x, y = torch.randn(local, 512, generator=g).to(device), torch.randint(0, 10, (local,), generator=g).to(device)
        loss = step(x, y)
        if rank == 0 and i % 5 == 0:
            echo(f"step {i}: loss {float(loss):.4f}, {step.describe()}")
    if rank == 0:
        echo(f"done: {step.describe()}; fallbacks: {[(f.step, f.ranks, f.new_micro_batch) for f in step.fallbacks]}")


if __name__ == "__main__":
    run_example(main)
