"""Train with DistributedDataParallel under a plan that counts DDP's buckets, then hold every rank's
peak against its planned demand.

    torchrun --nproc_per_node 4 examples/ddp_train.py            # one GPU per rank: NCCL
    torchrun --nproc_per_node 2 examples/ddp_train.py            # ranks sharing a GPU: Gloo
    python examples/ddp_train.py                                 # one process

``distmem.init(strategy="auto", wrapper="ddp", ...)`` estimates the model once (rank 0; ``--estimate
model``, the default here, sizes it by the estimator alone, so the check below holds distmem's rules,
not a measurement, against the peak), searches the
data-parallel layouts of the global batch over the job's ranks (``pipelines=[1]``, replicated state:
DDP), and gives each rank a limit from the chosen layout's demand: the step's allocator peak plus
DDP's gradient buckets (a flat copy of every gradient, and once, when the reducer rebuilds them,
a second set beside it), plus the allocator's headroom. The model then trains under
``DistributedDataParallel`` (NCCL where each rank has its own GPU, Gloo where ranks share one or run on
the CPU) with the loop the estimate assumes (``out = model(x); loss = crit(out, y); backward; step``).
At the end each rank's CUDA allocator peak is held against its planned demand: rank 0 prints one
line per rank and, with ``--check PCT``, exits 1 when a rank's peak is more than PCT% off. Without
a GPU the plan is computed (against DISTMEM_FLEET when set), the model trains on the CPU, and the
check says it has no peak to hold (torch's CPU allocator keeps no statistics). Without a GPU and
without DISTMEM_FLEET the plan is made against one 16 GiB GPU (``--fleet`` to name another), so
``torchrun --nproc_per_node 2 examples/ddp_train.py`` runs on any machine.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distmem.cli.checks import at_least, parse_example, positive_number, run_example  # noqa: E402
from distmem.console import echo  # noqa: E402

import distmem  # noqa: E402
from distmem import settings  # noqa: E402
from distmem.units import format_bytes  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=at_least(1), default=6, help="training steps (default 6)")
    p.add_argument("--global-batch-size", type=at_least(1), default=None,
                   help="samples per step over the job (default 64 per rank)")
    p.add_argument("--width", type=at_least(8), default=2048, help="the MLP's width (default 2048)")
    p.add_argument("--depth", type=at_least(1), default=6, help="hidden layers (default 6)")
    p.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    p.add_argument("--estimate", default="model", choices=["model", "auto", "measure"],
                   help="how the model is sized: model (the estimator alone, the default here: the figure held "
                        "against the peak is distmem's rule, not a measurement), auto or measure")
    p.add_argument("--check", type=positive_number, default=None, metavar="PCT",
                   help="exit 1 when a rank's peak is more than PCT%% off its planned demand")
    p.add_argument("--out", default=None, help="rank 0 writes every rank's peak, demand and limit here (JSON)")
    p.add_argument("--timeout", type=positive_number, default=None,
                   help="seconds a collective or the final exchange waits for every rank (default 300 / 60)")
    p.add_argument("--fleet", default=None, metavar="FLEET",
                   help="GPUs to plan against where this machine has none (a dry run; ignored where NVML finds GPUs): "
                        f"default DISTMEM_FLEET, else {CPU_FLEET}")
    return parse_example(p)


#: The fleet a machine without GPUs plans against (what the README's H200 runs had): the plan is
#: made and printed as on a GPU node, nothing is applied, and the model trains on the CPU over Gloo.
CPU_FLEET = "1x16GiB"


def build(width, depth, device):
    import torch

    with torch.device(device):
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1000))


def main():
    args = parse_args()
    size = int(os.environ.get("WORLD_SIZE", "1"))
    batch = args.global_batch_size or 64 * size
    if batch % size:
        raise SystemExit(f"--global-batch-size {batch} does not split over {size} ranks; give a multiple of {size}")
    import torch

    meta = build(args.width, args.depth, "meta")
    # strategy="auto" holds layouts against GPUs: without any here, against a declared fleet
    fleet = args.fleet or settings.fleet() or CPU_FLEET
    plan = distmem.init(strategy="auto", framework="torch", model=meta, global_batch_size=batch, fleet=fleet,
                        input_shape=(args.width,), optimizer="adamw", precision="float32", pipelines=[1],
                        shardings="none", wrapper="ddp_bucket_view" if args.bucket_view else "ddp", micro_batches=[batch // size], estimate=args.estimate)
    mine = plan.mine
    from distmem.apply.torch import device as planned_device

    dev = planned_device(plan)
    torch.manual_seed(1234)
    model = build(args.width, args.depth, dev)
    ddp = size > 1
    if ddp:
        import torch.distributed as dist

        per_gpu = dev.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count()
        import datetime

        # a rank that dies leaves the others waiting in a collective: bounded, not torch's 10-30 min
        kwargs = {"backend": "nccl" if per_gpu else "gloo",
                  "timeout": datetime.timedelta(seconds=args.timeout or 300)}
        if per_gpu:
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[dev.index] if dev.type == "cuda" else None,
            gradient_as_bucket_view=args.bucket_view)
    opt = torch.optim.AdamW(model.parameters())
    crit = torch.nn.CrossEntropyLoss()
    per_rank = batch // size
    gen = torch.Generator().manual_seed(1000 + plan.rank)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(args.steps):
        x = torch.randn(per_rank, args.width, generator=gen).to(dev)
        y = torch.randint(0, 1000, (per_rank,), generator=gen).to(dev)
        out = model(x)
        loss = crit(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if plan.rank == 0 and (step == 0 or step == args.steps - 1):
            echo(f"[rank 0] step {step} loss {loss.item():.4f} on {dev}")
        del out, loss
    peak = int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
    from distmem.comm import get_comm

    rows = get_comm().allgather({"rank": plan.rank, "peak": peak, "demand": mine.demand_bytes,
                                 "limit": mine.limit_bytes}, args.timeout or 60)
    bad = []
    if plan.rank == 0:
        for r in sorted(rows, key=lambda r: r["rank"]):
            if r["peak"] is None or not r["demand"]:
                echo(f"[rank {r['rank']}] no CUDA allocator peak to hold against the plan (CPU run)")
                continue
            off = 100.0 * (r["peak"] - r["demand"]) / r["demand"]
            echo(f"[rank {r['rank']}] peak {format_bytes(r['peak'])} against planned demand "
                 f"{format_bytes(r['demand'])} ({off:+.1f}%), limit {format_bytes(r['limit'] or 0)}")
            if args.check is not None and abs(off) > args.check:
                bad.append(r["rank"])
    if plan.rank == 0 and args.out:
        import json

        with open(args.out, "w") as f:
            json.dump({"example": "ddp_train", "ranks": size, "global_batch_size": batch, "width": args.width,
                       "depth": args.depth, "gradient_as_bucket_view": args.bucket_view, "estimate": args.estimate,
                       "backend": torch.distributed.get_backend() if ddp else None,
                       "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": sorted(rows, key=lambda r: r["rank"])}, f, indent=1)
    if ddp:
        torch.distributed.destroy_process_group()
    if bad:
        echo(f"ddp_train: ranks {bad} peaked more than {args.check:g}% off their planned demand; the plan's "
             f"breakdown (distmem plan --strategy auto ...) shows what it counted", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_example(main)
