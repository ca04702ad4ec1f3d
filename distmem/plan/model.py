"""Model parallel: each rank owns several devices; its layers are cut into one group per device.

A node runs ``local_size`` ranks and each owns ``gpus_per_rank`` GPUs (default: visible GPUs //
ranks per node): local rank ``r`` gets GPUs ``r*g .. r*g + g - 1``. The model's layers are cut
into ``g`` contiguous groups so that the largest group's demand (weights + gradients + optimizer
state + activations at the batch + the input it receives from the previous device, in bytes) is
as small as possible — exactly, ties broken toward the fewest bytes crossing devices. Each
device's limit is its group's demand plus headroom, in whole MiB.

The placement map (``plan.extras["model"]["placement"]``, layer name -> ``"/GPU:k"``) names
devices as TensorFlow does once the adapter has made the rank's GPUs visible in slot order, so it
is the same on every rank; :mod:`distmem.apply.placement` builds a Keras model under it. Without GPUs
the same flow runs over ``gpus_per_rank`` logical CPU devices (``"/CPU:k"``), which the adapter
creates (``plan.extras["cpu_logical_devices"]``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set

from ..discover.gpus import Inventory
from ..discover.layout import Layout
from ..errors import ConfigError, DoesNotFitError
from ..discover.identity import Topology
from ..units import SizeLike, format_bytes, parse_bytes, plural
from .types import DEFAULT_RESERVE, Allocation, DeviceSlot, Plan
from .common import equal_share, idle_gpus, places, resolve_options
from .partition import Partition, layers_from_dicts, partition_model
from .pipeline import layers_from_model, planned_bytes

__all__ = ["plan_model", "device_name"]


def device_name(kind: str, k: int) -> str:
    """TensorFlow's name of the rank's ``k``-th device: ``"/GPU:k"`` or ``"/CPU:k"``."""
    return f"/{kind}:{k}"


def _gpus_per_rank(requested: Optional[int], visible: int, local_size: int) -> int:
    if requested is not None:
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
            raise ConfigError(f"gpus_per_rank={requested!r}: give a whole number of devices per rank, at least 1")
        if visible and requested * local_size > visible:
            raise DoesNotFitError(
                f"{plural(local_size, 'rank')} per node x {plural(requested, 'GPU')} per rank need {requested * local_size} "
                f"GPUs but "
                f"the node shows {visible}; use gpus_per_rank={max(visible // local_size, 1)} or fewer ranks per node")
        return requested
    if not visible:
        return 1
    if visible < local_size:
        raise DoesNotFitError(
            f"model parallel gives every rank its own GPUs, but {plural(local_size, 'rank')} per node share "
            f"{plural(visible, 'visible GPU')}; run at most {plural(visible, 'rank')} per node or use "
            "strategy='data'/'pipeline'")
    return visible // local_size


def plan_model(topo: Topology, inv: Inventory, *, layers: Optional[Sequence[Any]] = None, model: Any = None,
               gpus_per_rank: Optional[int] = None, batch_size: Optional[int] = None,
               optimizer: Optional[str] = None, input_shape: Optional[Sequence[int]] = None,
               input_bytes: SizeLike = 0, headroom: SizeLike = "5%", memory: str = "auto",
               reserve: SizeLike = DEFAULT_RESERVE, overhead: Optional[SizeLike] = None, foreign: SizeLike = 0,
               framework: Optional[str] = None, layout: Optional[Layout] = None) -> Plan:
    """Every rank's devices, per-device limits and the layer placement under model parallelism.

    layers: per-layer costs at the training batch (``LayerCost`` or dicts), or model: a model /
    spec estimated by ``distmem.estimate`` at ``batch_size``. gpus_per_rank: devices each rank
    owns (default visible GPUs // ranks per node; on CPU, logical CPU devices, default 1).
    input_bytes: the model input per batch, held by the first device. headroom: added to each
    group's demand; a group that does not fit its GPU raises DoesNotFitError with its breakdown.
    memory: ``"auto"``/``"limit"`` apply hard limits (growth inside), ``"growth"`` only budgets.
    """
    if (layers is None) == (model is None):
        raise ConfigError("strategy='model' needs exactly one of layers=[LayerCost, ...] (per-layer costs) or "
                          "model= (a Keras model or 'keras:ResNet50', estimated per layer)")
    gpus = inv.gpus
    opts = resolve_options(gpus, memory=memory, reserve=reserve, overhead=overhead, foreign=foreign,
                           headroom=headroom)
    all_places = places(topo, inv, layout)
    me = next((pl for pl in all_places if pl.rank == topo.rank), all_places[0])
    # The GPUs this rank sees and the ranks of its host that see the same set decide the split.
    g = _gpus_per_rank(gpus_per_rank, len(me.gpus), me.group_size)
    if model is not None:
        layers = layers_from_model(model, batch_size=batch_size, optimizer=optimizer, input_shape=input_shape)
    part: Partition = partition_model(layers_from_dicts(list(layers or [])), g,
                                      input_bytes=parse_bytes(input_bytes, what="input_bytes"))
    kind = "GPU" if gpus else "CPU"
    ratio = opts["headroom"]
    wants = [planned_bytes(d.total_bytes, ratio) for d in part.stages]
    allocations: List[Allocation] = []
    warnings: List[str] = []
    used: Dict[str, Set[str]] = {}
    for pl in all_places:
        rank = pl.rank
        breakdown = {"state_bytes": sum(d.state_bytes for d in part.stages),
                     "activation_bytes": sum(d.activation_bytes for d in part.stages),
                     "boundary_bytes": sum(d.boundary_bytes for d in part.stages),
                     "planned_bytes": sum(wants)}
        alloc = Allocation(rank, pl.local_rank, pl.host, "model", "cpu", replica=rank,
                           demand_bytes=sum(d.total_bytes for d in part.stages), breakdown=breakdown,
                           notes=[f"{g} device(s): " + "; ".join(
                               f"{device_name(kind, k)} layers {d.start}..{d.stop - 1} {format_bytes(d.total_bytes)}"
                               for k, d in enumerate(part.stages))])
        if pl.gpus:
            enforce = memory != "growth"
            alloc.mode = "limit" if enforce else "growth"
            if (pl.position + 1) * g > len(pl.gpus):
                raise DoesNotFitError(
                    f"rank {rank} on {pl.host} sees {len(pl.gpus)} GPU(s) shared with {pl.group_size - 1} other rank(s) "
                    f"of its host, too few for {g} GPU(s) per rank; give every rank its own GPUs "
                    "(CUDA_VISIBLE_DEVICES) or lower gpus_per_rank=")
            for k, d in enumerate(part.stages):
                gpu = pl.gpus[pl.position * g + k]
                used.setdefault(pl.host, set()).add(gpu.uuid)
                share = equal_share(gpu, 1, opts)
                if d.total_bytes > share:
                    raise DoesNotFitError(
                        f"layer group {k} ({part.layer_names[d.start]}..{part.layer_names[d.stop - 1]}, "
                        f"{d.num_layers} layers) needs {format_bytes(d.total_bytes)} (weights+grads+optimizer "
                        f"{format_bytes(d.state_bytes)}, activations {format_bytes(d.activation_bytes)}, input "
                        f"{format_bytes(d.boundary_bytes)}) but GPU {gpu.index} of rank {rank} offers "
                        f"{format_bytes(share)} after the reserve {format_bytes(opts['reserve_bytes'])}, foreign "
                        f"{format_bytes(opts['foreign_bytes'])} and per-process overhead "
                        f"{format_bytes(opts['overhead_bytes'])}; give each rank more GPUs (gpus_per_rank=), run "
                        "fewer ranks per node, lower the batch size, or use a larger GPU")
                limit = wants[k]
                if limit > share:
                    limit = share
                    if rank == 0:
                        warnings.append(f"group {k}: headroom cut to {format_bytes(share - d.total_bytes)} to fit GPU "
                                        f"{gpu.index}'s {format_bytes(share)}")
                alloc.devices.append(DeviceSlot(index=gpu.index, total_bytes=gpu.total_bytes, planned_bytes=limit,
                                                enforce=enforce, growth=True, shared_by=1, nvml_index=gpu.nvml_index,
                                                uuid=gpu.uuid, name=gpu.name, label=f"group {k}"))
            alloc.breakdown["planned_bytes"] = sum(s.planned_bytes for s in alloc.devices)
        allocations.append(alloc)
    for host, n in sorted(idle_gpus(all_places, used).items()):
        warnings.append(f"{plural(n, 'GPU')} visible on {host} but {plural(g, 'GPU')} per rank leave "
                        f"{'it unused: it stays' if n == 1 else 'them unused: they stay'} idle")
    placement = {name: device_name(kind, k) for name, k in part.part_of().items()}
    extras: Dict[str, Any] = {"model": {
        "gpus_per_rank": g, "device_type": kind, "placement": placement,
        "groups": [{"group": k, "device": device_name(kind, k), "demand_bytes": d.total_bytes,
                    "planned_bytes": wants[k], "state_bytes": d.state_bytes, "activation_bytes": d.activation_bytes,
                    "boundary_bytes": d.boundary_bytes, "first_layer": part.layer_names[d.start],
                    "last_layer": part.layer_names[d.stop - 1], "num_layers": d.num_layers}
                   for k, d in enumerate(part.stages)],
        "cut_bytes": part.cut_bytes, "batch_size": batch_size, "source": "model" if model is not None else "layers",
    }}
    if kind == "CPU" and g > 1:
        extras["cpu_logical_devices"] = g
    options = dict(opts)
    options.update(gpus_per_rank=g, batch_size=batch_size, framework=framework)
    return Plan("model", topo.size, topo.rank, allocations, inv.source, opts["overhead_bytes"],
                opts["reserve_bytes"], options=options, extras=extras, warnings=warnings)


# ---------------------------------------------------------------------------------------------
