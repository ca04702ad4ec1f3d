"""What a parallel wrapper adds to (or takes from) one rank's memory: DDP's reducer, FSDP2
(``fully_shard``), ZeRO-1/2 (``ZeroRedundancyOptimizer``, DeepSpeed stages 1 and 2), Horovod's fusion
buffer and tf.distribute's all-reduce packs. Pure: no framework is imported.

Every rule is written once here and used by every strategy's demand and by ``fit``. A rank's peak
under a wrapper is the peak of the same step without it (the estimator's, one replica, split into
its parts at the peak: :meth:`distmem.estimate.table.Estimate.breakdown`) with the model state the
wrapper shards replaced by the rank's shard, plus the buffers the wrapper holds at that moment:

* ``ddp`` (``DistributedDataParallel``): the reducer's buckets hold a flat copy of every gradient
  (``bucket_cap_mb`` sets how the copy is cut, not its sum), alive from construction. With
  ``gradient_as_bucket_view=True`` the gradients *are* views of the buckets: no copy, but all the
  gradient bytes stay allocated from the first backward on, also in the forward. Once, the reducer
  rebuilds its buckets in the order the gradients became ready (at the second step; the third
  with ``static_graph``), and the new buckets are allocated while the old are alive: that step's
  forward and backward hold two gradient-sized sets (measured on the H200 in 19 of 21 model x
  option cases, ``bench/results/wrappers_gpu.json``; a plan must hold the run's worst step). The
  update comes after the backward is done with the buckets: one set then (none beyond the
  gradients with ``gradient_as_bucket_view``, whose gradients are the buckets).
* ``fsdp2`` at world size N: parameters, gradients and optimizer state are the rank's shards (each
  parameter's dim 0 padded to a multiple of N, so ``ceil(bytes / N)`` per tensor). In the forward
  and backward a rank also holds the root unit's parameters unsharded (the root is not resharded
  after the forward), the unit being computed and ``prefetch`` more (all-gathered ahead), and in
  the backward the unit's unsharded gradients plus the reduce-scatter input they are copied into.
  ``reshard_after_forward=False`` keeps every unit unsharded from its forward to its backward.
  Those unit buffers exist only while units run: a peak that falls outside them (the loss and an
  output layer the root holds, where a language model's logits and their gradients peak, before
  any unit's backward has made a gradient) holds the root's parameters alone (with every unit too
  under ``reshard_after_forward=False``). The estimator's split of the peak tells which: gradients
  alive at the peak no more than the root's own. That peak is then held against the backward
  through the units (the kept activations, the shards and the unit buffers), the larger taken.
  The update runs on the shards: its temporaries shrink with the optimizer state.
* ``zero1`` (``torch.distributed.optim.ZeroRedundancyOptimizer``): the optimizer state of the
  parameters this rank owns; torch's partition gives whole tensors, largest first, each to the
  rank with the fewest elements so far, so rank 0 holds the largest tensor's state whatever N is.
  ``zero2``: the gradients too (DeepSpeed stage 2: each rank keeps its partition's gradients),
  except the gradient being made, whole until its accumulation ends. A rank keeping a share of
  each gradient can peak earlier in the backward than one replica does, where fewer gradients are
  made and more activations still kept (ResNet's last stages make more gradient bytes than they
  free): the estimator records those moments (the upper hull of gradients made against bytes in
  use) and each is priced beside the backward's peak.
* ``horovod``: one fusion buffer of ``HOROVOD_FUSION_THRESHOLD`` bytes (default 128 MiB, 0 disables
  it) per device and NCCL stream (``HOROVOD_NUM_NCCL_STREAMS`` on a GPU), allocated through the
  framework's allocator (TensorFlow's or torch's) the first time several tensors are fused into one
  collective: in training, the gradient all-reduce over more than one data-parallel replica (a
  pipeline's point-to-point exchange of one tensor at a time allocates none). ``HOROVOD_CYCLE_TIME``
  changes when tensors are fused, not the buffer's size. Under TensorFlow each reduced gradient is
  a new tensor (its ops do not write in place): one more gradient-sized set while they are alive;
  torch's ``hvd.DistributedOptimizer`` reduces in place.
* ``tf_distribute``: ``MultiWorkerMirroredStrategy``'s collective all-reduce concatenates the
  gradients of a pack (``bytes_per_pack=0``: one pack of all of them) into one tensor and gets its
  reduced copy back: two gradient-sized tensors while the step's gradients are alive. One device
  (``OneDeviceStrategy``, a job of one rank) reduces nothing.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..costs import GRADIENT_BEING_MADE
from ..errors import ConfigError
from ..units import MiB, format_bytes

__all__ = ["WRAPPER_CHOICES", "WRAPPERS", "SHARDED_WRAPPERS", "SHARDINGS", "sharding_wrapper", "added_bytes", "grad_fraction", "ModelState", "Wrapper", "WrapperDemand", "wrapper_demand",
           "rank_peak", "running_unit", "mixed_precision", "keep_backward_buffers", "in_flight_gathers", "zero_partition", "plan_wrapper", "fixed_bytes", "horovod_from_env", "wrapper_from_env", "check_wrapper",
           "DEFAULT_BUCKET_CAP_MB", "HOROVOD_FUSION_DEFAULT", "STATE_PARTS"]

#: Every wrapper a plan knows; None (no wrapper) is also accepted everywhere.
WRAPPERS = ("ddp", "fsdp2", "zero1", "zero2", "horovod", "tf_distribute")
#: The wrappers that shard model state over the data-parallel degree.
SHARDED_WRAPPERS = ("fsdp2", "zero1", "zero2")
#: What ``wrapper=`` takes on the strategies that count a wrapper's buffers (pipeline, model).
WRAPPER_CHOICES = ("auto", "none", "horovod", "ddp", "ddp_bucket_view", "tf_distribute")
#: How ``fit`` and the ``sharded`` strategy name a sharded data-parallel layout: ZeRO's stages, and
#: FSDP2 resharding after the forward (``fsdp2``) or keeping units gathered to the backward
#: (``fsdp2_keep``: ``reshard_after_forward=False``).
SHARDINGS = ("zero1", "zero2", "fsdp2", "fsdp2_keep")
#: ``DistributedDataParallel(bucket_cap_mb=25)``: torch's default.
DEFAULT_BUCKET_CAP_MB = 25.0
#: ``HOROVOD_FUSION_THRESHOLD``'s default: 128 MiB (Horovod 0.28).
HOROVOD_FUSION_DEFAULT = 128 * MiB
#: The estimator's breakdown parts that hold model state.
STATE_PARTS = ("weights", "gradients", "optimizer state")


@dataclass(frozen=True)
class ModelState:
    """One replica's model state (bytes): ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``.
    ``tensor_bytes``: bytes of each parameter tensor in registration order (ZeRO's partition and
    FSDP2's padding; empty: one even split), ``tensor_rows`` their dim 0. ``unit_bytes``: parameter bytes of each FSDP2 unit
    (a module given its own ``fully_shard``); ``root_bytes``: the parameters no unit holds (the
    root's: embeddings, final norm, head). Empty units: one unit, the whole model at the root."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    tensor_bytes: Tuple[int, ...] = ()
    unit_bytes: Tuple[int, ...] = ()
    root_bytes: Optional[int] = None
    tensor_rows: Tuple[int, ...] = ()  #: each tensor's dim 0 (FSDP2 pads it to a multiple of N)
    #: the root's parameters whose layers run after every unit (a final norm, an output head): their
    #: gradients are the backward's first, and stay unsharded to the backward's end with the root's
    root_head_bytes: int = 0
    #: the units as the plan names them (``8 x LlamaDecoderLayer; root: embed_tokens, norm, lm_head``)
    units_text: str = ""

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def grad_ratio(self) -> float:
        """Gradient bytes per parameter byte (1 in float32; 0 for a frozen model)."""
        return self.grad_bytes / self.param_bytes if self.param_bytes else 0.0

    @property
    def optimizer_ratio(self) -> float:
        """Optimizer bytes per parameter byte (2 for Adam's two float32 moments)."""
        return self.optimizer_bytes / self.param_bytes if self.param_bytes else 0.0

    @property
    def root(self) -> int:
        if self.root_bytes is not None:
            return int(self.root_bytes)
        return max(0, self.param_bytes - sum(self.unit_bytes)) if self.unit_bytes else self.param_bytes

    @property
    def largest_unit(self) -> int:
        return max(self.unit_bytes, default=0)


@dataclass(frozen=True)
class Wrapper:
    """A parallel wrapper and its options, as the training script sets them. ``kind``: one of
    :data:`WRAPPERS` or None; ``world_size``: the degree the state is sharded or reduced over."""

    kind: Optional[str] = None
    world_size: int = 1
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    reshard_after_forward: bool = True
    prefetch: int = 1
    fusion_threshold: int = HOROVOD_FUSION_DEFAULT
    fusion_buffers: int = 1
    #: whose ops the wrapper runs through: ``"tensorflow"`` ops write every result to a new tensor
    framework: str = ""
    #: FSDP2's ``MixedPrecisionPolicy``: bytes of ``param_dtype`` per byte of the sharded (master)
    #: parameters' dtype (0.5: bfloat16 over float32): what a gathered parameter and an unsharded
    #: gradient take; ``reduce_ratio`` the same for ``reduce_dtype`` (None: param_dtype's)
    param_ratio: float = 1.0
    reduce_ratio: Optional[float] = None
    #: the policy as given, for the plan's text (``param_dtype=bfloat16``)
    policy: str = ""

    @property
    def reduce(self) -> float:
        return self.param_ratio if self.reduce_ratio is None else float(self.reduce_ratio)

    def with_world(self, world_size: int) -> "Wrapper":
        return replace(self, world_size=int(world_size))

    def describe(self) -> str:
        if self.kind is None:
            return "no wrapper"
        if self.kind == "ddp":
            view = ", gradient_as_bucket_view" if self.gradient_as_bucket_view else ""
            return f"DDP (buckets of {self.bucket_cap_mb:g} MB{view}{', static_graph' if self.static_graph else ''})"
        if self.kind == "fsdp2":
            return (f"FSDP2 over {self.world_size} (reshard_after_forward={self.reshard_after_forward}, "
                    f"prefetch {self.prefetch}{', ' + self.policy if self.policy else ''})")
        if self.kind in ("zero1", "zero2"):
            return f"ZeRO-{self.kind[-1]} over {self.world_size}"
        if self.kind == "horovod":
            return f"Horovod fusion buffer {format_bytes(self.fusion_threshold)} x {self.fusion_buffers}"
        return "tf.distribute collective all-reduce"


def check_wrapper(w: Wrapper) -> Wrapper:
    """``w`` checked: a known kind, whole positive degree and counts; ConfigError naming the value."""
    if w.kind is not None and w.kind not in WRAPPERS:
        raise ConfigError(f"wrapper={w.kind!r} is not one of {', '.join(WRAPPERS)} (or None for no wrapper)")
    for value, what in ((w.world_size, "world size"), (w.fusion_buffers, "fusion buffers")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"wrapper {what} {value!r}: give a whole number >= 1")
    if isinstance(w.prefetch, bool) or not isinstance(w.prefetch, int) or w.prefetch < 0:
        raise ConfigError(f"prefetch={w.prefetch!r}: give the units all-gathered ahead, a whole number >= 0")
    if not 0 < w.param_ratio <= 4 or (w.reduce_ratio is not None and not 0 < w.reduce_ratio <= 4):
        raise ConfigError(f"mixed precision ratios {w.param_ratio!r}/{w.reduce_ratio!r}: bytes of param_dtype and "
                          "reduce_dtype per master byte, in (0, 4]")
    if w.bucket_cap_mb <= 0 or w.fusion_threshold < 0:
        raise ConfigError(f"bucket_cap_mb={w.bucket_cap_mb!r} must be > 0 and fusion threshold "
                          f"{w.fusion_threshold!r} >= 0 (0 disables Horovod's fusion)")
    return w


@dataclass
class WrapperDemand:
    """What a wrapper leaves on one rank (bytes): the rank's ``params``/``grads``/``optimizer``
    (shards, or the whole replica's), ``buffers`` it holds in the forward/backward and in the
    update, and ``update_scale``: the factor on the update's temporaries (the rank's share of the
    optimizer state). ``parts``: the named buffers; ``rules``: the rule applied, in words."""

    wrapper: Wrapper
    params: int
    grads: int
    optimizer: int
    backward_buffers: int
    update_buffers: int
    update_scale: float
    persistent_buffers: int = 0
    #: FSDP2: the buffers held where no unit runs (the loss, the root's own layers); None: as backward
    outside_buffers: Optional[int] = None
    #: FSDP2 with ``reshard_after_forward=False``: the buffers at the forward's end (every unit
    #: gathered, and the all-gather outputs still in flight); None: as backward
    forward_buffers: Optional[int] = None
    parts: Dict[str, int] = field(default_factory=dict)
    rules: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, object]:
        return {"wrapper": self.wrapper.kind, "world_size": self.wrapper.world_size, "params": self.params,
                "grads": self.grads, "optimizer": self.optimizer, "backward_buffers": self.backward_buffers,
                "update_buffers": self.update_buffers, "persistent_buffers": self.persistent_buffers,
                "update_scale": round(self.update_scale, 6), "parts": dict(self.parts), "rules": list(self.rules)}


def zero_partition(tensor_bytes: Sequence[int], world_size: int, rank: int = 0) -> int:
    """Bytes of the tensors ``ZeroRedundancyOptimizer`` gives ``rank`` of ``world_size``: sorted by
    size, largest first, each to the rank holding the least so far (ties: the lowest rank)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} of world size {world_size}: give 0 <= rank < world_size")
    held = [0] * world_size
    for nbytes in sorted((int(b) for b in tensor_bytes), reverse=True):
        r = min(range(world_size), key=lambda i: (held[i], i))
        held[r] += nbytes
    return held[rank]


def _shard(nbytes: int, tensors: Sequence[int], rows: Sequence[int], n: int) -> int:
    """FSDP2's shard of ``nbytes`` over ``n``: each tensor's dim 0 padded to a multiple of ``n``
    (``ceil(rows / n)`` rows each), the whole scaled to ``nbytes`` (gradients, optimizer state)."""
    total = sum(tensors)
    if n == 1:
        return nbytes
    if tensors and total:
        if len(rows) == len(tensors):
            padded = sum(int(math.ceil(r / n)) * (t // max(r, 1)) for t, r in zip(tensors, rows))
        else:
            padded = sum(int(math.ceil(t / n)) for t in tensors)
        return int(round(padded * nbytes / total))
    return int(math.ceil(nbytes / n))


def wrapper_demand(w: Wrapper, state: ModelState, *, rank: int = 0) -> WrapperDemand:
    """The rule of :data:`WRAPPERS` for ``w`` on ``state`` (see the module docstring)."""
    check_wrapper(w)
    n = w.world_size
    P, G, O = int(state.param_bytes), int(state.grad_bytes), int(state.optimizer_bytes)
    if w.kind is None:
        return WrapperDemand(w, P, G, O, 0, 0, 1.0, rules=["no wrapper: the replica's state"])
    if w.kind == "ddp":
        rebuilt = {"gradient buckets": G, "rebuilt buckets (once)": G}
        when = "third" if w.static_graph else "second"
        # the update runs after the backward has finished with the buckets: the old set is gone by then
        if w.gradient_as_bucket_view:
            return WrapperDemand(w, P, G, O, 2 * G, G, 1.0, persistent_buffers=G, parts=rebuilt,
                                 rules=["DDP gradient_as_bucket_view: gradients are views of the buckets, "
                                        "all gradient bytes allocated from the first backward on; the "
                                        f"buckets rebuilt once (the {when} step) beside the old ones: "
                                        f"{format_bytes(2 * G)} with the gradients in them"])
        return WrapperDemand(w, P, G, O, 2 * G, G, 1.0, persistent_buffers=G, parts=rebuilt,
                             rules=[f"DDP: buckets of {w.bucket_cap_mb:g} MB hold a copy of every gradient "
                                    f"({format_bytes(G)}), and once (the {when} step) the buckets rebuilt in "
                                    "the order gradients became ready are allocated beside them: "
                                    f"{format_bytes(2 * G)} at that step's peak"])
    if w.kind in ("zero1", "zero2"):
        mine = zero_partition(state.tensor_bytes, n, rank) if state.tensor_bytes else int(math.ceil(P / n))
        share = mine / P if P else 1.0 / n
        o = int(round(O * share))
        g = int(round(G * share)) if w.kind == "zero2" else G
        rule = (f"ZeRO-{w.kind[-1]} over {n}: rank {rank} owns {share:.2%} of the parameters (whole tensors, "
                f"largest first), so that share of the optimizer state" + (" and gradients" if w.kind == "zero2"
                                                                          else ""))
        return WrapperDemand(w, P, g, o, 0, 0, share, rules=[rule])
    if w.kind == "fsdp2":
        p = _shard(P, state.tensor_bytes, state.tensor_rows, n)
        share = p / P if P else 1.0 / n
        g, o = int(round(G * share)), int(round(O * share))
        if n == 1:
            # one rank: FSDP2 keeps the parameters unsharded and gathers nothing
            return WrapperDemand(w, P, G, O, 0, 0, 1.0, rules=["FSDP2 over 1: nothing sharded"])
        unit = state.largest_unit
        gr = state.grad_ratio
        root = state.root
        pr, rr = w.param_ratio, w.reduce
        if w.reshard_after_forward:
            gathered = int((root + min(1 + w.prefetch, max(len(state.unit_bytes), 1)) * unit) * pr)
        else:
            gathered = int((root + sum(state.unit_bytes)) * pr)
        ug = int(unit * gr) if state.unit_bytes else int(root * gr)
        rs = int(ug * pr) + int(ug * rr)
        parts = {"unsharded parameters": gathered, "unsharded gradients + reduce-scatter input": rs}
        mp = f" ({w.policy})" if w.policy else ""
        rule = (f"FSDP2 over {n}{mp}: shards of {share:.2%}; root {format_bytes(root)} unsharded through forward and "
                f"backward, " + (f"{1 + w.prefetch} unit(s) of {format_bytes(unit)} gathered (prefetch "
                                 f"{w.prefetch})" if w.reshard_after_forward else
                                 "every unit gathered from its forward to its backward") +
                (f" in param_dtype ({pr:g} byte per master byte)" if pr != 1 else "") +
                f", a unit's gradients + its reduce-scatter input {format_bytes(rs)}")
        if state.units_text:
            rule = f"FSDP2 units: {state.units_text}. " + rule
        outside = int((root + (0 if w.reshard_after_forward else sum(state.unit_bytes))) * pr)
        rule += (f"; where no unit runs (the loss, the root's own layers) the root {format_bytes(root)}"
                 + ("" if w.reshard_after_forward else " and every unit") + " alone")
        rule += ("; the root's gradients stay unsharded until its reduce-scatter at the backward's end "
                 f"({format_bytes(int(root * gr * pr))}, and as much again in the reduce-scatter input there)")
        forward = None
        if not w.reshard_after_forward:
            flight = int(in_flight_gathers(state, w.prefetch) * pr)
            forward = gathered + flight
            parts["all-gather outputs in flight (forward)"] = flight
            rule += (f"; at the forward's end every unit gathered and the all-gather outputs of the last "
                     f"{1 + w.prefetch} not yet freed ({format_bytes(flight)}); in the backward a unit is "
                     "resharded after its gradients are made, before its reduce-scatter, so only the units "
                     "not yet reached stay gathered")
        return WrapperDemand(w, p, g, o, gathered + rs, 0, share, outside_buffers=outside, forward_buffers=forward,
                             parts=parts, rules=[rule])
    if w.kind == "horovod":
        fusion = w.fusion_threshold * w.fusion_buffers if n > 1 else 0
        copies = G if n > 1 and w.framework == "tensorflow" else 0
        rule = (f"Horovod: fusion buffer {format_bytes(w.fusion_threshold)} x {w.fusion_buffers} in the framework's "
                "allocator" if fusion else "Horovod: no fusion buffer (threshold 0 or one replica)")
        if copies:
            rule += f"; TensorFlow's all-reduce writes each reduced gradient to a new tensor ({format_bytes(G)})"
        parts = {k: v for k, v in (("fusion buffer", fusion), ("reduced gradients", copies)) if v}
        return WrapperDemand(w, P, G, O, fusion + copies, fusion + copies, 1.0, persistent_buffers=fusion,
                             parts=parts, rules=[rule])
    # tf_distribute
    packs = 2 * G if n > 1 else 0
    return WrapperDemand(w, P, G, O, 0, packs, 1.0, parts={"all-reduce pack + reduced copy": packs} if packs else {},
                         rules=["tf.distribute collective all-reduce: the gradients packed into one tensor and its "
                                "reduced copy" if packs else "tf.distribute on one device: nothing reduced"])


def in_flight_gathers(state: ModelState, prefetch: int) -> int:
    """FSDP2's all-gather outputs alive beside the unsharded parameters in the forward: a unit's
    output is freed only once a later unit's all-gather is issued (the copy-out overlaps it), so
    ``1 + prefetch`` of them at once, taken as the largest units (their order is not known here)."""
    units = sorted(state.unit_bytes, reverse=True)
    return int(sum(units[:1 + prefetch])) if units else int(state.root)


def running_unit(state: ModelState, made: int) -> int:
    """The FSDP2 unit (index in forward order) whose backward runs when one replica has made
    ``made`` gradient bytes: the backward takes units last to first and a unit's gradients are all
    made when it ends. The root's gradients are counted as made first (safe: the unit found is then
    never past the true one)."""
    gr = state.grad_ratio
    left = max(0, int(made) - int(state.root * gr))
    for i in range(len(state.unit_bytes) - 1, -1, -1):
        g = int(state.unit_bytes[i] * gr)
        if left < g or i == 0:
            return i
        left -= g
    return 0


def keep_backward_buffers(state: ModelState, unit: int, pr: float = 1.0, rr: float = 1.0) -> int:
    """FSDP2 with ``reshard_after_forward=False`` while unit ``unit`` runs its backward: the root
    and the units not yet reached gathered, and the larger of the unit's two moments: computing
    its gradients (the unit gathered, its unsharded gradients) and after it (FSDP2 reshards a unit
    before its reduce-scatter: the unsharded gradients and the reduce-scatter input they are
    copied into). ``pr``/``rr``: param_dtype's and reduce_dtype's bytes per master byte."""
    u = int(state.unit_bytes[unit])
    g = int(u * state.grad_ratio)
    return int((state.root + sum(state.unit_bytes[:unit])) * pr + max((u + g) * pr, g * pr + g * rr))


def rank_peak(breakdown: Mapping[str, int], phase: str, state: ModelState, w: Optional[Wrapper], *,
              activation_bytes: Optional[int] = None, backward: Optional[Mapping[str, int]] = None,
              forward: Optional[Mapping[str, int]] = None, kept_at_end: Optional[int] = None,
              earlier: Sequence[Mapping[str, int]] = (), rank: int = 0) -> Tuple[int, Dict[str, int], WrapperDemand]:
    """One rank's peak (bytes) under ``w``, from the peak of the same step without it.

    ``breakdown``: that peak split into parts (``weights``, ``gradients``, ``optimizer state``,
    ``accumulated gradients`` under gradient accumulation, the rest: activations, temporaries,
    inputs, workspaces); ``phase``: where it happens (``forward``, ``backward`` or ``update``). The
    rank's share of each state part replaces the replica's; the rest is the rank's own micro-batch
    and stays, but an update's temporaries shrink with the optimizer's share; the wrapper's buffers
    at that moment are added. A peak in the update may move to the backward once the state is
    sharded: ``backward`` (the split of the step's peak within its backward pass) is priced the same
    way, and without it ``activation_bytes`` (what the layers keep for the backward) stands for the
    backward's start: the shards plus the kept activations, the workspaces and inputs, and the
    backward's buffers. ``forward`` (the split of the step's peak within its forward) prices the
    forward's end where the wrapper holds the most there (FSDP2 keeping units gathered), and with it
    the backward of the largest unit (the forward's activations standing for what is still kept).
    The larger moment is the rank's peak. Under FSDP2 the root's gradients are not sharded until the
    root's reduce-scatter at the backward's end: those of the layers after every unit (made first)
    are whole in every backward moment, and ``kept_at_end`` (what the loop holds beside the state
    when the backward ends: its output and loss, the batch, workspaces) prices that reduce-scatter,
    every root gradient whole and copied into its input. ``earlier``: backward moments with fewer
    gradients made than at the backward's peak (and more in use than the peak less those
    gradients; ``distmem.costs.GRADIENT_BEING_MADE`` the newest of them, which ZeRO-2 holds whole):
    a wrapper that keeps a share of each gradient (ZeRO-2, FSDP2) can peak at one of them instead,
    each priced as a backward moment. Under a ``MixedPrecisionPolicy`` the
    state parts are the master dtype's, the gathered parameters and unsharded gradients
    ``param_dtype``'s. Returns (peak, its parts, the demand)."""
    w = w or Wrapper()
    d = wrapper_demand(w, state, rank=rank)
    P, G, O = state.param_bytes, state.grad_bytes, state.optimizer_bytes
    fsdp = w.kind == "fsdp2" and w.world_size > 1
    head_grads = int(state.root_head_bytes * state.grad_ratio)

    def share(nbytes: int, whole: int, mine: int) -> int:
        return int(round(nbytes * (mine / whole))) if whole else nbytes

    def moment(split: Mapping[str, int], at: str, accumulated: int) -> Dict[str, int]:
        parts = {k: int(v) for k, v in split.items()}
        weights = parts.pop("weights", 0)
        made = parts.pop("gradients", 0)  # this micro-step's gradients made by the moment
        newest = parts.pop(GRADIENT_BEING_MADE, 0)  # of them, the one made last (where recorded)
        made += newest
        parts.pop("accumulated gradients", None)
        # a new gradient added into its accumulated one (the largest layer's): on this rank, its shard
        # under FSDP2 (the reduce-scatter's output is accumulated), whole otherwise (ZeRO gives rank 0
        # the largest tensor)
        transient = parts.pop("accumulation transient", 0)
        if transient and w.kind == "fsdp2" and P:
            transient = share(transient, P, d.params)
        if transient:
            parts["accumulation transient"] = transient
        opt = parts.pop("optimizer state", 0)
        steady = sum(v for k, v in parts.items() if k in ("workspaces", "inputs"))
        rest = sum(parts.values())
        whole = 0  # FSDP2: the root head's gradients, made first, unsharded until the backward's end
        if fsdp and at != "update":
            whole = min(made, head_grads)
        elif w.kind == "zero2" and at != "update":
            # ZeRO-2: the gradient being made is whole until its accumulation ends (then the rank
            # keeps its partition's share)
            whole = newest
        out = {"weights": share(weights, P, d.params),
               "gradients": share(made - whole + accumulated, G, d.grads) + int(whole * w.param_ratio),
               "optimizer state": share(opt, O, d.optimizer)}
        if at == "update":
            out["activations, temporaries, inputs"] = steady + int(round((rest - steady) * d.update_scale))
            buffers = d.update_buffers
        else:
            out["activations, temporaries, inputs"] = rest
            buffers = d.backward_buffers
        if w.kind == "ddp" and w.gradient_as_bucket_view:
            # the buckets hold every gradient byte; the gradients alive at the peak are part of them
            buffers = max(0, buffers - out["gradients"])
        keep = d.forward_buffers is not None
        if keep and at == "forward":
            buffers = d.forward_buffers
        elif d.outside_buffers is not None and at != "update" and made <= int(state.root * state.grad_ratio):
            # FSDP2 at the loss and the root's own layers, before any unit's backward has made a
            # gradient: no unit gathered, none reducing (an output layer that is a unit of its own is
            # gathered once its output's gradient is ready: after the loss's backward)
            buffers = d.outside_buffers
        elif keep and at == "backward" and state.unit_bytes:
            buffers = keep_backward_buffers(state, running_unit(state, made), w.param_ratio, w.reduce)
        out["wrapper buffers"] = buffers
        return out

    accumulated = int(breakdown.get("accumulated gradients", 0))
    moments = [moment(breakdown, phase, accumulated)]
    start_of_backward = activation_bytes is not None and (
        (phase == "update" and w.kind in SHARDED_WRAPPERS) or
        (d.outside_buffers is not None and phase != "update"))
    if backward is not None and phase == "update" and w.kind is not None:
        # the backward's own peak: with accumulation every gradient it has not made yet is alive
        made = int(backward.get("gradients", 0))
        moments.append(moment(backward, "backward", max(0, G - made) if accumulated else 0))
    if start_of_backward:
        # the backward's start (every activation kept, no gradient made yet) is a moment of its own
        # even where the backward's split is priced: at a small batch the whole model's backward
        # peaks at its end (every gradient made, the activations freed), which the sharded state no
        # longer makes the rank's peak (hand-written GPT 1B, FSDP2 over 8 at micro-batch 1: 38% under
        # on the H200 without it, bench/results/fit_h200_pairs.jsonl)
        steady = sum(int(v) for k, v in breakdown.items() if k in ("workspaces", "inputs"))
        # under reshard_after_forward=False the backward starts at the last unit, every unit gathered
        if d.forward_buffers is not None and state.unit_bytes:
            start = keep_backward_buffers(state, len(state.unit_bytes) - 1, w.param_ratio, w.reduce)
        elif fsdp and not state.unit_bytes:
            start = d.outside_buffers or 0  # the root alone: its reduce-scatter comes at the backward's end
        else:
            start = d.backward_buffers
        moments.append({"weights": d.params, "gradients": share(accumulated, G, d.grads), "optimizer state": d.optimizer,
                        "activations, temporaries, inputs": int(activation_bytes) + steady,
                        "wrapper buffers": start})
    if w.kind in ("zero2", "fsdp2"):  # they keep a share of each gradient (ZeRO-1, DDP: every one)
        for split in earlier:
            made = int(split.get("gradients", 0)) + int(split.get(GRADIENT_BEING_MADE, 0))
            moments.append(moment(split, "backward", max(0, G - made) if accumulated else 0))
    if forward is not None and d.forward_buffers is not None:
        fwd_acc = G if accumulated else 0  # a later micro-step's forward: every earlier gradient alive
        moments.append(moment(forward, "forward", fwd_acc))
        if state.unit_bytes:
            # the largest unit's backward: the units after it have made their gradients, the forward's
            # activations stand for what is still kept (an upper bound), the unit's buffers
            big = max(range(len(state.unit_bytes)), key=lambda i: state.unit_bytes[i])
            after = int(sum(state.unit_bytes[big + 1:]) * state.grad_ratio)
            split = dict(forward, gradients=after)
            m = moment(split, "backward", max(0, G - after) if accumulated else 0)
            m["wrapper buffers"] = keep_backward_buffers(state, big, w.param_ratio, w.reduce)
            moments.append(m)
    root_grads = int(state.root * state.grad_ratio)
    if fsdp and kept_at_end is not None and root_grads:
        # the root's reduce-scatter once the backward is done: the root resharded, every unit's
        # gradient a shard, every root gradient whole and copied into the reduce-scatter input
        unit_grads = max(0, G - root_grads)
        moments.append({"weights": d.params,
                        "gradients": share(unit_grads, G, d.grads) + int(root_grads * w.param_ratio),
                        "optimizer state": d.optimizer, "activations, temporaries, inputs": int(kept_at_end),
                        "wrapper buffers": int(root_grads * w.reduce)})
    out = max(moments, key=lambda m: sum(m.values()))
    return sum(out.values()), out, d


