"""Model parallel: each rank owns several devices; its layers are cut into one group per device.

A host runs ``local_size`` ranks and each owns ``gpus_per_rank`` GPUs (default: visible GPUs //
ranks per host): local rank ``r`` gets GPUs ``r*g .. r*g + g - 1``. The model's layers are cut
into ``g`` contiguous groups so that the largest group's demand (weights + gradients + optimizer
state + activations at the batch + the input it receives from the previous device, in bytes) is
as small as possible — exactly, ties broken toward the fewest bytes crossing devices. A group's
demand also counts its backward's gradients in flight, by the pipeline stage's rule
(:func:`distmem.plan.partition.backward_transient`, a layer's ``backward_bytes`` included). Each
device's limit is its group's demand plus headroom, in whole MiB.

The placement map (``plan.extras["model"]["placement"]``, layer name -> ``"/GPU:k"``) names
devices as TensorFlow does once the adapter has made the rank's GPUs visible in slot order, so it
is the same on every rank; the apply stage (:mod:`distmem.apply.placement`) builds a Keras model under it. Without GPUs
the same flow runs over ``gpus_per_rank`` logical CPU devices (``"/CPU:k"``), which the adapter
creates (``plan.extras["cpu_logical_devices"]``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set

from ...errors import ConfigError, DoesNotFitError
from ...units import SizeLike, format_bytes, parse_bytes, plural
from ..budget import idle_warnings, slot
from ..partition import Partition, layers_from_dicts, partition_model
from ..strategy import Strategy, option
from ..wrappers import WRAPPER_CHOICES, added_bytes, fixed_bytes, grad_fraction, plan_wrapper
from ..types import Allocation, Plan
from .text import layers_file, shape, whole_number

if TYPE_CHECKING:
    from ..request import Context

__all__ = ["ModelOptions", "STRATEGY", "device_name"]


@dataclass
class ModelOptions:
    layers: Optional[Sequence[Any]] = option(
        None, metavar="FILE.json", parse=layers_file,
        help="per-layer costs at the training batch: a JSON list of {name, state_bytes, activation_bytes, "
             "output_bytes} (or what `distmem estimate --per-layer --json` writes)")
    model: Any = option(None, metavar="SPEC", help="model to estimate per layer, e.g. keras:ResNet50")
    gpus_per_rank: Optional[int] = option(None, parse=whole_number("gpus_per_rank"),
                                          help="devices each rank owns (default: visible GPUs // ranks per host)")
    batch_size: Optional[int] = option(None, parse=whole_number("batch_size"), help="batch size for the estimate")
    optimizer: Optional[str] = option(None, help="optimizer for the estimate (sgd, momentum, adam)")
    input_shape: Optional[Sequence[int]] = option(None, metavar="H,W,C", parse=shape,
                                                  help="model input shape without the batch axis, e.g. 96,96,3")
    input_bytes: SizeLike = option(0, metavar="SIZE", help="model input per batch, held by the first device")
    wrapper: Optional[str] = option("none", choices=WRAPPER_CHOICES,
                                    help="the data-parallel wrapper whose buffers the rank also holds (on its first "
                                         "device): none (default), horovod, ddp, tf_distribute, or auto (Horovod "
                                         "when this process sees HOROVOD_*: a dry run does not)")
    headroom: Optional[SizeLike] = option(
        None, metavar="PCT", help="added to each group's demand for the allocator (default 10%%; 52%% for torch under "
                                  "memory growth); 0 keeps the bytes as they are")


def device_name(kind: str, k: int) -> str:
    """TensorFlow's name of the rank's ``k``-th device: ``"/GPU:k"`` or ``"/CPU:k"``."""
    return f"/{kind}:{k}"


def _gpus_per_rank(requested: Optional[int], visible: int, local_size: int) -> int:
    if requested is not None:
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
            raise ConfigError(f"gpus_per_rank={requested!r}: give a whole number of devices per rank, at least 1")
        if visible and requested * local_size > visible:
            raise DoesNotFitError(
                f"{plural(local_size, 'rank')} per host x {plural(requested, 'GPU')} per rank need {requested * local_size} "
                f"GPUs but "
                f"the host shows {visible}; use gpus_per_rank={max(visible // local_size, 1)} or fewer ranks per host")
        return requested
    if not visible:
        return 1
    if visible < local_size:
        raise DoesNotFitError(
            f"model parallel gives every rank its own GPUs, but {plural(local_size, 'rank')} per host share "
            f"{plural(visible, 'visible GPU')}; run at most {plural(visible, 'rank')} per host or use "
            "strategy='data'/'pipeline'")
    return visible // local_size


def plan(ctx: "Context", opts: ModelOptions) -> Plan:
    layers, model, gpus_per_rank, batch_size = opts.layers, opts.model, opts.gpus_per_rank, opts.batch_size
    budget = ctx.budget
    if (layers is None) == (model is None):
        raise ConfigError("strategy='model' needs exactly one of layers=[LayerCost, ...] (per-layer costs) or "
                          "model= (a Keras model or 'keras:ResNet50', estimated per layer) - on the command line "
                          "--layers FILE.json or --model SPEC")
    all_places = ctx.places
    me = next((pl for pl in all_places if pl.rank == ctx.topo.rank), all_places[0])
    # The GPUs a rank sees and the ranks of its host that see the same set decide the split; the
    # default is one number for the whole job: the fewest any known host offers per rank.
    g = _gpus_per_rank(gpus_per_rank, len(me.gpus), me.group_size)
    if gpus_per_rank is None and me.gpus:
        offers = [_gpus_per_rank(None, len(pl.gpus), pl.group_size) for pl in all_places if pl.gpus]
        offers += [_gpus_per_rank(None, len(gpus), ctx.topo.local_size) for gpus in ctx.host_gpus if gpus]
        g = min([g] + offers)
    if model is not None:
        layers = ctx.estimate_layers(model, batch_size=batch_size, optimizer=opts.optimizer,
                                   input_shape=opts.input_shape)
    part: Partition = partition_model(layers_from_dicts(list(layers or [])), g,
                                      input_bytes=parse_bytes(opts.input_bytes, what="input_bytes"))
    # the data-parallel wrapper's buffers live with the rank's first device (where its gradients
    # are reduced): Horovod's fusion buffer, DDP's buckets
    wrapper = plan_wrapper(opts.wrapper, world_size=ctx.topo.size, on_gpu=any(pl.gpus for pl in all_places),
                           env=ctx.env, framework=ctx.framework)
    added = added_bytes(wrapper, int(sum(d.state_bytes for d in part.stages) * grad_fraction(opts.optimizer)))
    if added:
        part.stages[0] = replace(part.stages[0], state_bytes=part.stages[0].state_bytes + added)
    kind = "GPU" if any(pl.gpus for pl in all_places) else "CPU"
    fixed = [fixed_bytes(wrapper) if added and k == 0 else 0 for k in range(len(part.stages))]
    wants = [budget.limit_for(d.total_bytes - f) + f for d, f in zip(part.stages, fixed)]  # kept buffers after
    allocations: List[Allocation] = []
    warnings: List[str] = []
    used: Dict[str, Set[str]] = {}
    for pl in all_places:
        rank = pl.rank
        breakdown = {"state_bytes": sum(d.state_bytes for d in part.stages) - added, "wrapper_bytes": added,
                     "activation_bytes": sum(d.activation_bytes for d in part.stages),
                     "boundary_bytes": sum(d.boundary_bytes for d in part.stages),
                     "transient_bytes": sum(d.transient_bytes for d in part.stages),
                     "planned_bytes": sum(wants)}
        alloc = Allocation(rank, pl.local_rank, pl.host, "model", "cpu", replica=rank,
                           demand_bytes=sum(d.total_bytes for d in part.stages), breakdown=breakdown,
                           notes=[f"{g} device(s): " + "; ".join(
                               f"{device_name(kind, k)} layers {d.start}..{d.stop - 1} {format_bytes(d.total_bytes)}"
                               for k, d in enumerate(part.stages))])
        if pl.gpus:
            enforce = budget.enforced(always=True)
            alloc.mode = "limit" if enforce else "growth"
            if (pl.position + 1) * g > len(pl.gpus):
                raise DoesNotFitError(
                    f"rank {rank} on {pl.host} sees {len(pl.gpus)} GPU(s) shared with {pl.group_size - 1} other rank(s) "
                    f"of its host, too few for {g} GPU(s) per rank; give every rank its own GPUs "
                    "(CUDA_VISIBLE_DEVICES) or lower gpus_per_rank=")
            for k, d in enumerate(part.stages):
                gpu = pl.gpus[pl.position * g + k]
                used.setdefault(pl.host, set()).add(gpu.uuid)
                share = budget.share(gpu, 1)
                if d.total_bytes > share:
                    raise DoesNotFitError(
                        f"layer group {k} ({part.layer_names[d.start]}..{part.layer_names[d.stop - 1]}, "
                        f"{d.num_layers} layers) needs {format_bytes(d.total_bytes)} (weights+grads+optimizer "
                        f"{format_bytes(d.state_bytes)}, activations {format_bytes(d.activation_bytes)}, input "
                        f"{format_bytes(d.boundary_bytes)}, backward gradients in flight "
                        f"{format_bytes(d.transient_bytes)}) but GPU {gpu.index} of rank {rank} offers "
                        f"{format_bytes(share)} after the reserve {format_bytes(budget.reserve_of(gpu))}, foreign "
                        f"{format_bytes(budget.foreign_of(gpu))} and per-process overhead "
                        f"{format_bytes(budget.overhead_bytes)}; give each rank more GPUs (gpus_per_rank=), run "
                        "fewer ranks per host, lower the batch size, or use a larger GPU")
                limit = wants[k]
                if limit > share:
                    limit = share
                    if rank == ctx.places[0].rank:
                        warnings.append(f"group {k}: headroom cut to {format_bytes(share - d.total_bytes)} to fit GPU "
                                        f"{gpu.index}'s {format_bytes(share)}")
                alloc.devices.append(slot(gpu, limit, enforce=enforce, label=f"group {k}"))
            alloc.breakdown["planned_bytes"] = sum(s.planned_bytes for s in alloc.devices)
        allocations.append(alloc)
    warnings += idle_warnings(ctx.seen_gpus(), used, why=f"({plural(g, 'GPU')} per rank)")
    placement = {name: device_name(kind, k) for name, k in part.part_of().items()}
    extras: Dict[str, Any] = {"model": {
        "gpus_per_rank": g, "device_type": kind, "placement": placement,
        "groups": [{"group": k, "device": device_name(kind, k), "demand_bytes": d.total_bytes,
                    "planned_bytes": wants[k], "state_bytes": d.state_bytes, "activation_bytes": d.activation_bytes,
                    "boundary_bytes": d.boundary_bytes, "transient_bytes": d.transient_bytes,
                    "first_layer": part.layer_names[d.start],
                    "last_layer": part.layer_names[d.stop - 1], "num_layers": d.num_layers}
                   for k, d in enumerate(part.stages)],
        "cut_bytes": part.cut_bytes, "batch_size": batch_size,
        "wrapper": wrapper.describe() if wrapper else None, "wrapper_bytes": added, "source": "model" if model is not None else "layers",
    }}
    if kind == "CPU" and g > 1:
        extras["cpu_logical_devices"] = g
    options = dict(gpus_per_rank=g, batch_size=batch_size, framework=ctx.framework)
    return ctx.make_plan("model", allocations, options, extras=extras, warnings=warnings)


STRATEGY = Strategy("model", "per-layer groups over each rank's GPUs, with a placement map", ModelOptions, plan,
                    derives_limits=True)


