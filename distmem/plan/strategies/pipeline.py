"""Pipeline parallel: ranks map to stages; each stage's limit is its demand plus headroom.

A job of ``size`` ranks runs ``size / p`` pipelines (data-parallel replicas) of ``p`` stages. With
the default ``rank_order="pipeline"`` consecutive ranks form one pipeline, so with ``p`` equal to
the ranks per host (the default) there is one pipeline per host and the stage is the local rank.
``rank_order="replica"`` puts the ``size / p`` replicas of a stage on consecutive ranks instead.

A stage's demand (bytes) is its layers' weights + gradients + optimizer state plus the activations
of one micro-batch times the micro-batches it holds in flight (GPipe: all ``m``; 1F1B:
``min(p - s, m)`` at stage ``s``); with ``recompute=True`` only the stage inputs of the in-flight
micro-batches are kept plus one micro-batch's full activations. Stage demands come either from an
explicit list (``stages=["9GiB", "7GiB"]``) or from per-layer costs (``layers=`` or ``model=``)
that are partitioned exactly, with the stage-dependent multiplier (:mod:`distmem.plan.partition`).
Each stage's limit is its demand plus headroom (:meth:`distmem.plan.budget.Budget.limit_for`; the
framework's default headroom when none is given), and must fit the rank's share of its GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

from ...errors import ConfigError, DoesNotFitError
from ...units import MiB, SizeLike, format_bytes, parse_bytes, plural
from ...discover.gpus import Gpu
from ..budget import Budget, growth_note, idle_warnings, slot
from ..partition import SCHEDULES, Partition, StageDemand, layers_from_dicts, partition_pipeline
from ..strategy import Strategy, option
from ..wrappers import WRAPPER_CHOICES, added_bytes, fixed_bytes, grad_fraction, plan_wrapper
from ..types import Allocation, Plan
from .text import comma_list, layers_file, shape, whole_number

if TYPE_CHECKING:
    from ..request import Context

__all__ = ["PipelineOptions", "STRATEGY", "stage_of_rank", "RANK_ORDERS", "stage_demands_of"]

RANK_ORDERS = ("pipeline", "replica")


@dataclass
class PipelineOptions:
    stages: Optional[Sequence[SizeLike]] = option(
        None, metavar="SIZES", parse=comma_list, help="explicit per-stage demand, e.g. 9GiB,7GiB,7GiB,5GiB")
    layers: Optional[Sequence[Any]] = option(
        None, metavar="FILE.json", parse=layers_file,
        help="per-layer costs for one micro-batch: a JSON list of {name, state_bytes, activation_bytes, output_bytes} "
             "(or what `distmem estimate --per-layer --json` writes)")
    model: Any = option(None, metavar="SPEC", help="model to estimate per layer, e.g. keras:ResNet50 or "
                                                   "torchvision:resnet50")
    num_stages: Optional[int] = option(None, parse=whole_number("num_stages"),
                                       help="pipeline stages (default: ranks per host; --stages gives its count)")
    micro_batch_size: Optional[int] = option(None, parse=whole_number("micro_batch_size"),
                                             help="samples per micro-batch (the estimate's batch with --model)")
    num_micro_batches: Optional[int] = option(None, parse=whole_number("num_micro_batches"),
                                              help="micro-batches per step (default: the number of stages)")
    schedule: str = option("1f1b", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    recompute: bool = option(False, flag=True, help="activation recomputation: keep only stage inputs per "
                                                    "micro-batch in flight plus one micro-batch's activations")
    input_bytes: SizeLike = option(0, metavar="SIZE", help="model input per micro-batch, held by the first stage")
    rank_order: str = option("pipeline", choices=RANK_ORDERS,
                             help="pipeline: consecutive ranks form one pipeline; replica: consecutive ranks share a "
                                  "stage")
    headroom: Optional[SizeLike] = option(
        None, metavar="PCT", help="added to each stage's demand for the allocator (default 10%%; 52%% for torch "
                                  "under memory growth); 0 keeps the bytes as they are")
    optimizer: Optional[str] = option(None, help="optimizer for the estimate (sgd, momentum, adam)")
    input_shape: Optional[Sequence[int]] = option(None, metavar="H,W,C", parse=shape,
                                                  help="model input shape without the batch axis, e.g. 96,96,3")
    wrapper: Optional[str] = option("none", choices=WRAPPER_CHOICES,
                                    help="the data-parallel wrapper whose buffers each stage also holds: none "
                                         "(default), horovod, ddp, ddp_bucket_view, tf_distribute, or auto (Horovod "
                                         "when this process sees HOROVOD_*: a dry run does not) (distmem.plan.wrappers)")
    exchange_bytes: SizeLike = option(
        0, metavar="SIZE", help="what the stages' own activation exchange holds in the framework's allocator at "
                                "once (e.g. an all-gather's input and output), added to every computed stage")


def stage_of_rank(rank: int, size: int, num_stages: int, rank_order: str = "pipeline") -> Tuple[int, int]:
    """(stage, replica) of ``rank``. ``"pipeline"``: ranks ``[r*p, (r+1)*p)`` form replica ``r``'s
    pipeline; ``"replica"``: ranks ``[s*d, (s+1)*d)`` are the ``d = size / p`` replicas of stage ``s``."""
    if rank_order not in RANK_ORDERS:
        raise ConfigError(f"rank_order={rank_order!r} is not one of {', '.join(RANK_ORDERS)}")
    if num_stages < 1 or size % num_stages:
        raise ConfigError(f"{plural(size, 'rank')} do not divide into pipelines of {plural(num_stages, 'stage')}; the job needs "
                          f"replicas x stages = ranks: launch a multiple of {num_stages} ranks or change num_stages")
    if rank_order == "pipeline":
        return rank % num_stages, rank // num_stages
    replicas = size // num_stages
    return rank // replicas, rank % replicas


def _explicit_stages(stages: Sequence[SizeLike], num_stages: Optional[int]) -> List[StageDemand]:
    if num_stages is not None and num_stages != len(stages):
        raise ConfigError(f"stages= lists {plural(len(stages), 'stage')} but num_stages={num_stages}; give one size per stage")
    out = []
    for s, value in enumerate(stages):
        nbytes = parse_bytes(value, what=f"stages[{s}]")
        if nbytes < MiB:
            raise ConfigError(f"stages[{s}]={value!r} is {nbytes} bytes: a stage's demand is a size of at least 1 MiB "
                              "(e.g. 9GiB); the number of stages is num_stages= (--num-stages 4, -o num_stages=4)")
        out.append(StageDemand(stage=s, start=s, stop=s + 1, state_bytes=nbytes, activation_bytes=0,
                               boundary_bytes=0, in_flight=1))
    return out


def _does_not_fit(stage: StageDemand, rank: int, gpu: Gpu, share: int, shared_by: int,
                  budget: Budget, schedule: Optional[str], recompute: bool, explicit: bool) -> DoesNotFitError:
    gpu_index, total = gpu.index, gpu.total_bytes
    reserve, foreign = budget.reserve_of(gpu), budget.foreign_of(gpu)
    detail = "as given in stages=" if explicit else f"({stage.describe()})"
    sharing = f", shared by {shared_by} ranks" if shared_by > 1 else ""
    remedies = ["use more stages", "fewer micro-batches in flight (num_micro_batches=)"]
    if explicit:
        # Bytes the user stated: no schedule or recomputation to change, only where they go.
        short = stage.total_bytes - share
        parts = max(-(-stage.total_bytes // max(share, 1)), 2)
        piece = format_bytes(-(-stage.total_bytes // parts)).replace(" ", "")
        remedies = [f"a GPU of at least {format_bytes(total + shared_by * short)}",
                    f"split stage {stage.stage} into {parts} stages of at most {format_bytes(share)} (e.g. "
                    f"{','.join([piece] * parts)} in its place in stages=, with a rank for each added stage)"]
        if shared_by > 1:
            remedies.append("fewer ranks per GPU")
        if short <= reserve + budget.overhead_bytes:
            remedies.append(f"if this machine needs less, a smaller reserve= ({format_bytes(reserve)}) "
                            f"or overhead= ({format_bytes(budget.overhead_bytes)})")
        head = (f" (its {budget.headroom:.0%} headroom is not the cause: headroom is dropped where it does not "
                "fit)") if budget.headroom else ""
        return DoesNotFitError(
            f"stage {stage.stage} needs {format_bytes(stage.total_bytes)} as given in stages={head} but its GPU offers "
            f"{format_bytes(share)} after the reserve, {format_bytes(short)} short (rank {rank} on GPU {gpu_index} of "
            f"{format_bytes(total)}{sharing}: reserve {format_bytes(reserve)}, foreign "
            f"{format_bytes(foreign)}, per-process overhead {format_bytes(budget.overhead_bytes)}); "
            "use " + "; or ".join(remedies))
    if schedule == "gpipe":
        remedies.append("schedule='1f1b'")
    if not recompute:
        remedies.append("recompute=True")
    if shared_by > 1:
        remedies.append("fewer ranks per GPU")
    remedies.append("or a larger GPU")
    return DoesNotFitError(
        f"stage {stage.stage} needs {format_bytes(stage.total_bytes)} {detail} but its GPU offers "
        f"{format_bytes(share)} after the reserve (rank {rank} on GPU {gpu_index} of {format_bytes(total)}"
        f"{sharing}: reserve {format_bytes(reserve)}, foreign {format_bytes(foreign)}, "
        f"per-process overhead {format_bytes(budget.overhead_bytes)}); " + ", ".join(remedies))


def stage_demands_of(ctx: "Context", opts: PipelineOptions,
                     default_stages: int) -> Tuple[List[StageDemand], int, Optional[int], Optional[Partition]]:
    """The stages' demands, their count, the micro-batches per step and the partition (None for
    stated bytes). Raises on options that do not make a pipeline."""
    given = [k for k, v in (("stages", opts.stages), ("layers", opts.layers), ("model", opts.model)) if v is not None]
    if len(given) != 1:
        raise ConfigError("strategy='pipeline' needs exactly one of stages=['9GiB', '7GiB', ...] (bytes per stage), "
                          "layers=[LayerCost, ...] (per-layer costs) or model= (estimated per layer) - on the command "
                          "line --stages 9GiB,7GiB, --layers FILE.json or --model SPEC; got "
                          + (", ".join(given) or "none"))
    if opts.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={opts.schedule!r} is not one of {', '.join(SCHEDULES)}")
    for name in ("num_stages", "num_micro_batches", "micro_batch_size"):
        value = getattr(opts, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}={value!r}: give a whole number, at least 1")
    if opts.stages is not None:
        if isinstance(opts.stages, (str, bytes)) or not opts.stages:
            raise ConfigError(f"stages={opts.stages!r} is empty or not a list: give one size per pipeline stage, e.g. "
                              "stages=['9GiB', '7GiB']")
        if opts.micro_batch_size is not None:
            raise ConfigError("micro_batch_size= sizes the estimate of layers= or model=; stages= states bytes per "
                              "stage already: drop micro_batch_size")
        demands = _explicit_stages(list(opts.stages), opts.num_stages)
        return demands, len(demands), opts.num_micro_batches, None
    p = opts.num_stages if opts.num_stages is not None else default_stages
    m = opts.num_micro_batches if opts.num_micro_batches is not None else p
    layers = opts.layers
    if opts.model is not None:
        layers = ctx.estimate_layers(opts.model, batch_size=opts.micro_batch_size, optimizer=opts.optimizer,
                                   input_shape=opts.input_shape)
    part = partition_pipeline(layers_from_dicts(list(layers or [])), p, num_micro_batches=m, schedule=opts.schedule,
                              recompute=opts.recompute, input_bytes=parse_bytes(opts.input_bytes, what="input_bytes"),
                              accumulate=(ctx.framework, grad_fraction(opts.optimizer)))
    return part.stages, p, m, part


def plan(ctx: "Context", opts: PipelineOptions) -> Plan:
    budget = ctx.budget
    demands, p, m, partition = stage_demands_of(ctx, opts, ctx.ranks_per_host("num_stages"))
    explicit = partition is None
    # the wrapper reduces gradients over the stage's data-parallel replicas (size / p of them)
    wrapper = plan_wrapper(opts.wrapper, world_size=max(ctx.topo.size // max(p, 1), 1),
                           on_gpu=any(pl.gpu is not None for pl in ctx.places), env=ctx.env, framework=ctx.framework)
    # bytes stated per stage (stages=) are the stage's whole demand; a computed one adds the wrapper's
    added = [0 if explicit else added_bytes(wrapper, int(d.state_bytes * grad_fraction(opts.optimizer)))
             for d in demands]
    if any(added):
        demands = [replace(d, state_bytes=d.state_bytes + a) for d, a in zip(demands, added)]
    exchange = parse_bytes(opts.exchange_bytes, what="exchange_bytes")
    if exchange < 0:
        raise ConfigError(f"exchange_bytes={opts.exchange_bytes!r}: give the bytes the exchange holds, 0 or more")
    if exchange and explicit:
        raise ConfigError(f"exchange_bytes={opts.exchange_bytes!r} adds to stages computed from layers= or model=; "
                          "stages= states each stage's whole bytes already: include the exchange in them and drop "
                          "exchange_bytes")
    if exchange:
        demands = [replace(d, state_bytes=d.state_bytes + exchange) for d in demands]
    stage_of_rank(0, ctx.topo.size, p, opts.rank_order)  # validates size % p and the order
    fixed = [fixed_bytes(wrapper) if a else 0 for a in added]  # kept buffers: added after the headroom
    wants = [budget.limit_for(d.total_bytes - f) + f for d, f in zip(demands, fixed)]
    breakdowns = [({k: v for k, v in d.breakdown().items() if k.endswith("_bytes") and k != "demand_bytes"}
                   if not explicit else {}) for d in demands]
    for bd, a in zip(breakdowns, added):
        if a:
            bd["state_bytes"] -= a
            bd["wrapper_bytes"] = a
        if exchange:
            bd["state_bytes"] -= exchange
            bd["exchange_bytes"] = exchange
    notes = [("" if explicit else f": layers {d.start}..{d.stop - 1}, {opts.schedule} holds {d.in_flight} "
                                  f"micro-batch(es){' (recompute)' if opts.recompute else ''}") for d in demands]
    enforce = budget.enforced(always=True)
    limits: Dict[Tuple[int, int, int], int] = {}
    allocations: List[Allocation] = []
    warnings: List[str] = []
    used: Dict[str, Set[str]] = {}
    for pl in ctx.places:
        stage, replica = stage_of_rank(pl.rank, ctx.topo.size, p, opts.rank_order)
        d = demands[stage]
        alloc = Allocation(pl.rank, pl.local_rank, pl.host, "pipeline", "cpu", stage=stage, replica=replica,
                           demand_bytes=d.total_bytes, breakdown=dict(breakdowns[stage], planned_bytes=wants[stage],
                                                                      headroom_bytes=wants[stage] - d.total_bytes),
                           notes=[f"stage {stage} of {p}, replica {replica}{notes[stage]}"], headroom=budget.headroom)
        if pl.gpu is not None:
            gpu, k = pl.gpu, pl.shared_by
            used.setdefault(pl.host, set()).add(gpu.uuid)
            key = (stage, gpu.total_bytes - gpu.reserved_bytes, k)
            if key not in limits:
                share = budget.share(gpu, k)
                if d.total_bytes > share:
                    raise _does_not_fit(d, pl.rank, gpu, share, k, budget,
                                        None if explicit else opts.schedule, opts.recompute, explicit)
                limits[key] = min(wants[stage], share)
                if wants[stage] > share:
                    warnings.append(f"stage {stage}: headroom cut to {format_bytes(share - d.total_bytes)} "
                                    f"(wanted {budget.headroom:.0%} of {format_bytes(d.total_bytes)}) to fit GPU "
                                    f"{gpu.index}'s {format_bytes(share)}")
            limit = limits[key]
            alloc.breakdown["planned_bytes"] = limit
            alloc.breakdown["headroom_bytes"] = limit - d.total_bytes
            if limit < wants[stage]:  # cut to fit: say what is left, not what was asked
                alloc.headroom = (limit - d.total_bytes) / d.total_bytes if d.total_bytes else 0.0
            alloc.mode = "limit" if enforce else "growth"
            alloc.devices = [slot(gpu, limit, enforce=enforce, shared_by=k, label=f"stage {stage}")]
            note = growth_note(k, "stage") if budget.memory == "growth" else None
            if note:
                alloc.notes.append(note)
        allocations.append(alloc)
    warnings += idle_warnings(ctx.seen_gpus(), used)
    extras: Dict[str, Any] = {"pipeline": {
        "num_stages": p, "replicas": ctx.topo.size // p, "rank_order": opts.rank_order, "schedule": opts.schedule,
        "num_micro_batches": m, "micro_batch_size": opts.micro_batch_size, "recompute": bool(opts.recompute),
        "headroom": budget.headroom, "wrapper": wrapper.describe() if wrapper else None,
        "wrapper_bytes": added,
        "source": "stages" if explicit else ("model" if opts.model is not None else "layers"),
        "stages": [{"stage": d.stage, "demand_bytes": d.total_bytes, "planned_bytes": wants[d.stage],
                    **({} if explicit else {"in_flight": d.in_flight, "first_layer": d.start,
                                             "stop_layer": d.stop})} for d in demands],
    }}
    if partition is not None:
        extras["pipeline"]["partition"] = partition.to_dict()
    options = dict(schedule=opts.schedule, num_stages=p, num_micro_batches=m, recompute=bool(opts.recompute),
                   rank_order=opts.rank_order, micro_batch_size=opts.micro_batch_size)
    return ctx.make_plan("pipeline", allocations, options, extras=extras, warnings=warnings)


STRATEGY = Strategy("pipeline", "per-stage limits: each stage's demand plus headroom", PipelineOptions, plan,
                    derives_limits=True)
