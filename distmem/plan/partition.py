"""Exact contiguous partition of a layer list over pipeline stages or devices. Pure (numpy only).

The cost of putting layers ``[i, j)`` on part ``s`` (a pipeline stage or a model-parallel device) is

    cost_s(i, j) = state(i, j) + a_s * act(i, j) + b_s * boundary(i)          (bytes)

``state`` sums the layers' weights + gradients + optimizer slots (held once), ``act`` sums their
activations for one micro-batch, and ``boundary(i)`` is the input the part receives for one
micro-batch (the previous layer's output, or ``input_bytes`` for the first part). The multipliers
depend on the part, which is why balancing plain per-layer sums is wrong for pipelines:

============================  =================  ===================
setting                       a_s                b_s
============================  =================  ===================
pipeline, no recompute        in_flight(s)       in_flight(s)
pipeline, recompute           1                  in_flight(s)
model parallel                1                  1
plain per-layer sums          1                  0
============================  =================  ===================

A pipeline stage's demand adds, on top of that cost, the gradients its backward has in flight
(:func:`backward_transient`: the gradient received for its output and, at the layer the backward
has reached, that layer's output and input gradients and what its backward allocates besides) and,
over several micro-batches, the micro-batch's own gradients before they are added to the
accumulated ones (:func:`accumulation_transient`), which no cut can avoid. A model-parallel
device's group runs the same backward over its layers, and its demand adds the same
:func:`backward_transient`.

``in_flight(s)`` is the number of micro-batches whose activations stage ``s`` holds at its peak:
all ``m`` under GPipe, ``min(p - s, m)`` under 1F1B (the first stage holds the most).

:func:`solve` finds cuts that minimise the largest part exactly: a bisection over the answer whose
feasibility test is an exact reachability sweep over layers x parts (O(p n) numpy per test), then
a DP over layers x parts that, among all partitions with that optimum, picks one with the fewest
bytes crossing the cuts. Every part gets at least one layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..costs import LayerCost
from ..errors import ConfigError
from ..units import format_bytes, parse_bytes

__all__ = ["SCHEDULES", "in_flight", "StageDemand", "backward_transient", "accumulation_transient", "Partition",
           "solve", "stage_demands", "partition_pipeline", "partition_model", "partition_plain", "lower_bound", "bounds_from_cuts",
           "layers_from_dicts"]

SCHEDULES = ("1f1b", "gpipe")

#: A contiguous run of layers ``[start, stop)``.
Bounds = List[Tuple[int, int]]

_INF = np.iinfo(np.int64).max // 4


def in_flight(schedule: str, stage: int, num_stages: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) of ``num_stages`` holds at its peak.

    GPipe runs every forward before any backward, so each stage holds all ``m``. 1F1B
    (PipeDream-Flush) starts the backward of a micro-batch as soon as it reaches the last stage, so
    stage ``s`` holds at most ``p - s`` micro-batches: ``min(p - s, m)``.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}; use '1f1b' "
                          "(first stage holds p micro-batches, last holds 1) or 'gpipe' (every stage holds all)")
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ConfigError(f"stage {stage} is outside a pipeline of {num_stages} stage(s)")
    if num_micro_batches < 1:
        raise ConfigError(f"num_micro_batches={num_micro_batches}: a pipeline needs at least one micro-batch")
    if schedule == "gpipe":
        return num_micro_batches
    return min(num_stages - stage, num_micro_batches)


@dataclass(frozen=True)
class StageDemand:
    """Memory one part (pipeline stage or model-parallel device) needs, in bytes.

    ``activation_bytes`` and ``boundary_bytes`` are for ONE micro-batch; ``in_flight`` is how many
    micro-batches are held at the peak (1 for model parallel). Without recompute the stage holds
    ``in_flight x (activations + boundary)``; with recompute it keeps only ``in_flight`` boundary
    inputs plus one micro-batch's full activations while it recomputes.
    """

    stage: int
    start: int
    stop: int
    state_bytes: int
    activation_bytes: int
    boundary_bytes: int
    in_flight: int = 1
    recompute: bool = False
    #: What a pipeline stage's (or a model-parallel group's) backward has in flight at its peak: its
    #: gradients (:func:`backward_transient`) and a micro-batch's own ones until added
    #: (:func:`accumulation_transient`, pipelines).
    transient_bytes: int = 0

    @property
    def activation_total_bytes(self) -> int:
        """Activation memory at the peak: the in-flight multiple (and the stashed boundary inputs)."""
        if self.recompute:
            return self.in_flight * self.boundary_bytes + self.activation_bytes
        return self.in_flight * (self.activation_bytes + self.boundary_bytes)

    @property
    def held_bytes(self) -> int:
        """What the stage holds when its backward starts: state + activations at the peak (what the
        partition minimises)."""
        return self.state_bytes + self.activation_total_bytes

    @property
    def total_bytes(self) -> int:
        """Peak demand: what it holds plus the backward's gradients in flight."""
        return self.held_bytes + self.transient_bytes

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    def breakdown(self) -> Dict[str, int]:
        """Integer breakdown for :class:`~distmem.plan.base.Allocation` (bytes, except ``in_flight``)."""
        return {"state_bytes": self.state_bytes, "activation_bytes": self.activation_bytes,
                "boundary_bytes": self.boundary_bytes, "in_flight": self.in_flight,
                "recompute": int(self.recompute), "activation_total_bytes": self.activation_total_bytes,
                "transient_bytes": self.transient_bytes, "demand_bytes": self.total_bytes, "first_layer": self.start,
                "stop_layer": self.stop}

    def describe(self) -> str:
        """``weights+grads+optimizer 3.1 GiB, activations 4 x 5.1 GiB`` — what the error messages show."""
        state = f"weights+grads+optimizer {format_bytes(self.state_bytes)}"
        grads = f", backward gradients in flight {format_bytes(self.transient_bytes)}" if self.transient_bytes else ""
        if self.recompute:
            return (f"{state}, stage inputs {self.in_flight} x {format_bytes(self.boundary_bytes)} "
                    f"+ one recomputed micro-batch {format_bytes(self.activation_bytes)}{grads}")
        act = self.activation_bytes + self.boundary_bytes
        return f"{state}, activations {self.in_flight} x {format_bytes(act)}{grads}"


