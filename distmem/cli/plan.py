"""``distmem plan``: the plan of a whole job, without a GPU (declared fleet) or on this machine's GPUs.

It asks the same :class:`~distmem.plan.PlanRequest` ``init()`` asks on every rank, for every rank
of a declared job: the same defaults, ``DISTMEM_*`` settings and fleet (every host of a per-host
fleet with its own GPUs), the hosts and ranks the launcher would make.
"""
from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from ..console import say_back
from ..units import format_bytes, plural
from .request_args import add_request_arguments, request_from_args

__all__ = ["add_arguments", "run", "EXAMPLES"]

EXAMPLES = """examples:
  distmem plan --gpus 4x80GiB --ranks 8                       # 8 ranks on 4 GPUs: two per GPU, hard limits
  DISTMEM_FLEET=2x16GiB distmem plan --ranks 4                 # the declared fleet, as init() reads it
  distmem plan --gpus 'a=2x80GiB;b=2x16GiB'                    # one rank per GPU on each host, each its own GPUs
  distmem plan --gpus 4x16GiB --hosts a:4,b:2 --map-by cyclic  # uneven hosts, ranks dealt round them
  distmem plan --gpus 4x16GiB --strategy pipeline --stages 9GiB,7GiB,7GiB,5GiB
  distmem plan --gpus 1x16GiB --strategy tenants --tenants bert=6GiB,resnet=8GiB
  distmem plan --gpus 8x80GiB --strategy auto --model torchvision:resnet50 --global-batch-size 512
"""


def add_arguments(p: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> None:
    p.epilog = EXAMPLES
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_request_arguments(p, argv)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--emit", choices=["k8s"], default=None, help="emit deployment resources for the plan")
    from .k8s import add_cli_arguments as add_k8s_arguments

    add_k8s_arguments(p)


def run(args: argparse.Namespace) -> int:
    from .k8s import check_k8s_arguments

    check_k8s_arguments(args)  # before the plan: a name Kubernetes refuses is no reason to plan
    plan = request_from_args(args).plan()
    say_back()  # the sizes read in decimal units, before the plan they sized
    if args.emit == "k8s":
        from .k8s import emit_k8s

        print(emit_k8s(plan, args))
        return 0
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1, default=str))
        return 0
    pipe = plan.extras.get("pipeline") or {}
    if pipe.get("replicas", 0) > 1:
        print(f"{pipe['replicas']} pipelines of {pipe['num_stages']} stages side by side "
              f"({plan.world_size} ranks); give --ranks {pipe['num_stages']} for one")
    per_host = {}
    for a in plan.allocations:
        per_host[a.host] = per_host.get(a.host, 0) + 1
    hosts = plural(len(per_host), "host") + (" (" + ", ".join(f"{h}: {n}" for h, n in per_host.items()) + ")"
                                             if len(per_host) > 1 else "")
    fraction = plan.options.get("reserve_fraction") or 0
    reserve = f"{fraction:.0%} of each GPU" if fraction else f"{format_bytes(plan.reserve_bytes)} per GPU"
    print(f"plan: strategy {plan.strategy}, {plural(plan.world_size, 'rank')}, {hosts}, devices from "
          f"{plan.source}; per-process overhead {format_bytes(plan.overhead_bytes)}, reserve {reserve}")
    if pipe.get("headroom"):
        given = "each stage's bytes as given in --stages" if pipe.get("source") == "stages" else "each stage's demand"
        print(f"limits: {given} + {pipe['headroom']:.0%} headroom for the allocator's cache, in whole MiB "
              f"(--headroom 0 keeps the figures as they are)")
    shard = plan.extras.get("sharded") or {}
    if shard:
        mp = ", ".join(f"{k} {shard[k]}" for k in ("param_dtype", "reduce_dtype") if shard.get(k))
        print(f"sharded: {shard['sharding']} over {shard['degree']} ({plural(shard['groups'], 'shard group')})"
              + (f"; FSDP2 units: {shard['units']}" if shard.get("units") and str(shard['sharding']).startswith("fsdp2")
                 else "") + (f"; {mp}" if mp else ""))
    for a in plan.allocations[:256]:
        extra = ""
        if a.demand_bytes is not None:
            parts = [f"{k[:-len('_bytes')] if k.endswith('_bytes') else k} {format_bytes(v)}"
                     for k, v in a.breakdown.items() if k not in ("planned_bytes", "headroom_bytes")]
            extra = f"  demand {format_bytes(a.demand_bytes)}" + (" (" + ", ".join(parts) + ")" if parts else "")
        print("  " + a.describe() + (f" on {a.host}" if len(per_host) > 1 else "") + extra)
    if len(plan.allocations) > 256:
        print(f"  ... {len(plan.allocations) - 256} more ranks")
    from ..plan.from_report import describe_changes

    for line in describe_changes(plan):
        print(line)
    for w in plan.warnings:
        print(f"WARNING: {w}")
    return 0