def sharding_wrapper(name: str, degree: int, *, prefetch: int = 1, **policy: Any) -> Wrapper:
    """The :class:`Wrapper` of a sharding named in :data:`SHARDINGS` over ``degree`` ranks;
    ``policy``: FSDP2's mixed precision (:func:`mixed_precision`)."""
    if name not in SHARDINGS:
        raise ConfigError(f"sharding {name!r} is not one of {', '.join(SHARDINGS)}")
    if name.startswith("fsdp2"):
        return check_wrapper(Wrapper("fsdp2", int(degree), reshard_after_forward=name == "fsdp2", prefetch=prefetch,
                                     **policy))
    return check_wrapper(Wrapper(name, int(degree)))


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def mixed_precision(param_dtype: Optional[str], reduce_dtype: Optional[str] = None,
                    master_bytes: float = 4.0) -> Dict[str, Any]:
    """FSDP2's ``MixedPrecisionPolicy`` as :class:`Wrapper` fields: the bytes of ``param_dtype`` and
    ``reduce_dtype`` per byte of the parameters as held (``master_bytes`` per element)."""
    if param_dtype is None and reduce_dtype is None:
        return {}
    for v in (param_dtype, reduce_dtype):
        if v is not None and v not in _DTYPE_BYTES:
            raise ConfigError(f"dtype {v!r}: give one of {', '.join(_DTYPE_BYTES)}")
    pr = _DTYPE_BYTES[param_dtype] / master_bytes if param_dtype else 1.0
    rr = _DTYPE_BYTES[reduce_dtype] / master_bytes if reduce_dtype else None
    text = ", ".join(f"{k}={v}" for k, v in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)) if v)
    return {"param_ratio": pr, "reduce_ratio": rr, "policy": text}


