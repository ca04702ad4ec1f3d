"""Train a small PyTorch CNN on synthetic data under a distmem plan, one process per rank.

    mpirun -np 4 python examples/torch_train.py --report runs/torch/report.json
    torchrun --nproc_per_node 4 examples/torch_train.py
    python examples/torch_train.py                       # one process

distmem.init(framework="torch") comes first, before anything starts CUDA: it pins each rank to its
GPU (local rank round robin) and, where ranks share a GPU, caps each one's caching allocator at its
equal share. Gradients are averaged with mpi4py under mpirun (``--comm mpi``, the default there) or
with DistributedDataParallel (``--comm ddp``: NCCL on GPUs, Gloo on CPU; the default under torchrun).
On a machine without GPUs the plan is computed (against DISTMEM_FLEET if set), nothing is applied,
and the model trains on the CPU. At the end every rank reports; rank 0 prints the table and writes
the JSON report when ``--report`` (or DISTMEM_REPORT) names a path.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distmem.cli.checks import at_least, parse_example, positive_number, run_example  # noqa: E402
from distmem.console import echo  # noqa: E402

import distmem  # noqa: E402
from distmem.units import plural  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=at_least(1), default=30, help="training steps")
    p.add_argument("--batch-size", type=at_least(1), default=32, help="per-rank batch size")
    p.add_argument("--memory", default="auto", choices=["auto", "growth", "limit"])
    p.add_argument("--overhead", default=None, help="per-process overhead for the plan, e.g. 768MiB")
    p.add_argument("--comm", default="auto", choices=["auto", "mpi", "ddp", "none"],
                   help="gradient averaging: mpi4py (mpirun), DDP (torchrun or mpirun), none (one process)")
    p.add_argument("--report", default=os.environ.get("DISTMEM_REPORT"), help="where rank 0 writes the JSON report")
    p.add_argument("--timeout", type=positive_number, default=None, help="seconds the report waits for every rank")
    return parse_example(p)


def choose_comm(requested):
    if requested != "auto":
        return requested
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "ddp"
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        return "mpi"
    return "none"


class Averager:
    """Average gradients over the ranks: mpi4py all-reduce of one flat buffer, DDP, or nothing."""

    def __init__(self, kind, model, dev):
        import torch

        self.kind, self.model, self.torch = kind, model, torch
        self.rank, self.size = 0, 1
        if kind == "mpi":
            from mpi4py import MPI

            self.mpi, self.comm = MPI, MPI.COMM_WORLD
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()
            self.comm.Bcast(flat, root=0)  # every rank starts from rank 0's weights
            torch.nn.utils.vector_to_parameters(torch.from_numpy(flat).to(dev), model.parameters())
        elif kind == "ddp":
            import torch.distributed as dist

            env = os.environ
            if "OMPI_COMM_WORLD_SIZE" in env and "RANK" not in env:  # DDP under mpirun: rendezvous on loopback
                env["RANK"], env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"]
                env.setdefault("MASTER_ADDR", "127.0.0.1")
                env.setdefault("MASTER_PORT", "29533")
            local = int(env.get("LOCAL_WORLD_SIZE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or 1)
            if dev.type == "cuda" and local > torch.cuda.device_count():
                raise SystemExit(f"--comm ddp with NCCL needs one GPU per rank ({local} ranks on this node, "
                                 f"{torch.cuda.device_count()} GPUs): NCCL refuses two ranks of one communicator "
                                 "on a GPU; use --comm mpi to share GPUs")
            kwargs = {"backend": "nccl" if dev.type == "cuda" else "gloo"}
            if dev.type == "cuda":
                kwargs["device_id"] = dev  # binds NCCL to the planned GPU: no stray context on GPU 0
            dist.init_process_group(**kwargs)
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            ids = [dev.index] if dev.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def average(self):
        if self.kind != "mpi" or self.size == 1:
            return  # DDP averaged during backward; one process has nothing to average
        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = self.torch.cat([p.grad.reshape(-1) for p in params]).cpu().numpy()
        self.comm.Allreduce(self.mpi.IN_PLACE, flat, op=self.mpi.SUM)
        flat /= self.size
        start = 0
        buf = self.torch.from_numpy(flat)
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(buf[start:start + n].view_as(p.grad))
            start += n

    def close(self):
        if self.kind == "ddp":
            import torch.distributed as dist

            dist.destroy_process_group()


def main():
    args = parse_args()
    kind = choose_comm(args.comm)
    options = {"overhead": args.overhead} if args.overhead else {}
    plan = distmem.init(strategy="data", framework="torch", memory=args.memory, **options)

    import torch
    from distmem.apply.torch import device as planned_device

    dev = planned_device(plan)
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10),
    ).to(dev)
    avg = Averager(kind, model, dev)
    net = avg.model
    opt = torch.optim.SGD(net.parameters(), lr=0.01 * avg.size, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1000 + avg.rank)
    t0 = time.monotonic()
    for step in range(args.steps):
        x = torch.rand(args.batch_size, 3, 32, 32, generator=gen).to(dev)
        y = torch.randint(0, 10, (args.batch_size,), generator=gen).to(dev)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        avg.average()
        opt.step()
        if avg.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            echo(f"[rank 0] step {step} loss {loss.item():.4f} on {dev}")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.monotonic() - t0
    rep = distmem.report(path=args.report, timeout=args.timeout)
    if rep is not None:
        echo(f"[rank 0] {args.steps} steps in {seconds:.1f} s; report of {plural(len(rep.ranks), 'rank')}, transport "
              f"{rep.aggregates.get('transport')}" + (f", written to {args.report}" if args.report else ""))
    avg.close()
    return 0


if __name__ == "__main__":
    run_example(main)
