"""``strategy="auto"``: the best layout that fits (:func:`distmem.plan.fit.fit`), planned on the job
as launched.

The search runs for the ranks the job has (``size`` ranks, the ranks per host of its hosts) on
its hosts' GPUs: every host of a per-host fleet is held to its own GPUs, each GPU position planned
against its smallest (:func:`distmem.plan.request.worst_host`), so the chosen layout fits
whichever host each stage lands on, and every rank chooses the same one. The chosen layout's
stages become a pipeline plan (one stage for data parallel) with each stage's limit its planned
bytes; ``plan.extras["fit"]`` carries ``micro_batch``, ``accumulation``, ``schedule``,
``recompute``, ``precision``, the stage map (``stages``: blocks per stage, ``rank_stage``: how ranks
map to stages) and ``guard_start_batch`` (the OOM guard's starting micro-batch). Raises
DoesNotFitError, with the best rejected layout and what would fit, when none does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

from ... import settings
from ...errors import ConfigError, DoesNotFitError
from ...units import format_bytes, plural
from ..strategy import Strategy, option
from ..types import Plan
from ..wrappers import plan_wrapper
from .pipeline import PipelineOptions
from .pipeline import plan as plan_pipeline
from .text import comma_list, layers_file, shape, whole_number

if TYPE_CHECKING:
    from ..request import Context

__all__ = ["AutoOptions", "STRATEGY"]


def _ints(text: str) -> Sequence[int]:
    return [whole_number("a choice")(x) for x in comma_list(text)]


def _recompute(text: str) -> Any:
    value = {"auto": "auto", "on": True, "off": False, "true": True, "false": False}.get(str(text).strip().lower())
    if value is None:
        raise ConfigError(f"recompute={text!r}: use auto (try both), on or off")
    return value


@dataclass
class AutoOptions:
    global_batch_size: Optional[int] = option(None, parse=whole_number("global_batch_size"),
                                              help="samples per optimizer step, whole job (auto)")
    model: Any = option(None, metavar="SPEC", help="model to estimate, e.g. torchvision:resnet50 (auto)")
    layers: Optional[Sequence[Any]] = option(None, metavar="FILE.json", parse=layers_file,
                                             help="per-layer costs instead of --model (auto: with --layers-batch-size)")
    layers_batch_size: Optional[int] = option(None, parse=whole_number("layers_batch_size"),
                                              help="the batch --layers was measured at (auto; default 1)")
    precision: Any = option("auto", help="auto (tries fp32 and bf16), float32, mixed_bfloat16 or mixed_float16")
    optimizer: Any = option("adam", help="optimizer whose state is counted (default adam)")
    input_shape: Any = option(None, metavar="H,W,C", parse=shape, help="one sample without the batch axis")
    headroom: Any = option(None, metavar="PCT", help="allocator margin over the peak (default 10%%)")
    schedules: Any = option(None, parse=comma_list, help="pipeline schedules to try (default 1f1b,gpipe)")
    pipelines: Any = option(None, parse=_ints, help="pipeline degrees to try, e.g. 1,2,4 (default: all)")
    micro_batches: Any = option(None, parse=_ints, help="micro-batch sizes to allow, e.g. 8,16 (default: all)")
    recompute: Any = option("auto", parse=_recompute, help="activation recomputation: auto (try both), on, off")
    nccl: Any = option("auto", cli=False, help="count NCCL's buffers per communicator (auto) or not (False)")
    nccl_buffsize: Any = option(None, metavar="SIZE", help="NCCL_BUFFSIZE the job runs with (default NCCL's 4 MiB)")
    shardings: Any = option("auto", help="sharded data parallel to try: auto (zero1,zero2,fsdp2,fsdp2_keep), none, "
                                         "or a list")
    wrapper: Any = option("none", cli=False, help="the replicating wrapper whose buffers each rank holds (none, "
                                                  "horovod, ddp; auto: Horovod when this process sees HOROVOD_*)")
    rejected: int = option(1, cli=False, help="best rejected layouts to keep for the error")
    costs: Optional[Dict[str, Any]] = option(None, cli=False, help="precomputed fit costs per precision")
    framework: Optional[str] = option(None, cli=False, help="whose allocator and overhead to model")
    expandable_segments: Any = option("auto", cli=False,
                                      help="torch's expandable segments: auto (set by init() where the chosen "
                                           "layout needs them, unless DISTMEM_TORCH_EXPANDABLE_SEGMENTS or "
                                           "PYTORCH_ALLOC_CONF says otherwise), True, or False (limits leave "
                                           "room for the largest block instead)")


def _given(budget: Any, what: str) -> Any:
    """The budget's reserve or foreign use as fit takes it: bytes, or a percentage of each GPU."""
    fraction = getattr(budget, f"{what}_fraction")
    return f"{fraction * 100:g}%" if fraction else getattr(budget, f"{what}_bytes")


