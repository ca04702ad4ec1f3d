"""``strategy="auto"``: the best layout that fits (:mod:`distmem.plan.fit`), planned on the job as launched."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from ..discover.gpus import Inventory
from ..discover.identity import Topology
from ..errors import ConfigError, DoesNotFitError
from ..units import SizeLike, format_bytes
from .fit.costs import Costs
from .types import DEFAULT_RESERVE, Plan

__all__ = ["plan_auto"]


def plan_auto(topo: Topology, inv: Inventory, *, model: Any = None, global_batch_size: int,
              layers: Optional[Sequence[Any]] = None, layers_batch_size: Optional[int] = None,
              framework: Optional[str] = None, precision: Any = "auto", optimizer: Any = "adam",
              input_shape: Any = None, memory: str = "auto", reserve: SizeLike = DEFAULT_RESERVE,
              overhead: Any = None, foreign: SizeLike = 0, headroom: Optional[float] = None,
              costs: Optional[Dict[str, Costs]] = None, **options: Any) -> Plan:
    """Plan the best layout that fits for the job as launched (``topo.size`` ranks,
    ``topo.local_size`` per node, this node's GPUs), identically on every rank.

    The plan is a pipeline plan of the chosen layout's stages (one stage for data parallel) with
    each stage's limit its planned bytes, ``strategy="auto"``; ``plan.extras["fit"]`` carries
    ``micro_batch``, ``accumulation``, ``schedule``, ``recompute``, ``precision``, the stage map
    (``stages``: blocks per stage, ``rank_stage``: how ranks map to stages) and
    ``guard_start_batch`` (the OOM guard's starting micro-batch). Raises DoesNotFitError, with the
    best rejected layout and what would fit, when none does."""
    from .pipeline import plan_pipeline
    from .fit import fit

    observed = options.pop("layout", None)  # the job's observed layout: the chosen stages are placed on it
    if not inv.gpus:
        raise ConfigError("strategy='auto' holds layouts against GPUs, and this node shows none; declare the fleet "
                          "(DISTMEM_FLEET=8x80GiB) for a dry run, or use strategy='data' on CPU")
    fit_args = dict(global_batch_size=global_batch_size, gpus=inv, hosts=topo.num_hosts, framework=framework,
                    precision=precision, optimizer=optimizer, input_shape=input_shape, layers=layers,
                    layers_batch_size=layers_batch_size, costs=costs, headroom=headroom, reserve=reserve,
                    overhead=overhead, foreign=foreign, fixed_local_size=topo.local_size, top=1,
                    rejected=options.pop("rejected", 1), **options)
    from ..estimate import isolated

    if costs is None and layers is None and isolated.needs_child(model):
        # Building a Keras model here would start TensorFlow's GPUs before init() applies the plan.
        result = isolated.call("distmem.plan.fit:fit_without_costs", dict(fit_args, model=model))
    else:
        result = fit(model, **fit_args)
    chosen = result.chosen
    if chosen is None:
        best = result.rejected[0] if result.rejected else None
        why = ""
        if best is not None and best.binding is not None:
            b = best.binding
            why = (f"; the best layout, {best.layout.describe()}, needs {format_bytes(b.planned_bytes)} on stage "
                   f"{b.stage} against {format_bytes(b.share_bytes)} ({'; '.join(best.remedy)})")
        raise DoesNotFitError(f"no layout of {topo.size} rank(s) ({topo.local_size} per node, {len(inv.gpus)} GPU(s) "
                              f"per node) fits {result.model} at global batch {global_batch_size}{why}; "
                              f"{result.suggestion or 'run distmem fit for the layouts that do'}")
    lay = chosen.layout
    demands = [s.allocator_bytes for s in chosen.stages]
    plan = plan_pipeline(topo, inv, stages=demands, num_stages=lay.pipeline, num_micro_batches=lay.accumulation,
                         schedule=lay.schedule or "1f1b", recompute=lay.recompute, headroom=result.headroom,
                         memory=memory, reserve=reserve, overhead=int(chosen.outside["total_bytes"]), foreign=foreign,
                         layout=observed)
    plan.strategy = "auto"
    for a in plan.allocations:
        a.strategy = "auto"
        if lay.pipeline == 1:
            a.stage = None
    stage_map = [{"stage": s.stage, "first_block": s.first_block, "stop_block": s.stop_block, "blocks": s.blocks,
                  "in_flight": s.in_flight, "planned_bytes": s.planned_bytes} for s in chosen.stages]
    plan.extras["fit"] = {
        "layout": lay.to_dict(), "micro_batch": lay.micro_batch, "accumulation": lay.accumulation,
        "data_parallel": lay.data_parallel, "pipeline": lay.pipeline, "schedule": lay.schedule,
        "recompute": lay.recompute, "precision": lay.precision, "ranks_per_gpu": lay.ranks_per_gpu,
        "stages": stage_map, "rank_stage": "stage = rank % pipeline, replica = rank // pipeline",
        "guard_start_batch": lay.micro_batch, "step_units": round(lay.step_units(), 3),
        "outside": chosen.outside, "headroom": result.headroom, "model": result.model,
        "global_batch_size": global_batch_size,
    }
    plan.options.update(strategy_requested="auto", global_batch_size=global_batch_size)
    for w in result.warnings:
        if w not in plan.warnings:
            plan.warnings.append(w)
    return plan
