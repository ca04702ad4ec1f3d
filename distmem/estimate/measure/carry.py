"""From measured points to an estimate at any batch (the measured path's figures, sources and
bounds): measured where a point is, carried by the framework's rule elsewhere — refused, loudly,
where the rule's figure is outside what the measured points allow (``extrapolate.physical_interval``)
— the breakdown made to sum to the figure, the rows following the measured growth per sample."""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Dict, List, Tuple

from ...units import format_bytes
from ..table import SOURCES, Bound, Estimate, LayerEstimate, path_margin
from .extrapolate import RULE, extrapolate, least_squares, physical_interval, residual_terms

__all__ = ["with_measurement", "CARRY_RULE", "DISAGREEMENT", "MODEL_SHARE", "GUESS_AGREES", "GUESS_FLAT"]

#: The rule a framework carries its measured points with once it has three or more of them (chosen
#: on the fit half of its benchmark, docs/estimate.md); with fewer, :data:`extrapolate.RULE`.
CARRY_RULE = {"keras": "lsq", "torch": "blend"}

#: Carry rules that read no model: the measured peaks' own lines.
PRIOR_FREE = ("measured", "lsq")

#: Where the figure and the model's disagree by more than this factor either way, a warning names
#: both: the model does not see part of what this model does.
DISAGREEMENT = 2.0

#: Where the model's difference between the measured device and the target's is more than this
#: share of a figure, the figure counts as modelled, not measured.
MODEL_SHARE = 0.25

#: A model that ran its step on values it had to guess (``data_dependent``: a branch on ``.item()``,
#: Hugging Face's mask shortcuts) still carries the measured points where its growth between the two
#: largest is within this share of theirs either way, or within :data:`GUESS_FLAT` of the larger
#: point's bytes (points that barely grew, a step whose peak is its update there): the guess took
#: the path the measured step took. A step's growth is not one line (a language model's peak moves from the
#: update to the logits' backward as the batch grows: GPT-2 with checkpointing, bf16, on an H200,
#: 1.77 GB at batch 2 and 1.88 GB at 4, 2.62 GB at 8), so the points' own line alone was 19.9% under
#: at 8 where the model, agreeing to 3% between 2 and 4, carries them to +0.2%
#: (bench/results/estimate_measured_torch4_h200.jsonl, then estimate_measured_torch5_h100.jsonl); such a
#: figure is never below the points' line.
GUESS_AGREES = 0.25
GUESS_FLAT = 0.02


def _fw(framework: str) -> str:
    return "torch" if framework == "torch" else "keras"


def _same_device(a: str, b: str) -> bool:
    return (a == "cpu") == (str(b).lower() == "cpu")