def grad_fraction(optimizer: Optional[str]) -> float:
    """The gradients' share of a layer's state (weights + gradients + optimizer slots) when only the
    state's total is known: ``1 / (2 + slots)``, with Adam's 2 slots, momentum's 1, SGD's 0."""
    slots = {"sgd": 0, "momentum": 1, "rmsprop": 1, "adagrad": 1}.get(str(optimizer or "adam").lower(), 2)
    return 1.0 / (2 + slots)


def added_bytes(w: Optional[Wrapper], grad_bytes: int) -> int:
    """What a wrapper that shards nothing (``ddp``, ``horovod``, ``tf_distribute``) adds to a
    demand whose gradients are ``grad_bytes``: the larger of its backward and update buffers."""
    if w is None or w.kind is None:
        return 0
    if w.kind in SHARDED_WRAPPERS:
        raise ConfigError(f"wrapper={w.kind!r} shards the model state: plan it with strategy='sharded' (or fit), "
                          "which replaces the state by each rank's shard")
    d = wrapper_demand(w, ModelState(0, int(grad_bytes), 0))
    if w.kind == "ddp" and w.gradient_as_bucket_view:
        # the buckets are the gradients the demand holds at its end; the rebuilt set is beside them
        return max(0, d.backward_buffers - int(grad_bytes))
    return max(d.backward_buffers, d.update_buffers, d.persistent_buffers)