@dataclass
class Partition:
    """Layers cut into contiguous parts, with each part's demand. JSON-friendly via :meth:`to_dict`."""

    layer_names: List[str]
    stages: List[StageDemand]
    kind: str  # "pipeline" | "model" | "plain"
    schedule: Optional[str] = None
    num_micro_batches: int = 1
    recompute: bool = False
    input_bytes: int = 0
    cut_bytes: int = 0
    info: Dict[str, Any] = field(default_factory=dict)

    @property
    def bounds(self) -> Bounds:
        return [(s.start, s.stop) for s in self.stages]

    @property
    def max_bytes(self) -> int:
        """The largest part's demand (its peak, the backward's gradients in flight included; the
        partition minimises what the parts hold, :attr:`StageDemand.held_bytes`)."""
        return max(s.total_bytes for s in self.stages)

    @property
    def num_parts(self) -> int:
        return len(self.stages)

    def names(self, part: int) -> List[str]:
        """Layer names on ``part``."""
        s = self.stages[part]
        return self.layer_names[s.start:s.stop]

    def part_of(self) -> Dict[str, int]:
        """Layer name -> part index."""
        return {name: k for k, s in enumerate(self.stages) for name in self.layer_names[s.start:s.stop]}

    def to_dict(self, with_names: bool = True) -> Dict[str, Any]:
        parts = []
        for s in self.stages:
            d = s.breakdown()
            d["stage"] = s.stage
            if with_names:
                d["layers"] = self.layer_names[s.start:s.stop]
            parts.append(d)
        return {"kind": self.kind, "schedule": self.schedule, "num_micro_batches": self.num_micro_batches,
                "recompute": self.recompute, "input_bytes": self.input_bytes, "cut_bytes": self.cut_bytes,
                "max_bytes": self.max_bytes, "bounds": [list(b) for b in self.bounds], "parts": parts,
                **self.info}