class _Carry:
    """The figure at any batch from measured points (bytes), with its source and bound: measured
    where a point is, carried by the framework's rule elsewhere — refused, loudly, where the rule's
    figure is outside what the measured points allow (``extrapolate.physical_interval``)."""

    def __init__(self, target: Estimate, prior: Estimate, got: Dict[str, Any]):
        fw = _fw(target.framework)
        self.target, self.prior = target, prior
        self.points: List[Tuple[int, int]] = [(int(b), int(y)) for b, y in got["points"]]
        self.measured = dict(self.points)
        # a model that could not run the step (its state alone, ``model_ran`` False) carries nothing:
        # the measured points' own line; one that ran it on values it had to guess (``data_dependent``)
        # carries them only where its growth agrees with theirs (GUESS_AGREES, GUESS_FLAT), never below their line
        self.guessed = bool(getattr(prior, "data_dependent", False))
        self.trusted = bool(getattr(prior, "model_ran", True)) and (not self.guessed or self._agrees(prior))
        self.modelled = [(b, y, int(prior.train_bytes(b)) if self.trusted else 0) for b, y in self.points]
        self.rule = CARRY_RULE[fw] if len(self.points) >= 3 else RULE[fw]
        if not self.trusted and self.rule not in PRIOR_FREE:
            self.rule = "measured"
        # the three largest: the affine law holds best nearest the target (BFC regions at tiny batches)
        self.terms = residual_terms(self.modelled[-3:] if len(self.points) >= 3 else self.modelled, self.rule)
        self.moved = prior is not target
        self.on = str(got["device"])
        self.notes: Dict[int, str] = {}
        self._memo: Dict[int, Tuple[int, str, str]] = {}

    def _agrees(self, prior: Estimate) -> bool:
        """Whether ``prior``'s growth between the two largest measured points is within
        :data:`GUESS_AGREES` of the measured growth either way, or within :data:`GUESS_FLAT` of the
        larger point's bytes; False with fewer than two points."""
        pts = sorted(self.points)[-2:]
        if len(pts) < 2 or pts[0][0] == pts[1][0]:
            return False
        (b1, y1), (b2, y2) = pts
        grew = y2 - y1
        modelled = int(prior.train_bytes(b2)) - int(prior.train_bytes(b1))
        return abs(modelled - grew) <= max(GUESS_AGREES * abs(grew), GUESS_FLAT * abs(y2))

    def _line(self, batch: int, lo: float, hi: float) -> int:
        """The least-squares line through the three largest measured points at ``batch``, inside ``[lo, hi]``."""
        alpha, beta = least_squares(self.points[-3:])
        return int(min(max(int(round(alpha + beta * batch)), lo), hi))

    def _move(self, batch: int) -> int:
        """What the model says the target device adds over the measured one (bytes)."""
        if self.prior is self.target:
            return 0
        return int(self.target.train_bytes(batch)) - int(self.prior.train_bytes(batch))

    def at(self, batch: int) -> Tuple[int, str, str]:
        """``(bytes, source, note)`` at ``batch``."""
        if batch in self._memo:
            return self._memo[batch]
        floor = self.target.state_floor
        note = ""
        if batch in self.measured:
            value, source = self.measured[batch], "measured"
        else:
            source = "carried"
            value = extrapolate(self.terms, int(self.prior.train_bytes(batch)) if self.trusted else 0, batch)
            lo, hi = physical_interval(self.points, batch, self.prior.state_floor)
            if not lo <= value <= hi:
                line = self._line(batch, lo, hi)
                pts = ", ".join(f"{format_bytes(y)} at batch {b}" for b, y in self.points)
                note = (f"the '{self.rule}' carry to batch {batch} gives {format_bytes(max(value, 0))}, outside "
                        f"what the measured peaks allow ({pts}: {format_bytes(lo)} .. {format_bytes(hi)}); refused, "
                        f"the measured peaks' own line gives {format_bytes(line)}")
                value = line
            elif self.guessed and self.trusted:
                # the model guessed values the step reads: its carry, never below the points' own line
                value = max(value, self._line(batch, lo, hi))
        if self.moved:
            move = self._move(batch)
            value += move
            if abs(move) > MODEL_SHARE * max(value, 1):
                # what the measured device could not show (buffers below its allocator's floor, another
                # device's kernels) is most of the figure: it is the model's
                source = "modelled"
        value = max(int(value), floor)
        self._memo[batch] = (value, source, note)
        return self._memo[batch]

    def bound(self, batch: int) -> Bound:
        value, source, note = self.at(batch)
        extra = f"measured on {self.on}" + ("; the target device's difference modelled" if self.moved else "")
        if note:
            extra += "; the rule's carry was refused"
        return Bound.around(value, path_margin(self.target.framework, source), source, self.target.state_floor,
                            extra)


def with_measurement(target: Estimate, prior: Estimate, got: Dict[str, Any]) -> Estimate:
    """``target`` (the model at the job's device) with the measured points ``got`` as its figures:
    measured where a point is, carried elsewhere (:class:`_Carry`), each with its bound; peaks,
    breakdowns and rows. ``prior``: the model at the measured device (``target`` itself there).
    Where the model could not run the step (``model_ran`` False: a torch model the meta device
    cannot run, a Keras model without a layer graph), or guessed values the step reads
    (``data_dependent``) and grew otherwise than the measured points (:data:`GUESS_AGREES`,
    :data:`GUESS_FLAT`), the
    measured points' own line (rule ``measured``, or ``lsq`` from three)."""
    carry = _Carry(target, prior, got)
    b0 = target.batch_size

    def peak_fn(batch: int, train: bool) -> Dict[str, Any]:
        detail = target.peak_detail(batch) if train else {"peak": target.inference_bytes(batch)}
        if train:
            detail["modelled_peak"] = int(detail["peak"])
            value, source, _ = carry.at(batch)
            detail["peak"], detail["source"] = value, source
        return detail

    def parts_fn(batch: int) -> Dict[str, int]:
        return _parts(target.breakdown(batch), carry.at(batch)[0])

    value, source, note = carry.at(b0)
    modelled = int(target.train_bytes(b0))
    warns = list(target.warnings)
    if note:
        warns.append(note)
        warnings.warn(f"distmem.estimate: {note}", stacklevel=4)
    if carry.trusted and modelled and not 1 / DISAGREEMENT <= value / modelled <= DISAGREEMENT:
        warns.append(f"the figure at batch {b0} ({SOURCES[source]}, {format_bytes(value)}) is "
                     f"{value / modelled:.2f}x the model's ({format_bytes(modelled)}): the model does not see part of "
                     f"what this model does; the figure is the {source} one")
    ratio = _slope_ratio(carry, target, b0)
    measurement = dict(got, rule=carry.rule, terms=carry.terms, at_target=b0 in carry.measured,
                       modelled=[[b, m] for b, _, m in carry.modelled], measured_on=got["device"],
                       prior=("the model (it guessed values the step reads and grew as the measured points did; "
                              "the figure is never below their own line)" if carry.trusted and carry.guessed else
                              "the model" if carry.trusted else getattr(prior, "why_not_modelled", "") or
                              "none: the model read values it does not have, and grew otherwise than the "
                              "measured points"))
    if note:
        measurement["refused"] = note
    est = Estimate(framework=target.framework, model=target.model, batch_size=b0,
                   precision=target.precision, optimizer=target.optimizer,
                   layers=_rows(target.layers, ratio), method="measured", device=target.device,
                   input_bytes_per_sample=target.input_bytes_per_sample, warnings=warns,
                   extra_persistent_bytes=target.extra_persistent_bytes + _fixed_excess(carry, target, b0),
                   _peak_fn=peak_fn, _parts_fn=parts_fn, _bound_fn=carry.bound)
    est.measurement = measurement
    return est



