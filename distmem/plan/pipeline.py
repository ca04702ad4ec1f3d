"""Pipeline parallel: ranks map to stages; each stage's limit is its demand plus headroom.

A job of ``size`` ranks runs ``size / p`` pipelines (data-parallel replicas) of ``p`` stages. With
the default ``rank_order="pipeline"`` consecutive ranks form one pipeline, so with ``p`` equal to
the ranks per node (the default) there is one pipeline per node and the stage is the local rank.
``rank_order="replica"`` puts the ``size / p`` replicas of a stage on consecutive ranks instead.

A stage's demand (bytes) is its layers' weights + gradients + optimizer state plus the activations
of one micro-batch times the micro-batches it holds in flight (GPipe: all ``m``; 1F1B:
``min(p - s, m)`` at stage ``s``); with ``recompute=True`` only the stage inputs of the in-flight
micro-batches are kept plus one micro-batch's full activations. Stage demands come either from an
explicit list (``stages=["9GiB", "7GiB"]``) or from per-layer costs (``layers=`` or ``model=``)
that are partitioned exactly, with the stage-dependent multiplier (:mod:`distmem.plan.partition`).
"""
from __future__ import annotations


import importlib
import math
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..costs import LayerCost
from ..discover.gpus import Inventory
from ..discover.layout import Layout
from ..errors import ConfigError, DoesNotFitError
from ..discover.identity import Topology
from ..units import MiB, SizeLike, format_bytes, parse_bytes, plural
from .types import DEFAULT_RESERVE, Allocation, DeviceSlot, Plan
from .common import Options, equal_share, idle_gpus, places, resolve_options
from .partition import SCHEDULES, Partition, StageDemand, layers_from_dicts, partition_pipeline

__all__ = ["plan_pipeline", "stage_of_rank", "planned_bytes", "layers_from_model", "RANK_ORDERS"]

RANK_ORDERS = ("pipeline", "replica")


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


def planned_bytes(demand: int, headroom: float) -> int:
    """``demand x (1 + headroom)`` rounded UP to whole MiB (the limit a stage gets), in bytes."""
    return int(math.ceil(demand * (1.0 + headroom) / MiB)) * MiB


def layers_from_model(model: Any, *, batch_size: Optional[int] = None, optimizer: Optional[str] = None,
                      input_shape: Optional[Sequence[int]] = None, **estimate_options: Any) -> List[LayerCost]:
    """Per-layer costs of ``model`` through ``distmem.estimate`` (a Keras model, or a spec such as
    ``"keras:ResNet50"``); a thin adapter so planners keep taking ``List[LayerCost]``."""
    if isinstance(model, (list, tuple)):
        return layers_from_dicts(model)
    if isinstance(model, str):
        from ..estimate import isolated

        if isolated.needs_child(model):
            # Building a Keras model here would start TensorFlow's GPUs before init() applies the plan.
            return isolated.call("distmem.plan.pipeline:layers_from_model",
                                 dict(model=model, batch_size=batch_size, optimizer=optimizer, input_shape=input_shape,
                                      **estimate_options))
    try:
        # import_module consults sys.modules first, unlike `from .. import estimate`, which would
        # return the package attribute even where the module has been replaced or removed.
        est = importlib.import_module("distmem.estimate")
    except ImportError as exc:
        raise ConfigError(f"model= needs distmem's per-layer estimator (distmem.estimate), which did not import "
                          f"({exc}); pass layers=[LayerCost(...), ...] or stages=['9GiB', ...] instead") from None
    if isinstance(model, str):
        try:
            from ..estimate.loader import load_model
        except ImportError as exc:
            raise ConfigError(f"model={model!r}: cannot load model specs ({exc}); build the model and pass it") from None
        model = load_model(model, input_shape)
    is_torch = type(model).__module__.startswith("torch") or hasattr(model, "named_modules")
    fn = getattr(est, "estimate_torch" if is_torch else "estimate_keras", None) or getattr(est, "estimate", None)
    if fn is None:
        raise ConfigError(f"distmem.estimate has no estimator for {type(model).__name__}; pass layers= instead")
    kwargs: Dict[str, Any] = dict(estimate_options)
    if batch_size is not None:
        kwargs["batch_size"] = batch_size
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    result = fn(model, **kwargs)
    for attr in ("layer_costs", "to_layer_costs", "costs"):
        got = getattr(result, attr, None)
        if got is not None:
            result = got() if callable(got) else got
            break
    else:
        result = getattr(result, "layers", result)
    layers = layers_from_dicts(list(result))
    if not layers:
        raise ConfigError(f"the estimator found no layers in {type(model).__name__}; pass layers= instead")
    return layers