def layers_from_dicts(items: Sequence[Any], what: str = "layers") -> List[LayerCost]:
    """Accept LayerCost objects or dicts with LayerCost's fields (JSON files, the CLI's ``--layers``,
    the rows ``distmem estimate --per-layer --json`` writes). Byte figures may be integers or sizes
    (``"1GiB"``); anything else is a ConfigError naming the layer, the field and the value."""
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise ConfigError(f"{what}: expected a list of layer costs, got {type(items).__name__} {items!r}")
    out: List[LayerCost] = []
    for k, item in enumerate(items):
        if isinstance(item, LayerCost):
            out.append(item)
            continue
        if not isinstance(item, dict):
            raise ConfigError(f"{what}: layer {k}: expected a LayerCost or a dict with name, state_bytes, "
                              f"activation_bytes, output_bytes; got {type(item).__name__}")
        name = str(item.get("name", f"layer_{k}"))
        missing = [f for f in ("state_bytes", "activation_bytes") if f not in item]
        if missing:
            raise ConfigError(f"{what}: layer {k} ({name}): missing {', '.join(missing)}; each layer needs "
                              "state_bytes (weights+grads+optimizer) and activation_bytes (one micro-batch)")
        known: Dict[str, Any] = {"name": name}
        for f in ("state_bytes", "activation_bytes", "output_bytes", "backward_bytes"):
            if f in item:
                try:
                    known[f] = parse_bytes(item[f], what=f"{what}: layer {k} ({name}) {f}")
                except ConfigError as exc:
                    raise ConfigError(f"{exc}; give bytes as a whole number or a size such as '1GiB'") from None
        if "params" in item:
            params = item["params"]
            if isinstance(params, bool) or not isinstance(params, int) or params < 0:
                raise ConfigError(f"{what}: layer {k} ({name}) params={params!r}: give a whole number >= 0")
            known["params"] = params
        if "kind" in item:
            known["kind"] = str(item["kind"])
        out.append(LayerCost(**known))
    return out


def _check_layers(layers: Sequence[LayerCost], parts: int, what: str) -> None:
    if parts < 1:
        raise ConfigError(f"{what}: need at least one part, got {parts}")
    if len(layers) < parts:
        raise ConfigError(f"{what}: {len(layers)} layer(s) cannot fill {parts} parts (every part needs at "
                          f"least one layer); use at most {len(layers)} parts or give a finer layer list")
    for layer in layers:
        for f in ("state_bytes", "activation_bytes", "output_bytes", "backward_bytes"):
            v = getattr(layer, f)
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise ConfigError(f"layer {layer.name!r}: {f}={v!r} must be a non-negative whole number of bytes")
    names = [layer.name for layer in layers]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:5]
        raise ConfigError(f"{what}: layer names must be unique (placement maps use them); repeated: {dup}")