#: Parts of a modelled breakdown that do not grow with the batch and are exact (a measurement below
#: the model's figure takes its difference from the others).
_STATE_PARTS = ("weights", "optimizer state", "workspaces")


def _parts(parts: Dict[str, int], value: int) -> Dict[str, int]:
    """The model's breakdown made to sum to the measured ``value``: what the model missed as its own
    part ``measured, not modelled``; what it over-counted taken from the parts that grow with the
    batch, in proportion (never below zero, never from weights or optimizer state)."""
    parts = {k: int(v) for k, v in parts.items()}
    excess = value - sum(parts.values())
    if excess >= 0:
        parts["measured, not modelled"] = excess
        return parts
    movable = {k: v for k, v in parts.items() if k not in _STATE_PARTS and v > 0}
    total = sum(movable.values())
    cut = min(-excess, total)
    for k, v in movable.items():
        parts[k] = v - int(cut * v / total) if total else v
    short = sum(parts.values()) - value
    for k in sorted(movable, key=lambda k: -parts[k]):
        take = min(short, parts[k])
        parts[k] -= take
        short -= take
    if short > 0:  # the figure is at the state floor and the modelled state parts exceed it
        parts["measured, not modelled"] = -short
    return parts


def _slope_ratio(carry: _Carry, target: Estimate, b0: int) -> float:
    """The figure's growth per sample over the model's, near the estimate's batch (1 where either is
    flat or they disagree beyond a factor 4: then the model's rows are kept as they are)."""
    lo = max(1, b0 // 2) if b0 > 1 else 2
    hi = b0 if b0 > 1 else 4
    if hi == lo:
        return 1.0
    dv = carry.at(hi)[0] - carry.at(lo)[0]
    dm = int(target.train_bytes(hi)) - int(target.train_bytes(lo))
    if dv <= 0 or dm <= 0:
        return 1.0
    r = dv / dm
    return r if 0.25 <= r <= 4.0 else 1.0


def _fixed_excess(carry: _Carry, target: Estimate, b0: int) -> int:
    """The part of the figure's excess over the model that does not grow with the batch (bytes, >= 0):
    kept for the process like a workspace."""
    lo = max(1, b0 // 2)
    if lo == b0:
        return max(0, carry.at(b0)[0] - int(target.train_bytes(b0)))
    r_lo = carry.at(lo)[0] - int(target.train_bytes(lo))
    r_hi = carry.at(b0)[0] - int(target.train_bytes(b0))
    slope = (r_hi - r_lo) / (b0 - lo)
    return max(0, int(round(r_lo - slope * lo)))


def _rows(rows: List[LayerEstimate], ratio: float) -> List[LayerEstimate]:
    """Table rows with kept activations per sample scaled by the figure's growth per sample over the
    model's, so stage sums follow the measured slope."""
    if ratio == 1.0:
        return list(rows)
    return [replace(r, activation_bytes_per_sample=max(0, int(round(r.activation_bytes_per_sample * ratio))),
                    activation_fixed_bytes=r.activation_fixed_bytes) for r in rows]
