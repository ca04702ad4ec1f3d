"""``distmem plan``: compute and print a plan without a GPU (declared fleet) or on this node."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict

from .. import settings
from ..discover.gpus import fleet_inventory, inventory
from ..plan import make_plan
from ..discover.identity import Topology
from ..units import format_bytes
from .strategy_args import STRATEGY_ARGUMENTS

__all__ = ["add_arguments", "run", "EXAMPLES"]


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


EXAMPLES = """examples:
  distmem plan --gpus 4x80GiB --ranks 8                       # 8 ranks on 4 GPUs: two per GPU, hard limits
  DISTMEM_FLEET=2x16GiB distmem plan --ranks 4                 # the declared fleet, as init() reads it
  distmem plan --gpus 4x16GiB --strategy pipeline --stages 9GiB,7GiB,7GiB,5GiB
  distmem plan --gpus 1x16GiB --strategy tenants --tenants bert=6GiB,resnet=8GiB
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EXAMPLES
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--strategy", default="data", choices=["data", "pipeline", "model", "tenants"],
                   help="data: equal split of each GPU among the ranks on it; pipeline: per-stage limits; model: "
                        "per-layer groups over each rank's GPUs; tenants: named slices of one GPU (default data)")
    p.add_argument("--gpus", "--fleet", dest="gpus", metavar="FLEET",
                   help="declared GPUs per node, e.g. 4x80GiB, 2x80GiB,2x40GiB or a=2x80GiB;b=2x16GiB (default: "
                        "DISTMEM_FLEET, else this node's GPUs from NVML)")
    p.add_argument("--ranks", type=int, default=None, help="total ranks (default: one per GPU)")
    p.add_argument("--ranks-per-host", type=int, default=None, help="ranks on each node (default: --ranks)")
    p.add_argument("--memory", default="auto", choices=["auto", "growth", "limit"],
                   help="auto: growth alone on a GPU, a hard limit when shared; growth: never limit; limit: always")
    p.add_argument("--reserve", default="256MiB", help="kept free on every GPU (bytes, 256MiB, 5%%)")
    p.add_argument("--limit", default=None, help="explicit per-rank limit for --strategy data: a size (6GiB), a "
                                                  "percentage (45%%) or a fraction of the GPU (0.4); an integer is bytes")
    p.add_argument("--overhead", default=None, help="per-process memory outside the allocator (default 768MiB)")
    p.add_argument("--foreign", default="0", help="memory other jobs hold on each GPU")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--emit", choices=["k8s"], default=None, help="emit deployment resources for the plan")
    from .k8s import add_cli_arguments as add_k8s_arguments

    add_k8s_arguments(p)
    for add, _ in STRATEGY_ARGUMENTS.values():
        add(p)


def _options(args: argparse.Namespace) -> Dict[str, Any]:
    opts: Dict[str, Any] = dict(memory=args.memory, reserve=args.reserve, overhead=args.overhead,
                                foreign=args.foreign)
    if args.strategy == "data":
        opts["limit"] = args.limit
    else:
        opts.update(STRATEGY_ARGUMENTS[args.strategy][1](args))
    return opts


def run(args: argparse.Namespace) -> int:
    fleet = args.gpus or settings.fleet()
    what = "--gpus" if args.gpus else "DISTMEM_FLEET"
    inv = fleet_inventory(fleet, what=what) if fleet else inventory()
    per_host = args.ranks_per_host or args.ranks or max(len(inv.gpus), 1)
    ranks = args.ranks or per_host
    topo = Topology(rank=0, size=ranks, local_rank=0, local_size=per_host, host="host0", source="cli")
    plan = make_plan(args.strategy, topo, inv, **_options(args))
    if args.emit == "k8s":
        from .k8s import emit_k8s  # written with the launch templates

        print(emit_k8s(plan, args))
        return 0
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1, default=str))
        return 0
    pipelines = (plan.extras.get("pipeline") or {}).get("replicas")
    if pipelines and pipelines > 1:
        print(f"{pipelines} pipelines of {plan.extras['pipeline']['num_stages']} stages side by side "
              f"({plan.world_size} ranks); give --ranks {plan.extras['pipeline']['num_stages']} for one")
    print(f"plan: strategy {plan.strategy}, {_n(plan.world_size, 'rank')}, {per_host} per node, devices from "
          f"{plan.source}; per-process overhead {format_bytes(plan.overhead_bytes)}, reserve "
          f"{format_bytes(plan.reserve_bytes)} per GPU")
    pipe = plan.extras.get("pipeline") or {}
    if pipe.get("headroom"):
        given = "each stage's bytes as given in --stages" if pipe.get("source") == "stages" else "each stage's demand"
        print(f"limits: {given} + {pipe['headroom']:.0%} headroom for the allocator's cache, in whole MiB "
              f"(--headroom 0 keeps the figures as they are)")
    for a in plan.allocations[:256]:
        extra = ""
        if a.demand_bytes is not None:
            parts = [f"{k[:-len('_bytes')] if k.endswith('_bytes') else k} {format_bytes(v)}"
                     for k, v in a.breakdown.items() if k not in ("planned_bytes", "headroom_bytes")]
            extra = f"  demand {format_bytes(a.demand_bytes)}" + (" (" + ", ".join(parts) + ")" if parts else "")
        print("  " + a.describe() + extra)
    if len(plan.allocations) > 256:
        print(f"  ... {len(plan.allocations) - 256} more ranks")
    for w in plan.warnings:
        print(f"WARNING: {w}")
    return 0