def fixed_bytes(w: Optional[Wrapper]) -> int:
    """The part of :func:`added_bytes` that is one allocation made once and kept (Horovod's fusion
    buffer): a limit adds it after the headroom, which covers the churn of the rest (the cache and
    fragmentation of what is allocated and freed every step), not a buffer that never moves."""
    if w is None or w.kind != "horovod" or w.world_size < 2:
        return 0
    return w.fusion_threshold * w.fusion_buffers


def plan_wrapper(kind: Optional[str], *, world_size: int, on_gpu: bool,
                 env: Optional[Mapping[str, str]] = None, framework: str = "") -> Optional[Wrapper]:
    """The wrapper a ``pipeline`` or ``model`` plan counts: ``wrapper=`` as the strategy got it
    (``"none"``, the strategies' default; ``"ddp"``, ``"ddp_bucket_view"`` (``gradient_as_bucket_view=True``),
    ``"horovod"``, ``"tf_distribute"``; or
    ``"auto"``: Horovod when ``HOROVOD_*`` variables say this process runs under it - a dry run sees
    none, so only a named wrapper plans the same bytes at every door)."""
    if kind is not None and not isinstance(kind, str):
        raise ConfigError(f"wrapper={kind!r}: give a name such as 'horovod', 'ddp', 'auto' or 'none'")
    w = wrapper_from_env(kind, env, world_size=world_size, on_gpu=on_gpu)
    if w is not None and w.kind in SHARDED_WRAPPERS:
        added_bytes(w, 0)  # raises: sharding is strategy='sharded'
    if w is not None and framework:
        w = replace(w, framework="tensorflow" if framework in ("tensorflow", "tf", "keras") else framework)
    return w


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or str(text).strip() == "":
        return default
    try:
        value = int(float(str(text).strip()))
    except ValueError:
        raise ConfigError(f"{name}={text!r}: give a whole number of bytes (Horovod reads it as an integer)") from None
    if value < 0:
        raise ConfigError(f"{name}={text!r}: give bytes >= 0 (0 disables the fusion buffer)")
    return value