def _arrays(layers: Sequence[LayerCost], input_bytes: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    state = np.fromiter((l.state_bytes for l in layers), dtype=np.int64, count=len(layers))
    act = np.fromiter((l.activation_bytes for l in layers), dtype=np.int64, count=len(layers))
    # boundary[i]: bytes a part starting at layer i receives per micro-batch.
    boundary = np.empty(len(layers), dtype=np.int64)
    boundary[0] = input_bytes
    boundary[1:] = [l.output_bytes for l in layers[:-1]]
    return state, act, boundary


def bounds_from_cuts(cuts: Sequence[int], n: int) -> Bounds:
    """``[0, c1, c2, ..., n]``-style boundaries (DeepSpeed's ``parts``) or inner cuts -> [start, stop) pairs."""
    edges = list(cuts)
    if not edges or edges[0] != 0:
        edges = [0] + edges
    if edges[-1] != n:
        edges = edges + [n]
    return list(zip(edges[:-1], edges[1:]))


def _costs(state: np.ndarray, act: np.ndarray, boundary: np.ndarray, a: Sequence[int], b: Sequence[int],
           bounds: Bounds) -> List[int]:
    return [int(state[i:j].sum() + a[s] * act[i:j].sum() + b[s] * boundary[i]) for s, (i, j) in enumerate(bounds)]


def solve(state: Sequence[int], act: Sequence[int], boundary: Sequence[int], a: Sequence[int],
          b: Sequence[int], cut_cost: Optional[Sequence[int]] = None) -> Tuple[Bounds, int]:
    """Cut ``n`` layers into ``p = len(a)`` non-empty contiguous parts minimising the largest
    ``cost_s(i, j) = sum(state[i:j]) + a[s] * sum(act[i:j]) + b[s] * boundary[i]`` (bytes, integers).

    Among all optimal partitions it returns one minimising ``sum(cut_cost[i])`` over the parts'
    starts ``i > 0`` (default: ``boundary``, the bytes crossing each cut). Returns
    ``(bounds, optimum)``. Exact; O(p n log C) for the optimum, O(p w) numpy passes of length n
    for the tie-break, where w is the most layers one part can hold at the optimum.
    """
    s_arr = np.asarray(state, dtype=np.int64)
    a_arr_l = np.asarray(act, dtype=np.int64)
    bnd = np.asarray(boundary, dtype=np.int64)
    n, p = len(s_arr), len(a)
    if len(b) != p:
        raise ConfigError(f"solve: {len(a)} activation multipliers but {len(b)} boundary multipliers")
    if n < p or p < 1:
        raise ConfigError(f"solve: {n} layer(s) cannot fill {p} non-empty part(s)")
    cut = bnd if cut_cost is None else np.asarray(cut_cost, dtype=np.int64)
    ps = np.concatenate(([0], np.cumsum(s_arr)))
    pa = np.concatenate(([0], np.cumsum(a_arr_l)))
    # W_s[j] - W_s[i] = state(i, j) + a_s act(i, j): non-decreasing in j, so for a fixed start the
    # feasible stops form an interval and feasibility sweeps are exact.
    weights = [ps + int(a[s]) * pa for s in range(p)]
    extra = [int(b[s]) * bnd for s in range(p)]
    positions = np.arange(n + 1)

    def feasible(limit: int) -> bool:
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        for s in range(p):
            starts = np.flatnonzero(reach[:n])
            if starts.size == 0:
                return False
            w = weights[s]
            stop = np.searchsorted(w, w[starts] - extra[s][starts] + limit, side="right") - 1
            best = np.full(n + 1, -1, dtype=np.int64)
            best[starts] = stop
            np.maximum.accumulate(best, out=best)
            reach = np.zeros(n + 1, dtype=bool)
            reach[1:] = best[:-1] >= positions[1:]
        return bool(reach[n])

    # Bounds for the bisection: the analytic lower bound and an equal-count partition's cost.
    even = bounds_from_cuts([round(k * n / p) for k in range(p + 1)], n)
    hi = max(_costs(s_arr, a_arr_l, bnd, a, b, even))
    lo = max(0, min(hi, _lower_bound(s_arr, a_arr_l, bnd, a, b)))
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    optimum = hi
    return _fewest_cut_bytes(weights, extra, cut, n, p, optimum), optimum


def _fewest_cut_bytes(weights: List[np.ndarray], extra: List[np.ndarray], cut: np.ndarray, n: int, p: int,
                      limit: int) -> Bounds:
    """Among partitions whose every part costs <= limit, one with the least sum of cut bytes."""
    prev = np.full(n + 1, _INF, dtype=np.int64)
    prev[0] = 0
    cut_at = np.zeros(n + 1, dtype=np.int64)
    cut_at[1:n] = cut[1:n]
    parents: List[np.ndarray] = []
    stops = np.arange(1, n + 1)
    for s in range(p):
        w = weights[s]
        # Earliest start whose state + activations alone stay within the limit: bounds the window.
        first = np.searchsorted(w, w[1:] - limit, side="left")
        width = int((stops - first).max(initial=0))
        cur = np.full(n + 1, _INF, dtype=np.int64)
        par = np.full(n + 1, -1, dtype=np.int64)
        ok_prev = prev < _INF
        for d in range(1, width + 1):
            starts = stops - d
            valid = starts >= first
            if not valid.any():
                continue
            st = np.where(valid, starts, 0)
            cost = w[stops] - w[st] + extra[s][np.minimum(st, n - 1)]
            valid &= (cost <= limit) & ok_prev[st]
            cand = np.where(valid, prev[st] + cut_at[st], _INF)
            better = cand < cur[1:]
            if better.any():
                cur[1:][better] = cand[better]
                par[1:][better] = st[better]
        parents.append(par)
        prev = cur
    if prev[n] >= _INF:  # cannot happen for a limit that passed the feasibility sweep
        raise AssertionError(f"partition: no partition within {limit} bytes found in the tie-break pass")
    bounds: Bounds = []
    j = n
    for s in range(p - 1, -1, -1):
        i = int(parents[s][j])
        bounds.append((i, j))
        j = i
    bounds.reverse()
    return bounds


def _lower_bound(state: np.ndarray, act: np.ndarray, boundary: np.ndarray, a: Sequence[int],
                 b: Sequence[int]) -> int:
    p = len(a)
    a_min = min(int(x) for x in a)
    total = int(state.sum()) + a_min * int(act.sum())
    per_layer = int((state + a_min * act).max())
    first = int(state[0] + a[0] * act[0] + b[0] * boundary[0])
    last = int(state[-1] + a[-1] * act[-1])
    return max(-(-total // p), per_layer, first, last)


def _multipliers(kind: str, num_parts: int, schedule: Optional[str], m: int,
                 recompute: bool) -> Tuple[List[int], List[int], List[int]]:
    """(in_flight, a, b) per part for the settings in the module docstring."""
    if kind == "pipeline":
        flight = [in_flight(schedule or "", s, num_parts, m) for s in range(num_parts)]
        return flight, ([1] * num_parts if recompute else flight), flight
    if kind == "model":
        return [1] * num_parts, [1] * num_parts, [1] * num_parts
    return [1] * num_parts, [1] * num_parts, [0] * num_parts


def stage_demands(layers: Sequence[LayerCost], bounds: Bounds, *, kind: str = "pipeline",
                  schedule: Optional[str] = "1f1b", num_micro_batches: int = 1, recompute: bool = False,
                  input_bytes: int = 0, accumulate: Optional[Tuple[str, float]] = None) -> List[StageDemand]:
    """Each part's demand for given bounds under a setting; evaluates any partition (a peer's too).
    ``accumulate``: (framework, the gradients' share of a layer's state) where a pipeline's stages
    add each micro-batch's gradients into accumulated ones (:func:`accumulation_transient`)."""
    p = len(bounds)
    flight, _, b = _multipliers(kind, p, schedule, num_micro_batches, recompute)
    state, act, boundary = _arrays(layers, input_bytes)
    out = []
    for s, (i, j) in enumerate(bounds):
        if not 0 <= i < j <= len(layers):
            raise ConfigError(f"part {s}: bounds [{i}, {j}) are empty or outside {len(layers)} layers")
        out.append(StageDemand(stage=s, start=i, stop=j, state_bytes=int(state[i:j].sum()),
                               activation_bytes=int(act[i:j].sum()),
                               boundary_bytes=int(boundary[i]) if b[s] else 0,
                               in_flight=flight[s], recompute=recompute and kind == "pipeline",
                               transient_bytes=_stage_transient(layers, i, j, num_micro_batches, accumulate)
                               if kind in ("pipeline", "model") else 0))
    return out


def _stage_transient(layers: Sequence[LayerCost], start: int, stop: int, num_micro_batches: int,
                     accumulate: Optional[Tuple[str, float]]) -> int:
    """A pipeline stage's backward in flight: its gradients, and (``accumulate`` = framework, the
    gradients' share of a layer's state) a micro-batch's own ones until added."""
    out = backward_transient(layers, start, stop)
    if accumulate is not None:
        framework, share = accumulate
        out += accumulation_transient([int(l.state_bytes * share) for l in layers[start:stop]], num_micro_batches,
                                      framework)
    return out


def backward_transient(layers: Sequence[LayerCost], start: int, stop: int) -> int:
    """Bytes the backward of layers ``[start, stop)`` (one pipeline stage, ONE micro-batch) holds at
    once beyond what the layers keep: the gradient the stage received for its output, held until
    its backward is done (none on the last stage, whose loss makes its own), plus, at the layer the
    backward has reached, that layer's output gradient, the gradient it makes for its input (the
    previous layer's output; none for the model's first layer: nobody differentiates the data)
    and what its kernels allocate besides (``backward_bytes``; on an estimate's last row also what
    the loss makes, ``Estimate.loss_bytes``), the largest such layer. Any
    framework's backward makes the gradients; a layer's weight gradient is the state's. From
    ``output_bytes`` (0 where a layer list leaves it out, which leaves the transient out)."""
    if not 0 <= start < stop <= len(layers):
        raise ConfigError(f"backward_transient: layers [{start}, {stop}) are empty or outside {len(layers)} layers")
    held = int(layers[stop - 1].output_bytes) if stop < len(layers) else 0
    work = max(int(layers[i].output_bytes) + (int(layers[i - 1].output_bytes) if i else 0)
               + int(layers[i].backward_bytes) for i in range(start, stop))
    return held + work


def accumulation_transient(gradients: Sequence[int], num_micro_batches: int, framework: str) -> int:
    """A stage that runs several micro-batches adds each one's gradients into accumulated ones (the
    state's): until added, a micro-batch's own gradients are alive beside them. TensorFlow's tape
    hands back all of them at once (the sum of the stage's ``gradients``, bytes per layer);
    torch's autograd adds each into ``.grad`` as it is made (the largest). One micro-batch: none."""
    if num_micro_batches <= 1 or not gradients:
        return 0
    return int(sum(gradients) if framework == "tensorflow" else max(gradients))


def _partition(layers: Sequence[LayerCost], num_parts: int, kind: str, schedule: Optional[str], m: int,
               recompute: bool, input_bytes: int, what: str,
               accumulate: Optional[Tuple[str, float]] = None) -> Partition:
    _check_layers(layers, num_parts, what)
    if input_bytes < 0:
        raise ConfigError(f"{what}: input_bytes={input_bytes} cannot be negative")
    _, a, b = _multipliers(kind, num_parts, schedule, m, recompute)
    state, act, boundary = _arrays(layers, input_bytes)
    cut_cost = np.asarray(boundary)
    bounds, optimum = solve(state, act, boundary, a, b, cut_cost)
    stages = stage_demands(layers, bounds, kind=kind, schedule=schedule, num_micro_batches=m,
                           recompute=recompute, input_bytes=input_bytes, accumulate=accumulate)
    part = Partition([l.name for l in layers], stages, kind, schedule if kind == "pipeline" else None, m,
                     recompute and kind == "pipeline", input_bytes,
                     cut_bytes=int(sum(boundary[i] for i, _ in bounds[1:])))
    held = max(s.held_bytes for s in stages)
    if held != optimum:  # the demand formula and the solver's cost must agree
        raise AssertionError(f"partition: solver optimum {optimum} != evaluated largest part {held}")
    part.info["lower_bound_bytes"] = _lower_bound(state, act, boundary, a, b)
    return part


def partition_pipeline(layers: Sequence[LayerCost], num_stages: int, *, num_micro_batches: int,
                       schedule: str = "1f1b", recompute: bool = False, input_bytes: int = 0,
                       accumulate: Optional[Tuple[str, float]] = None) -> Partition:
    """Cut ``layers`` (costs for ONE micro-batch) into ``num_stages`` stages minimising the largest
    stage's peak demand under ``schedule``; exact. ``input_bytes``: the model input per micro-batch,
    held by stage 0 like any stage's boundary input. ``accumulate``: see :func:`stage_demands`."""
    in_flight(schedule, 0, max(num_stages, 1), num_micro_batches)  # validates the schedule and m
    return _partition(layers, num_stages, "pipeline", schedule, num_micro_batches, recompute, input_bytes,
                      f"pipeline of {num_stages} stage(s)", accumulate)


def partition_model(layers: Sequence[LayerCost], num_devices: int, *, input_bytes: int = 0) -> Partition:
    """Cut ``layers`` into ``num_devices`` contiguous groups minimising the largest group's
    state + activations + received input (bytes); ties go to the fewest bytes crossing devices."""
    return _partition(layers, num_devices, "model", None, 1, False, input_bytes,
                      f"model parallel over {num_devices} device(s)")


def partition_plain(layers: Sequence[LayerCost], num_parts: int) -> Partition:
    """The optimum of plain per-layer sums ``state + activations`` (what balancing by per-layer cost
    does, ignoring the schedule). Used to measure what the schedule-aware cut saves."""
    return _partition(layers, num_parts, "plain", None, 1, False, 0, f"plain partition into {num_parts} part(s)")


def lower_bound(layers: Sequence[LayerCost], num_parts: int, *, kind: str = "pipeline",
                schedule: Optional[str] = "1f1b", num_micro_batches: int = 1, recompute: bool = False,
                input_bytes: int = 0) -> int:
    """An analytic lower bound on the optimum's largest part (bytes): the total at the smallest
    multiplier over ``num_parts``, the largest layer, and the first/last layer on their fixed parts."""
    _, a, b = _multipliers(kind, num_parts, schedule, num_micro_batches, recompute)
    state, act, boundary = _arrays(layers, input_bytes)
    return _lower_bound(state, act, boundary, a, b)