def _fit(ctx: "Context", opts: AutoOptions) -> Any:
    from ...estimate import isolated
    from ..fit import fit, fit_without_costs
    from ..request import worst_host

    gpus = worst_host(ctx.host_gpus)
    if not gpus:
        raise ConfigError("strategy='auto' holds layouts against GPUs, and this host shows none; declare the fleet "
                          "(DISTMEM_FLEET=8x80GiB) for a dry run, or use strategy='data' on CPU")
    if opts.global_batch_size is None:
        raise ConfigError("strategy='auto' needs global_batch_size= (samples per optimizer step, whole job), e.g. "
                          "init(strategy='auto', model=..., global_batch_size=256)")
    local = ctx.ranks_per_host("ranks per host")
    args: Dict[str, Any] = dict(
        global_batch_size=opts.global_batch_size, gpus=gpus, hosts=len(ctx.host_gpus), framework=opts.framework,
        precision=opts.precision, optimizer=opts.optimizer, input_shape=opts.input_shape, layers=opts.layers,
        layers_batch_size=opts.layers_batch_size, costs=opts.costs, headroom=ctx.budget.headroom,
        reserve=_given(ctx.budget, "reserve"), foreign=_given(ctx.budget, "foreign"), fixed_local_size=local, top=1,
        rejected=opts.rejected, recompute=opts.recompute, nccl=opts.nccl, nccl_buffsize=opts.nccl_buffsize,
        overhead=ctx.given_overhead, estimate=ctx.estimate_method, shardings=opts.shardings,
        wrapper=plan_wrapper(opts.wrapper, world_size=ctx.topo.size, on_gpu=True, env=ctx.env),
        expandable_segments=settings.torch_expandable_allowed(opts.expandable_segments, ctx.env))
    for name in ("schedules", "pipelines", "micro_batches"):
        if getattr(opts, name) is not None:
            args[name] = getattr(opts, name)
    if opts.costs is None and opts.layers is None:
        # One search per job: rank 0 estimates (and measures) and every rank gets its result. A Keras
        # model is built in a child: building it here would start TensorFlow's GPUs before init() applies.
        if isolated.needs_child(opts.model):
            return ctx.agreed(lambda: isolated.call("distmem.plan.fit:fit_without_costs", dict(args, model=opts.model),
                                                          hide_gpus=ctx.estimate_method == "model"))
        return ctx.agreed(lambda: fit_without_costs(opts.model, **args)) if ctx.agree is not None else \
            fit(opts.model, **args)
    return fit(opts.model, **args)


def plan(ctx: "Context", opts: AutoOptions) -> Plan:
    if (opts.model is None) == (opts.layers is None) and opts.costs is None:
        raise ConfigError("strategy='auto' needs exactly one of model= (a model or a spec such as "
                          "'torchvision:resnet50') or layers=[LayerCost, ...] with layers_batch_size=")
    result = _fit(ctx, opts)
    chosen = result.chosen
    topo = ctx.topo
    if chosen is None:
        best = result.rejected[0] if result.rejected else None
        why = ""
        if best is not None and best.binding is not None:
            b = best.binding
            why = (f"; the best layout, {best.layout.describe()}, needs {format_bytes(b.planned_bytes)} on stage "
                   f"{b.stage} against {format_bytes(b.share_bytes)} ({'; '.join(best.remedy)})")
        raise DoesNotFitError(f"no layout of {plural(topo.size, 'rank')} ({topo.local_size} per host, "
                              f"{plural(result.gpus_per_host, 'GPU')} per host) "
                              f"fits {result.model} at global batch {opts.global_batch_size}{why}; "
                              f"{result.suggestion or 'run distmem fit for the layouts that do'}")
    lay = chosen.layout
    stages = PipelineOptions(stages=[s.allocator_bytes for s in chosen.stages], num_stages=lay.pipeline,
                             num_micro_batches=lay.accumulation, schedule=lay.schedule or "1f1b",
                             recompute=lay.recompute, headroom=result.headroom, wrapper="none")
    budget = replace(ctx.budget, overhead_bytes=int(chosen.outside["total_bytes"]), headroom=result.headroom)
    plan_ = plan_pipeline(replace(ctx, budget=budget), stages)
    plan_.strategy = "auto"
    for a in plan_.allocations:
        a.strategy = "auto"
        if lay.pipeline == 1:
            a.stage = None
    stage_map = [{"stage": s.stage, "first_block": s.first_block, "stop_block": s.stop_block, "blocks": s.blocks,
                  "in_flight": s.in_flight, "planned_bytes": s.planned_bytes} for s in chosen.stages]
    plan_.extras["fit"] = {
        "layout": lay.to_dict(), "micro_batch": lay.micro_batch, "accumulation": lay.accumulation,
        "data_parallel": lay.data_parallel, "pipeline": lay.pipeline, "schedule": lay.schedule,
        "recompute": lay.recompute, "precision": lay.precision, "ranks_per_gpu": lay.ranks_per_gpu,
        "shard": lay.shard,
        "stages": stage_map, "rank_stage": "stage = rank % pipeline, replica = rank // pipeline",
        "guard_start_batch": lay.micro_batch, "step_units": round(lay.step_units(), 3),
        "outside": chosen.outside, "headroom": result.headroom, "model": result.model,
        "global_batch_size": opts.global_batch_size,
        # torch: the chosen limits hold only with the allocator's expandable segments; init() sets them
        # for the job before CUDA starts (distmem.apply.torch.prepare)
        "expandable_segments": bool(result.expandable_segments),
    }
    plan_.options.update(strategy_requested="auto", global_batch_size=opts.global_batch_size)
    for w in result.warnings:
        # the fit's note on expandable segments: said below as what init() does about it
        if w not in plan_.warnings and w != getattr(result, "allocator_note", None):
            plan_.warnings.append(w)
    if result.expandable_segments:
        plan_.warnings.append(
            "init() sets torch's expandable segments for this job before CUDA starts (PYTORCH_ALLOC_CONF="
            "expandable_segments:True, merged with the other settings there): under a hard limit torch's caching "
            "allocator strands free memory in the blocks it splits, and the limits assume them; "
            "DISTMEM_TORCH_EXPANDABLE_SEGMENTS=0 plans without them (limits with room for the largest block)")
    return plan_


STRATEGY = Strategy("auto", "the best layout that fits (distmem fit), planned on the job as launched", AutoOptions,
                    plan, derives_limits=True)