def horovod_from_env(env: Optional[Mapping[str, str]] = None, *, world_size: int = 1,
                     on_gpu: bool = False) -> Optional[Wrapper]:
    """Horovod's wrapper from the environment a horovodrun/mpirun rank inherits, or None when no
    ``HOROVOD_*`` variable says a Horovod job runs. The fusion threshold is
    ``HOROVOD_FUSION_THRESHOLD`` (default 128 MiB); a GPU keeps one buffer per NCCL stream
    (``HOROVOD_NUM_NCCL_STREAMS``, default 1)."""
    e = os.environ if env is None else env
    if not any(k.startswith("HOROVOD_") for k in e):
        return None
    threshold = _env_int(e, "HOROVOD_FUSION_THRESHOLD", HOROVOD_FUSION_DEFAULT)
    streams = max(1, _env_int(e, "HOROVOD_NUM_NCCL_STREAMS", 1)) if on_gpu else 1
    return Wrapper("horovod", max(1, int(world_size)), fusion_threshold=threshold, fusion_buffers=streams)


def wrapper_from_env(kind: Optional[str], env: Optional[Mapping[str, str]] = None, *, world_size: int = 1,
                     on_gpu: bool = False, **options: object) -> Optional[Wrapper]:
    """The wrapper a strategy plans for: ``kind`` as given (``"auto"``: Horovod when ``HOROVOD_*``
    says so, else none), with ``options`` (``bucket_cap_mb``, ``gradient_as_bucket_view``...)."""
    if kind in (None, "none"):
        return None
    if kind == "auto":
        return horovod_from_env(env, world_size=world_size, on_gpu=on_gpu)
    if kind == "horovod":
        found = horovod_from_env(env, world_size=world_size, on_gpu=on_gpu)
        base = found or Wrapper("horovod", max(1, int(world_size)))
        return check_wrapper(replace(base, **options))  # type: ignore[arg-type]
    if kind == "ddp_bucket_view":  # DistributedDataParallel(gradient_as_bucket_view=True)
        kind, options = "ddp", dict(options, gradient_as_bucket_view=True)
    if kind not in WRAPPERS:
        raise ConfigError(f"wrapper={kind!r} is not one of {', '.join(WRAPPERS)}, 'ddp_bucket_view', 'auto' "
                          "(Horovod from HOROVOD_*) or None")
    return check_wrapper(Wrapper(str(kind), max(1, int(world_size)), **options))  # type: ignore[arg-type]
