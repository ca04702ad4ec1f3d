"""What prices a layout in ``distmem fit``: the costs behind a rank's demand, per precision. Pure.

The costs come from a :class:`Costs` per precision: :class:`EstimateCosts` wraps a
``distmem.estimate`` result (whole-step peaks simulated per micro-batch for data parallel,
per-layer rows for pipeline stages), :class:`LayerListCosts` scales a ``LayerCost`` list given at
one batch size (what tools and the speed benchmark pass). Cuts between pipeline stages are made
between *blocks*: an estimator's rows grouped by top-level module (``layer1.0.conv1`` belongs
to block ``layer1``), so every cut is one a training loop can make by slicing the model's
top-level children; wrap a model as ``nn.Sequential`` of its blocks for finer cuts.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...costs import EARLIER_BACKWARD, GRADIENT_BEING_MADE, LayerCost
from ...errors import ConfigError
from ..partition import backward_transient

__all__ = ["Costs", "EstimateCosts", "LayerListCosts", "group_blocks", "TRANSIENT_OUTPUTS"]


def _as_master(parts: Optional[Dict[str, int]], ratio: float) -> Optional[Dict[str, int]]:
    """A peak's split with its model-state parts in master bytes (``ratio``: the step's parameter
    bytes per master byte)."""
    if parts is None:
        return None
    state = ("weights", "gradients", "optimizer state", "accumulated gradients", "accumulation transient",
             GRADIENT_BEING_MADE)
    return {k: (int(round(v / ratio)) if k in state else int(v)) for k, v in parts.items()}

#: A stage's backward holds, beyond what its layers keep, the gradient arriving for its output
#: and the gradient it computes for the input of the layer it is working on: two layer outputs
#: of the largest layer, for one micro-batch (bytes = 2 x largest output).
TRANSIENT_OUTPUTS = 2

#: The name of the part a step's peak is raised by to its estimate's high figure
#: (``estimate uncertainty (<source>)``).
UNCERTAINTY = "estimate uncertainty"


def _block_of(name: str) -> Optional[str]:
    """Top-level block of an estimator row (``layer1.0.conv1 (own ops)`` -> ``layer1``); None for
    rows that belong to no child (the model's own ops, unused parameters)."""
    base = name.replace(" (own ops)", "")
    if not base or base.startswith("("):
        return None
    return base.split(".")[0]


def group_blocks(names: Sequence[str]) -> List[Tuple[str, int, int]]:
    """``(block, first row, stop row)`` runs of consecutive rows sharing a top-level block. Rows of
    no block join the block before them (the first block when they come first); a block name
    that comes back after another block gets a ``#2`` suffix so that names stay unique."""
    groups: List[Tuple[str, int, int]] = []
    pending: Optional[int] = None
    seen: Dict[str, int] = {}
    for i, name in enumerate(names):
        block = _block_of(name)
        if block is None:
            if groups:
                groups[-1] = (groups[-1][0], groups[-1][1], i + 1)
            elif pending is None:
                pending = i
            continue
        if groups and groups[-1][0].split("#")[0] == block:
            groups[-1] = (groups[-1][0], groups[-1][1], i + 1)
            continue
        seen[block] = seen.get(block, 0) + 1
        label = block if seen[block] == 1 else f"{block}#{seen[block]}"
        start = pending if (not groups and pending is not None) else i
        groups.append((label, start, i + 1))
    if not groups and names:
        groups.append(("(model)", 0, len(names)))
    return groups


class Costs:
    """Per-precision costs of one model; every figure is bytes for ONE replica at micro-batch ``mb``."""

    precision: str = "float32"
    framework: str = "torch"
    block_names: List[str]
    #: bytes every rank keeps whatever its layers (cuBLAS workspaces inside the allocator)
    persistent_bytes: int = 0

    def block_costs(self, mb: int) -> List[LayerCost]:  # pragma: no cover - interface
        raise NotImplementedError

    def block_state_split(self) -> List[Dict[str, int]]:
        """Per block ``{"weights", "gradients", "optimizer"}`` bytes (sums to the block's state)."""
        raise NotImplementedError  # pragma: no cover - interface

    def input_bytes(self, mb: int) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def transient_bytes(self, mb: int, start: int, stop: int) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def whole_peak(self, mb: int, accumulate: bool) -> Tuple[int, Dict[str, int]]:  # pragma: no cover
        raise NotImplementedError

    @property
    def gradient_bytes(self) -> int:
        return sum(b["gradients"] for b in self.block_state_split())

    def model_state(self, start: int = 0, stop: Optional[int] = None, master_ratio: float = 1.0) -> Any:
        """Blocks ``start .. stop-1``'s state as :class:`distmem.plan.wrappers.ModelState`, each
        block one FSDP2 unit (``fully_shard`` per block, the root holding nothing of its own).
        ``master_ratio``: bytes of the priced step's parameters per master byte (the state is
        returned in master bytes)."""
        from ..wrappers import ModelState

        split = [{k: int(round(v / master_ratio)) for k, v in b.items()}
                 for b in self.block_state_split()[start:stop]]
        weights = [b["weights"] for b in split]
        return ModelState(sum(weights), sum(b["gradients"] for b in split), sum(b["optimizer"] for b in split),
                          unit_bytes=tuple(weights), root_bytes=0)

    def peak_parts(self, mb: int, accumulate: bool) -> Tuple[Dict[str, int], str, Optional[int]]:
        """The one-replica peak split as :func:`distmem.plan.wrappers.rank_peak` takes it: (parts with
        ``weights``, ``gradients``, ``optimizer state``; the phase; the kept activations or None)."""
        peak, parts = self.whole_peak(mb, accumulate)
        split = self.block_state_split()
        out = {k: v for k, v in parts.items() if k != "state"}
        if "state" in parts:
            out["weights"] = sum(b["weights"] for b in split)
            out["gradients"] = sum(b["gradients"] for b in split)
            out["optimizer state"] = parts["state"] - out["weights"] - out["gradients"]
        return out, "backward", None

    def rank_peak(self, mb: int, accumulate: bool, wrapper: Any) -> Tuple[int, Dict[str, int]]:
        """One rank's allocator peak at micro-batch ``mb`` under ``wrapper`` (a sharded data-parallel
        :class:`distmem.plan.wrappers.Wrapper`), by :func:`distmem.plan.wrappers.rank_peak`."""
        from ..wrappers import rank_peak

        parts, phase, kept = self.peak_parts(mb, accumulate)
        # the estimate's uncertainty is a share of what a rank holds, not bytes of the whole
        # model's step: taken out before the wrapper shards the step, put back as that share of
        # the rank's own peak
        uncertain = {k: parts.pop(k) for k in list(parts) if k.startswith(UNCERTAINTY)}
        share = sum(uncertain.values()) / max(1, sum(parts.values()))
        backward = self.backward_parts(mb)
        forward = self.forward_parts(mb)
        earlier = self.earlier_backward(mb)
        _, later = self.accumulated_moments(mb) if accumulate else (None, [])
        if later:
            # a later micro-step's backward moments, the gradient being made beside the accumulated ones
            earlier = later
            backward = max(later, key=lambda m: sum(m.values()))
        elif backward is not None and accumulate:
            backward = dict(backward, **{"accumulation transient": self.largest_gradient})
        ratio = float(getattr(wrapper, "param_ratio", 1.0) or 1.0) if getattr(wrapper, "kind", None) == "fsdp2" else 1.0
        if ratio != 1.0:
            # this step ran in param_dtype (as FSDP2 computes it); the state it shards is the master dtype's
            parts, backward, forward = (_as_master(x, ratio) for x in (parts, backward, forward))
        if ratio != 1.0:
            earlier = [_as_master(x, ratio) for x in earlier]
        peak, out, _ = rank_peak(parts, phase, self.model_state(), wrapper, activation_bytes=kept,
                                 backward=backward, forward=forward, kept_at_end=self.kept_at_end(mb),
                                 earlier=earlier)
        if uncertain:
            extra = int(math.ceil(peak * share))
            out[next(iter(uncertain))] = extra
            peak += extra
        return peak, out

    def kept_at_end(self, mb: int) -> Optional[int]:
        """Bytes the loop holds beside the model state when its backward ends (the output and loss
        it keeps, the batch, workspaces); None where unknown."""
        return None

    def backward_parts(self, mb: int) -> Optional[Dict[str, int]]:
        return None

    def earlier_backward(self, mb: int) -> List[Dict[str, int]]:
        """Backward moments with fewer gradients made than at its peak, split (see
        :func:`distmem.estimate.torch.trace.gradient_frontier`); none where unknown."""
        return []

    def accumulated_moments(self, mb: int) -> Tuple[Optional[Dict[str, int]], List[Dict[str, int]]]:
        """A later micro-step's forward and backward moments under gradient accumulation (see
        :meth:`EstimateCosts.accumulated_moments`); (None, []) where unknown."""
        return None, []

    def forward_parts(self, mb: int) -> Optional[Dict[str, int]]:
        return None

    @property
    def largest_gradient(self) -> int:
        return 0

    def largest_block(self, mb: int, shard: str = "") -> int:
        """The largest single allocation one rank makes at micro-batch ``mb`` (bytes; 0 unknown):
        a layer's weights or gradients, a layer's output, and under FSDP2 a unit's all-gathered
        parameters (one flat buffer)."""
        return 0


class EstimateCosts(Costs):
    """Costs from a ``distmem.estimate`` :class:`~distmem.estimate.Estimate` (one per precision).

    Data parallel (one stage) uses the estimate's simulated/replayed whole-step peak at each
    micro-batch, plus, with gradient accumulation, the gradients the single step had not yet
    made at its peak (they stay alive across micro-steps). Pipeline stages sum the estimate's
    per-layer rows grouped into blocks, which scale exactly linearly with the micro-batch."""

    def __init__(self, est: Any, units: Any = None) -> None:
        self.est = est
        #: the model's FSDP2 units (:class:`distmem.estimate.torch.units.FsdpUnits`); None: each block one unit
        self.units = units
        self.precision = str(est.precision)
        self.framework = "torch" if str(est.framework).lower() in ("torch", "pytorch") else "tensorflow"
        rows = list(est.layers)
        groups = group_blocks([r.name for r in rows])
        self.block_names = [g[0] for g in groups]
        self._rows = [rows[i:j] for _, i, j in groups]
        self._state = [sum(r.state_bytes for r in g) for g in self._rows]
        self._split = [{"weights": sum(r.param_bytes for r in g), "gradients": sum(r.grad_bytes for r in g),
                        "optimizer": sum(r.optimizer_bytes for r in g)} for g in self._rows]
        self._act_ps = [sum(r.activation_bytes_per_sample for r in g) for g in self._rows]
        self._act_fixed = [sum(r.activation_fixed_bytes for r in g) for g in self._rows]
        self._out_ps = [self._block_output(g) for g in self._rows]
        self._max_out_ps = [max((r.output_bytes_per_sample for r in g), default=0) for g in self._rows]
        self._work_ps = [max((r.workspace_bytes_per_sample for r in g), default=0) for g in self._rows]
        self._in_ps = int(getattr(est, "input_bytes_per_sample", 0) or 0)
        self.persistent_bytes = int(getattr(est, "extra_persistent_bytes", 0) or 0)
        self._largest_grad = max((int(r.grad_bytes) for r in rows), default=0)
        self._peaks: Dict[Tuple[int, bool], Tuple[int, Dict[str, int], str]] = {}

    @staticmethod
    def _block_output(rows: Sequence[Any]) -> int:
        """A block's output per sample: its own row's (recorded when the container returns), else the
        largest of its rows' (an over-estimate, safe for the boundary a stage holds)."""
        for r in rows:
            if r.name.endswith(" (own ops)") and r.output_bytes_per_sample:
                return int(r.output_bytes_per_sample)
        if len(rows) == 1:
            return int(rows[0].output_bytes_per_sample)
        return int(max((r.output_bytes_per_sample for r in rows), default=0))

    def block_costs(self, mb: int) -> List[LayerCost]:
        return [LayerCost(name=n, state_bytes=int(s), activation_bytes=int(a * mb + f), output_bytes=int(o * mb))
                for n, s, a, f, o in zip(self.block_names, self._state, self._act_ps, self._act_fixed, self._out_ps)]

    def block_state_split(self) -> List[Dict[str, int]]:
        return [dict(x) for x in self._split]

    def input_bytes(self, mb: int) -> int:
        return self._in_ps * mb

    def transient_bytes(self, mb: int, start: int, stop: int) -> int:
        """Two outputs of the stage's largest layer and its workspace; on the stage that ends the
        model, at least what the loss makes when the backward starts (``Estimate.loss_bytes``: its
        saved log-probabilities and the logits' gradients, beside the layers' kept activations)."""
        out = max(self._max_out_ps[start:stop], default=0)
        work = max(self._work_ps[start:stop], default=0)
        base = int((TRANSIENT_OUTPUTS * out + work) * mb)
        if stop < len(self._rows):
            return base
        return max(base, int(self.est.loss_bytes(int(mb))))

    def whole_peak(self, mb: int, accumulate: bool) -> Tuple[int, Dict[str, int]]:
        return self._whole(mb, accumulate)[:2]

    def _whole(self, mb: int, accumulate: bool) -> Tuple[int, Dict[str, int], str]:
        """(peak, its split, its phase) of one micro-step at ``mb``; under gradient accumulation
        (``accumulate``) the micro-step after the first: the gradients of earlier micro-steps are
        alive through its forward and backward, and each parameter's new gradient is added into its
        accumulated one, so the gradient being made is alive twice for a moment. Where the estimate
        recorded the backward's moments (:meth:`accumulated_moments`) the largest of them is the
        micro-step's peak; else the step's own peak with the gradients it had not made and the
        largest gradient tensor beside it (an upper bound: at a language model's logits, its peak,
        no gradient is being made, and its largest, the embedding's, is made after)."""
        key = (int(mb), bool(accumulate))
        if key not in self._peaks:
            detail = self.est.peak_detail(int(mb))
            peak = int(detail["peak"])
            phase = str(detail.get("phase", "backward"))
            parts = {k: int(v) for k, v in self.est.breakdown(int(mb)).items()}
            # priced at the estimate's high figure (DESIGN: no figure without a bound), never below
            # what the model holds whatever the batch
            bound = self.est.bound(int(mb)) if hasattr(self.est, "bound") else None
            high = max(int(bound.high_bytes) if bound is not None else peak, int(self.est.state_floor)
                       if hasattr(self.est, "state_floor") else 0)
            if high > peak:
                source = bound.source if bound is not None else "modelled"
                parts[f"{UNCERTAINTY} ({source})"] = high - peak
                peak = high
            if accumulate:
                grad_bytes = int(self.est.grad_bytes)
                transient = self.largest_gradient
                fwd_acc, bwd_acc = self.accumulated_moments(mb)
                later = [m for m in [fwd_acc] + bwd_acc if m is not None]
                if phase == "update":
                    # the update's peak holds them all already: the same bytes, named for what they are
                    moved = min(grad_bytes, int(parts.get("gradients", 0)))
                    parts["gradients"] = int(parts.get("gradients", 0)) - moved
                    parts["accumulated gradients"] = moved
                    # a later micro-step's backward: its own peak, the gradients it has not made, the add
                    bwd = self.backward_parts(mb)
                    if later:
                        alt = max(later, key=lambda m: sum(m.values()))
                        if sum(alt.values()) > peak:
                            phase = "forward" if alt is fwd_acc else "backward"
                            peak, parts = sum(alt.values()), alt
                    elif bwd is not None:
                        alt = dict(bwd)
                        alt["accumulated gradients"] = max(0, grad_bytes - int(alt.get("gradients", 0)))
                        alt["accumulation transient"] = transient
                        if sum(alt.values()) > peak:
                            peak, parts, phase = sum(alt.values()), alt, "backward"
                elif later:
                    # the later micro-step's largest moment: the estimate's uncertainty kept beside it
                    alt = max(later, key=lambda m: sum(m.values()))
                    phase = "forward" if alt is fwd_acc else "backward"
                    parts = dict(alt, **{k: v for k, v in parts.items() if k.startswith(UNCERTAINTY)})
                    peak = sum(parts.values())
                else:
                    at_peak = int(detail.get("grads_at_peak", parts.get("gradients", 0)))
                    parts["accumulated gradients"] = max(0, grad_bytes - at_peak)
                    parts["accumulation transient"] = transient
                    peak += parts["accumulated gradients"] + transient
            self._peaks[key] = (peak, parts, phase)
        return self._peaks[key]

    def accumulated_moments(self, mb: int) -> Tuple[Optional[Dict[str, int]], List[Dict[str, int]]]:
        """A later micro-step's moments under gradient accumulation, each split (``accumulated
        gradients``: what earlier micro-steps left; ``gradients``: this one's, added into theirs):
        its forward's peak with every gradient alive, and each backward moment the estimate
        recorded (:data:`distmem.costs.EARLIER_BACKWARD`) with every gradient alive and the one
        being made beside them until it is added in (``accumulation transient``: that gradient,
        not the model's largest: at a language model's logits no gradient is being made). (None,
        []) where the estimate recorded no backward moments."""
        earlier = self.earlier_backward(mb)
        if not earlier:
            return None, []
        grads = int(self.est.grad_bytes)
        fwd = self.forward_parts(mb)
        if fwd is not None:
            fwd = dict(fwd)
            fwd["accumulated gradients"] = max(0, grads - int(fwd.get("gradients", 0)))
        out = []
        for split in earlier:
            m = dict(split)
            newest = int(m.pop(GRADIENT_BEING_MADE, 0))
            made = int(m.get("gradients", 0))
            m["accumulated gradients"] = max(0, grads - made)
            m["accumulation transient"] = newest
            out.append(m)
        return fwd, out

    @property
    def largest_gradient(self) -> int:
        """The largest layer's gradient bytes (a module's weight and bias together)."""
        return self._largest_grad

    def largest_block(self, mb: int, shard: str = "") -> int:
        """:meth:`Costs.largest_block`: the simulated step's largest single request where the estimate
        records it (the loss's float32 copy of the logits under mixed precision is twice the output
        row), else the rows' weights, gradients and outputs."""
        rows = [r for g in self._rows for r in g]
        out = max([int(r.param_bytes) for r in rows] + [int(r.grad_bytes) for r in rows]
                  + [int(r.output_bytes_per_sample) * int(mb) for r in rows] + [0])
        try:
            out = max(out, int(self.est.peak_detail(int(mb)).get("largest_bytes") or 0))
        except ConfigError:  # an estimate loaded from JSON: no step to read it from
            pass
        if str(shard).startswith("fsdp2"):
            out = max([out] + [b["weights"] for b in self._split])
        return out

    def model_state(self, start: int = 0, stop: Optional[int] = None, master_ratio: float = 1.0) -> Any:
        """:meth:`Costs.model_state`, with each estimator row's parameters as the tensors ZeRO
        partitions (a module's weight and bias as one: rank 0's share is not under-counted). With
        the model's FSDP2 units (``units``) and the whole model (``start=0``, no ``stop``), the
        units are those modules, the root the rest, and the tensors the model's own (FSDP2 pads
        each one's dim 0)."""
        base = super().model_state(start, stop, master_ratio)
        rows = [r for g in self._rows[start:stop] for r in g]
        if self.units is None or start != 0 or stop not in (None, len(self._rows)):
            return replace(base, tensor_bytes=tuple(int(round(r.param_bytes / master_ratio))
                                                    for r in rows if r.param_bytes))
        u = self.units
        tensors = list(u.tensors)
        scale = base.param_bytes / max(1, sum(t[1] for t in tensors))  # the model's dtype -> the state's
        first: Dict[int, int] = {}
        for i, r in enumerate(rows):
            k = u.unit_of(r.name.replace(" (own ops)", ""))
            if k >= 0 and r.param_bytes:
                first.setdefault(k, i)
        order = sorted(range(len(u.paths)), key=lambda k: (first.get(k, len(rows)), k))
        unit_bytes = [0] * len(u.paths)
        for _, nbytes, _, k, _ in tensors:
            if k >= 0:
                unit_bytes[k] += nbytes
        last = max(first.values(), default=-1)
        # rows named in parentheses hold parameters no module ran ("(unused parameters)"): not a layer
        head = sum(r.param_bytes for i, r in enumerate(rows) if i > last >= 0 and r.param_bytes
                   and not r.name.startswith("(") and u.unit_of(r.name.replace(" (own ops)", "")) < 0)
        units = tuple(int(round(unit_bytes[k] * scale)) for k in order)
        return replace(base, tensor_bytes=tuple(int(round(t[1] * scale)) for t in tensors),
                       tensor_rows=tuple(t[2] for t in tensors), unit_bytes=units,
                       root_bytes=max(0, base.param_bytes - sum(units)),
                       root_head_bytes=int(round(head / master_ratio)), units_text=u.describe())

    def kept_at_end(self, mb: int) -> Optional[int]:
        """The update's split (the step's peak within its update) less what the update makes: the
        output and loss the loop keeps, the batch and the workspaces."""
        update = self._phase(mb, "update")
        if update is None:
            return None
        return int(sum(v for k, v in update.items() if k in ("activations", "inputs", "workspaces")))

    def peak_parts(self, mb: int, accumulate: bool) -> Tuple[Dict[str, int], str, Optional[int]]:
        peak, parts = self.whole_peak(mb, accumulate)
        _, parts, phase = self._whole(mb, accumulate)
        return dict(parts), phase, int(self.est.activation_bytes(int(mb)))

    def _phase(self, mb: int, phase: str) -> Optional[Dict[str, int]]:
        """The step's peak within ``phase``, split (None where the estimate has no record)."""
        phases = self.est.phase_breakdown(int(mb)) if hasattr(self.est, "phase_breakdown") else {}
        return phases.get(phase)

    def backward_parts(self, mb: int) -> Optional[Dict[str, int]]:
        return self._phase(mb, "backward")

    def earlier_backward(self, mb: int) -> List[Dict[str, int]]:
        phases = self.est.phase_breakdown(int(mb)) if hasattr(self.est, "phase_breakdown") else {}
        return [dict(v) for k, v in sorted(phases.items()) if k.startswith(EARLIER_BACKWARD)]

    def forward_parts(self, mb: int) -> Optional[Dict[str, int]]:
        return self._phase(mb, "forward")


class LayerListCosts(Costs):
    """Costs from a ``LayerCost`` list measured or estimated at ``batch_size``: activations and
    outputs scale linearly with the micro-batch; a whole-model step (one stage) holds every
    layer's state and kept activations plus the transient of its largest layer."""

    def __init__(self, layers: Sequence[LayerCost], batch_size: int, *, precision: str = "float32",
                 framework: str = "torch", input_bytes: int = 0, persistent_bytes: int = 0,
                 gradient_fraction: float = 0.25) -> None:
        if batch_size < 1:
            raise ConfigError(f"layers were given for batch_size={batch_size}; give the batch (>= 1) they were "
                              "measured at")
        if not layers:
            raise ConfigError("fit needs at least one layer cost; pass layers=[LayerCost(...), ...] or model=")
        self.precision, self.framework = precision, framework
        self.block_names = [l.name for l in layers]
        self._state = [int(l.state_bytes) for l in layers]
        self._act_ps = [l.activation_bytes / batch_size for l in layers]
        self._out_ps = [l.output_bytes / batch_size for l in layers]
        self._bwd_ps = [l.backward_bytes / batch_size for l in layers]
        self._in_ps = input_bytes / batch_size
        self.persistent_bytes = int(persistent_bytes)
        # Without a per-part split, Adam's state (weights + grads + 2 slots) is assumed: grads a quarter.
        self._frac = float(gradient_fraction)

    def block_costs(self, mb: int) -> List[LayerCost]:
        return [LayerCost(name=n, state_bytes=s, activation_bytes=int(math.ceil(a * mb)),
                          output_bytes=int(math.ceil(o * mb)), backward_bytes=int(math.ceil(w * mb)))
                for n, s, a, o, w in zip(self.block_names, self._state, self._act_ps, self._out_ps, self._bwd_ps)]

    def block_state_split(self) -> List[Dict[str, int]]:
        out = []
        for s in self._state:
            g = int(s * self._frac)
            out.append({"weights": g, "gradients": g, "optimizer": s - 2 * g})
        return out

    def input_bytes(self, mb: int) -> int:
        return int(math.ceil(self._in_ps * mb))

    def transient_bytes(self, mb: int, start: int, stop: int) -> int:
        # the rule init(strategy="pipeline", layers=...) plans a stage with: one job, one answer
        return backward_transient(self.block_costs(mb), start, stop)

    def whole_peak(self, mb: int, accumulate: bool) -> Tuple[int, Dict[str, int]]:
        n = len(self._state)
        state = sum(self._state)
        act = int(math.ceil(sum(self._act_ps) * mb))
        trans = self.transient_bytes(mb, 0, n)
        inp = self.input_bytes(mb)
        parts = {"state": state, "activations": act, "transient": trans, "input": inp,
                 "persistent": self.persistent_bytes}
        return state + act + trans + inp + self.persistent_bytes, parts