def _explicit_stages(stages: Sequence[SizeLike], num_stages: Optional[int]) -> List[StageDemand]:
    if num_stages is not None and num_stages != len(stages):
        raise ConfigError(f"stages= lists {plural(len(stages), 'stage')} but num_stages={num_stages}; give one size per stage")
    out = []
    for s, value in enumerate(stages):
        nbytes = parse_bytes(value, what=f"stages[{s}]")
        if nbytes <= 0:
            raise ConfigError(f"stages[{s}]={value!r}: a stage needs a positive size")
        out.append(StageDemand(stage=s, start=s, stop=s + 1, state_bytes=nbytes, activation_bytes=0,
                               boundary_bytes=0, in_flight=1))
    return out


def _does_not_fit(stage: StageDemand, rank: int, gpu_index: int, total: int, share: int, shared_by: int,
                  opts: Options, schedule: Optional[str], recompute: bool, explicit: bool) -> DoesNotFitError:
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
        if short <= opts["reserve_bytes"] + opts["overhead_bytes"]:
            remedies.append(f"if this machine needs less, a smaller reserve= ({format_bytes(opts['reserve_bytes'])}) "
                            f"or overhead= ({format_bytes(opts['overhead_bytes'])})")
        head = (f" (its {opts['headroom']:.0%} headroom is not the cause: headroom is dropped where it does not "
                "fit)") if opts.get("headroom") else ""
        return DoesNotFitError(
            f"stage {stage.stage} needs {format_bytes(stage.total_bytes)} as given in stages={head} but its GPU offers "
            f"{format_bytes(share)} after the reserve, {format_bytes(short)} short (rank {rank} on GPU {gpu_index} of "
            f"{format_bytes(total)}{sharing}: reserve {format_bytes(opts['reserve_bytes'])}, foreign "
            f"{format_bytes(opts['foreign_bytes'])}, per-process overhead {format_bytes(opts['overhead_bytes'])}); "
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
        f"{sharing}: reserve {format_bytes(opts['reserve_bytes'])}, foreign {format_bytes(opts['foreign_bytes'])}, "
        f"per-process overhead {format_bytes(opts['overhead_bytes'])}); " + ", ".join(remedies))


