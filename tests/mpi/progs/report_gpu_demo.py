"""Real-GPU scenarios for the report (no fakes; needs NVIDIA GPUs, torch, mpi4py, nvidia-ml-py):

  shared  mpirun -np 2 on 2 GPUs: the plan gives each rank its own GPU; rank 1 then also allocates on
          cuda:0 (the hard-coded-device mistake). distmem.report() must name ranks 0 and 1 on GPU 0,
          from NVML's real process lists, in full and in summary mode.
  train   mpirun -np 4 on 2 GPUs (two ranks per GPU, hard limits): a small torch training loop with
          ReportEvery(20); rank-dependent batch sizes, and rank 3 deliberately leaks 6 GiB every 20
          steps (while its peak stays under 95% of its limit) so the timeline and warnings have something to show.

Rank 0 writes the reports (JSON) to --out. Render a PNG with `distmem report OUT/train-timeline.json --plot x.png`.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from mpi4py import MPI  # noqa: E402

import distmem  # noqa: E402

GiB = 1024 ** 3


def shared(out: str) -> None:
    import torch

    rank = MPI.COMM_WORLD.Get_rank()
    plan = distmem.init(framework="torch", verbose=rank == 0)
    mine = plan.mine.devices[0].index
    x = torch.ones(256 * (rank + 1), 1024, 1024, device=f"cuda:{mine}")  # 1 GiB x (rank + 1) on its own GPU
    stray = torch.ones(128, 1024, 1024, device="cuda:0") if rank == 1 else None  # rank 1: 512 MiB on GPU 0
    torch.cuda.synchronize()
    MPI.COMM_WORLD.Barrier()
    snap = distmem.snapshot()  # one read of the live figures, seen through both paths
    full = distmem.report(timeout=60, print_table=rank == 0, snapshot=snap)
    summ = distmem.report(timeout=60, detail="summary", print_table=rank == 0, snapshot=snap)
    del x, stray
    if rank == 0:
        with open(os.path.join(out, "shared.json"), "w") as f:
            json.dump({"full": full.to_dict(), "summary": summ.to_dict(), "plan": plan.to_dict()}, f, default=str)


def train(out: str, steps: int) -> None:
    import torch

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    plan = distmem.init(framework="torch", verbose=rank == 0)
    dev = torch.device(f"cuda:{plan.mine.devices[0].index}")
    limit = plan.mine.limit_bytes
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    batch = 64 * (1 + rank)  # uneven shards: each rank's activations differ
    leak = []
    from distmem.report.periodic import ReportEvery

    every = ReportEvery(20, path=os.path.join(out, "train-timeline.json"), flush_seconds=0)
    t0 = time.time()
    for step in range(1, steps + 1):
        x = torch.randn(batch, 3, 128, 128, device=dev)
        y = torch.randint(0, 10, (batch,), device=dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        # A gradient all-reduce stands in for DDP/Horovod: it keeps the ranks in step.
        for p in model.parameters():
            buf = p.grad.detach().cpu().numpy()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            p.grad.copy_(torch.from_numpy(buf / comm.Get_size()))
        opt.step()
        if rank == 3 and step % 20 == 0 and torch.cuda.max_memory_allocated(dev) + 6 * GiB < 0.95 * limit:
            leak.append(torch.empty(6 * GiB, dtype=torch.uint8, device=dev))  # the deliberate leak, kept < 95%
        every.step()
    rep = every.close()
    if rank == 0:
        print(f"[rank 0] {steps} steps in {time.time() - t0:.1f} s; {len(rep.timeline)} timeline points")
        from distmem.report.sinks import table

        print(table(rep))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["shared", "train"])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shared(args.out) if args.scenario == "shared" else train(args.out, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