def plan_pipeline(topo: Topology, inv: Inventory, *, stages: Optional[Sequence[SizeLike]] = None,
                  layers: Optional[Sequence[Any]] = None, model: Any = None, num_stages: Optional[int] = None,
                  micro_batch_size: Optional[int] = None, num_micro_batches: Optional[int] = None,
                  schedule: str = "1f1b", recompute: bool = False, input_bytes: SizeLike = 0,
                  rank_order: str = "pipeline", headroom: SizeLike = "5%", memory: str = "auto",
                  reserve: SizeLike = DEFAULT_RESERVE, overhead: Optional[SizeLike] = None, foreign: SizeLike = 0,
                  optimizer: Optional[str] = None, input_shape: Optional[Sequence[int]] = None,
                  layout: Optional[Layout] = None) -> Plan:
    """Every known rank's allocation under pipeline parallelism (``layout``: the observed one).

    stages: explicit per-stage demand (bytes or ``"9GiB"``), one per stage; or
    layers: per-layer costs for ONE micro-batch (``LayerCost`` or dicts), or model: a model / spec
    handed to ``distmem.estimate`` at ``micro_batch_size``; the layers are cut into ``num_stages``
    (default: ranks per node) stages exactly, and the partition goes to ``plan.extras["pipeline"]``.
    num_micro_batches: micro-batches per step (default: the number of stages). schedule: ``"1f1b"``
    or ``"gpipe"``. recompute: keep only stage inputs per micro-batch in flight plus one
    micro-batch's activations. input_bytes: the model input per micro-batch (held by stage 0).
    headroom: added to each demand (``"5%"`` or 0.05); the limit is rounded up to whole MiB and
    must fit the rank's GPU (its equal share when ranks share a GPU) or DoesNotFitError is raised.
    memory: ``"auto"``/``"limit"`` apply the limit as a hard cap (growth inside it); ``"growth"``
    only records it as a budget. Without GPUs the stages are planned anyway with mode ``"cpu"``.
    """
    if sum(x is not None for x in (stages, layers, model)) != 1:
        raise ConfigError("strategy='pipeline' needs exactly one of stages=['9GiB', '7GiB', ...] (bytes per stage), "
                          "layers=[LayerCost, ...] (per-layer costs) or model= (estimated per layer); got "
                          + (", ".join(k for k, v in (("stages", stages), ("layers", layers), ("model", model))
                                       if v is not None) or "none"))
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    gpus = inv.gpus
    opts = resolve_options(gpus, memory=memory, reserve=reserve, overhead=overhead, foreign=foreign,
                           headroom=headroom)
    explicit = stages is not None
    partition: Optional[Partition] = None
    if explicit:
        if not stages:
            raise ConfigError("stages= is empty; give one size per pipeline stage, e.g. stages=['9GiB', '7GiB']")
        demands = _explicit_stages(list(stages), num_stages)
        p = len(demands)
        m = num_micro_batches
    else:
        p = num_stages if num_stages is not None else topo.local_size
        m = num_micro_batches if num_micro_batches is not None else p
        if model is not None:
            layers = layers_from_model(model, batch_size=micro_batch_size, optimizer=optimizer, input_shape=input_shape)
        in_bytes = parse_bytes(input_bytes, what="input_bytes")
        partition = partition_pipeline(layers_from_dicts(list(layers or [])), p, num_micro_batches=m,
                                       schedule=schedule, recompute=recompute, input_bytes=in_bytes)
        demands = partition.stages
    stage_of_rank(0, topo.size, p, rank_order)  # validates size % p and the order
    headroom_ratio = opts["headroom"]
    allocations: List[Allocation] = []
    warnings: List[str] = []
    # Per stage and per (stage, GPU) figures are computed once: a plan of 10,000 ranks stays cheap.
    wants = [planned_bytes(d.total_bytes, headroom_ratio) for d in demands]
    breakdowns = [({k: v for k, v in d.breakdown().items() if k.endswith("_bytes") and k != "demand_bytes"}
                   if not explicit else {}) for d in demands]
    notes = [("" if explicit else f": layers {d.start}..{d.stop - 1}, {schedule} holds {d.in_flight} "
                                  f"micro-batch(es){' (recompute)' if recompute else ''}") for d in demands]
    enforce = memory != "growth"
    limits: Dict[Tuple[int, int, int], int] = {}
    all_places = places(topo, inv, layout)
    used: Dict[str, Set[str]] = {}
    for pl in all_places:
        rank = pl.rank
        stage, replica = stage_of_rank(rank, topo.size, p, rank_order)
        d = demands[stage]
        alloc = Allocation(rank, pl.local_rank, pl.host, "pipeline", "cpu", stage=stage, replica=replica,
                           demand_bytes=d.total_bytes, breakdown=dict(breakdowns[stage], planned_bytes=wants[stage],
                                                                      headroom_bytes=wants[stage] - d.total_bytes),
                           notes=[f"stage {stage} of {p}, replica {replica}{notes[stage]}"])
        if pl.gpu is not None:
            gpu, k = pl.gpu, pl.shared_by
            used.setdefault(pl.host, set()).add(gpu.uuid)
            key = (stage, gpu.total_bytes - gpu.reserved_bytes, k)
            if key not in limits:
                share = equal_share(gpu, k, opts)
                if d.total_bytes > share:
                    raise _does_not_fit(d, rank, gpu.index, gpu.total_bytes, share, k, opts,
                                        None if explicit else schedule, recompute, explicit)
                limits[key] = min(wants[stage], share)
                if wants[stage] > share:
                    warnings.append(f"stage {stage}: headroom cut to {format_bytes(share - d.total_bytes)} "
                                    f"(wanted {headroom_ratio:.0%} of {format_bytes(d.total_bytes)}) to fit GPU "
                                    f"{gpu.index}'s {format_bytes(share)}")
            limit = limits[key]
            alloc.breakdown["planned_bytes"] = limit
            alloc.breakdown["headroom_bytes"] = limit - d.total_bytes
            alloc.mode = "limit" if enforce else "growth"
            alloc.devices = [DeviceSlot(index=gpu.index, total_bytes=gpu.total_bytes, planned_bytes=limit,
                                        enforce=enforce, growth=True, shared_by=k, nvml_index=gpu.nvml_index,
                                        uuid=gpu.uuid, name=gpu.name, label=f"stage {stage}")]
            if memory == "growth" and k > 1:
                alloc.notes.append(f"memory='growth' on a GPU shared by {k} ranks: nothing stops one stage from "
                                   "taking a neighbour's share; use memory='auto' or 'limit'")
        allocations.append(alloc)
    for host, n in sorted(idle_gpus(all_places, used).items()):
        warnings.append(f"{plural(n, 'GPU')} visible on {host} but no rank uses {'it' if n == 1 else 'them'}: "
                        f"{'it stays' if n == 1 else 'they stay'} idle")
    extras: Dict[str, Any] = {"pipeline": {
        "num_stages": p, "replicas": topo.size // p, "rank_order": rank_order, "schedule": schedule,
        "num_micro_batches": m, "micro_batch_size": micro_batch_size, "recompute": bool(recompute),
        "headroom": headroom_ratio,
        "source": "stages" if explicit else ("model" if model is not None else "layers"),
        "stages": [{"stage": d.stage, "demand_bytes": d.total_bytes,
                    "planned_bytes": wants[d.stage],
                    **({} if explicit else {"in_flight": d.in_flight, "first_layer": d.start,
                                             "stop_layer": d.stop})} for d in demands],
    }}
    if partition is not None:
        extras["pipeline"]["partition"] = partition.to_dict()
    options = {k: v for k, v in opts.items()}
    options.update(schedule=schedule, num_stages=p, num_micro_batches=m, recompute=bool(recompute),
                   rank_order=rank_order, micro_batch_size=micro_batch_size)
    plan = Plan("pipeline", topo.size, topo.rank, allocations, inv.source, opts["overhead_bytes"],
                opts["reserve_bytes"], options=options, extras=extras, warnings=warnings)
    return plan


# ---------------------------------------------------------------------------------------------
