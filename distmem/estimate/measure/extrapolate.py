"""Which batches a measurement runs, and how its peaks are carried to other batches. Pure.

**Which batches** (:class:`Ladder`): the target batch itself where its step fits the memory at hand,
with two smaller ones beside it (a quarter and a half) so that other batches can be carried from
three points; where the target does not fit, the three largest that do. The fixed pair of
:func:`measure_batches` (a quarter and a half of the target) is the older plan, which torch keeps.

**What a carried figure may be** (:func:`physical_interval`): a step's peak is its state plus what
grows with the batch, so between two batches ``b < B`` it grows, and by at most ``B / b``. A carry
outside that interval of every measured point (a ratio of 10^6 from a model that counted nothing at
the small batches, a figure below what was measured at a smaller batch) is refused by the caller
and the measured points' own line, clipped to the interval, is used instead.

**How** a measurement gives the allocator peak ``y(b)`` at a few batches ``b``; the model (Keras:
the analytic replay, torch: the meta-device simulation) gives ``m(b)`` at any batch. What the
model misses at the small batches, ``r(b) = y(b) - m(b)``, is carried to the target batch ``B`` by
one of the rules below; which one is decided by held-out figures (``bench/estimate/estimate_heldout.py``:
chosen on one half of each zoo, reported on the other, then the halves swapped), per framework,
in :data:`RULE`.

* ``offset``: the mean residual, a fixed number of bytes: ``m(B) + mean(r)``.
* ``linear``: the residual as ``alpha + beta x b`` through the two smallest-error points, so a
  per-sample part the model misses grows with the batch: ``m(B) + alpha + beta x B``.
* ``ratio``: the residual as a share of the model: ``m(B) x mean(y / m)``.
* ``scale``: the model scaled by what it missed at the largest measured batch: ``m(B) x y(b2) / m(b2)``.
* ``blend``: the mean of ``offset`` and ``linear`` (half the per-sample part extrapolated).
* ``measured``: no prior, the measured peaks' own line: ``y(b2) + (y(b2) - y(b1)) / (b2 - b1) x (B - b2)``.
* ``model``: the prior alone (what the model says, the measurement ignored).
* ``lsq``: no prior, the least-squares line through every measured peak: ``alpha + beta x B``.
* ``lsq_offset``: the model plus the least-squares line through every residual.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["RULES", "RULE", "residual_terms", "extrapolate", "measure_batches", "held_out_errors", "Ladder",
           "physical_interval", "least_squares", "CARRY_TOLERANCE", "LADDER_SAFETY"]

RULES = ("offset", "linear", "ratio", "scale", "blend", "measured", "model", "lsq", "lsq_offset")

#: The rule each framework's measured path carries with (chosen on the fit half of its benchmark;
#: see the module docstring and docs/estimate.md).
RULE = {"keras": "scale", "torch": "blend"}

#: How far a step's peak may stray from the affine law between two measured batches before a carry
#: is refused: TensorFlow's executor moves one step's peak by up to ~12% from run to run, and a
#: BFC region that doubles adds its own step.
CARRY_TOLERANCE = 0.25

#: What the ladder adds to a predicted peak before it runs a batch (the memory at hand is already a
#: share of what is free: half the host's available memory, 90% of a GPU's free memory).
LADDER_SAFETY = 0.10


def measure_batches(batch_size: int) -> Tuple[int, ...]:
    """The small batches a measurement runs: a quarter and a half of the target (at least 1 and 2,
    at most 32 and 64), so each costs a fraction of a full step while the largest activations
    already dominate as at the target."""
    b = int(batch_size)
    lo = max(1, min(32, b // 4))
    hi = max(lo + 1, min(64, b // 2))
    return (lo, hi)


def residual_terms(points: Sequence[Tuple[int, int, int]], rule: str) -> Dict[str, float]:
    """The rule's terms from ``points`` = ``[(batch, measured, modelled), ...]`` (bytes):
    ``{"fixed": bytes, "per_sample": bytes per sample, "ratio": factor}``; the residual at batch
    ``b`` is ``fixed + per_sample x b + (ratio - 1) x m(b)``."""
    if rule not in RULES:
        raise ValueError(f"unknown extrapolation rule {rule!r}; one of {RULES}")
    pts = sorted((int(b), int(y), int(m)) for b, y, m in points)
    if not pts:
        return {"fixed": 0.0, "per_sample": 0.0, "ratio": 1.0}
    res = [y - m for _, y, m in pts]
    if rule == "model":
        return {"fixed": 0.0, "per_sample": 0.0, "ratio": 1.0}
    if rule == "offset" or len(pts) < 2:
        return {"fixed": sum(res) / len(res), "per_sample": 0.0, "ratio": 1.0}
    if rule == "ratio":
        return {"fixed": 0.0, "per_sample": 0.0, "ratio": sum(y / max(m, 1) for _, y, m in pts) / len(pts)}
    if rule in ("lsq", "lsq_offset"):
        alpha, beta = least_squares([(b, y - (0 if rule == "lsq" else m)) for b, y, m in pts])
        return {"fixed": alpha, "per_sample": beta, "ratio": 0.0 if rule == "lsq" else 1.0}
    (b1, y1, m1), (b2, y2, m2) = pts[0], pts[-1]
    if rule == "scale":
        return {"fixed": 0.0, "per_sample": 0.0, "ratio": y2 / max(m2, 1)}
    if rule == "blend":
        off, lin = residual_terms(points, "offset"), residual_terms(points, "linear")
        return {"fixed": (off["fixed"] + lin["fixed"]) / 2, "per_sample": lin["per_sample"] / 2, "ratio": 1.0}
    if rule == "linear":
        beta = ((y2 - m2) - (y1 - m1)) / (b2 - b1)
        return {"fixed": (y1 - m1) - beta * b1, "per_sample": beta, "ratio": 1.0}
    # measured: the peaks' own line; as a residual against the model that is
    # y2 + s (b - b2) - m(b), i.e. the model removed again by a ratio of 0
    slope = (y2 - y1) / (b2 - b1)
    return {"fixed": y2 - slope * b2, "per_sample": slope, "ratio": 0.0}


def extrapolate(terms: Dict[str, float], modelled: int, batch: int) -> int:
    """The estimate at ``batch`` whose modelled peak is ``modelled`` (bytes)."""
    value = terms["ratio"] * modelled + terms["fixed"] + terms["per_sample"] * batch
    return int(round(value))


def held_out_errors(cases: List[Dict[str, float]], rule: str) -> List[float]:
    """Relative errors of ``rule`` on ``cases`` (each with ``points``, ``modelled`` at the target,
    ``batch``, ``reference``): what the held-out protocol scores."""
    out = []
    for c in cases:
        est = extrapolate(residual_terms(c["points"], rule), c["modelled"], c["batch"])
        out.append(est / c["reference"] - 1.0)
    return out


def least_squares(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """``(alpha, beta)`` of the least-squares line ``alpha + beta x b`` through ``(b, y)`` points
    (one point: the line through it and the origin's level, slope 0)."""
    pts = [(float(b), float(y)) for b, y in points]
    if len(pts) == 1 or len({b for b, _ in pts}) == 1:
        return sum(y for _, y in pts) / len(pts), 0.0
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    my = sum(y for _, y in pts) / n
    beta = sum((b - mb) * (y - my) for b, y in pts) / sum((b - mb) ** 2 for b, _ in pts)
    return my - beta * mb, beta


def physical_interval(points: Sequence[Tuple[int, int]], batch: int, floor: int = 0,
                      tolerance: float = CARRY_TOLERANCE) -> Tuple[int, int]:
    """The bytes a step's peak at ``batch`` can have, given peaks ``(b, y)`` measured at other
    batches and ``floor`` (the weights and optimizer state it holds whatever the batch): a peak is
    ``state + per-sample x b`` with both parts >= 0, so from a point at ``b < batch`` it is at least
    ``y`` and at most ``y x batch / b``, and from one at ``b > batch`` at most ``y`` and at least
    ``y x batch / b`` (and ``floor``); ``tolerance`` widens each side for the executor's run-to-run
    spread. ``(lo, hi)``, bytes; ``hi`` is never below ``lo``."""
    lo, hi = float(floor), math.inf
    for b, y in points:
        b, y = int(b), int(y)
        if b <= 0 or y <= 0:
            continue
        if b < batch:
            lo = max(lo, y * (1 - tolerance))
            hi = min(hi, y * batch / b * (1 + tolerance))
        elif b > batch:
            hi = min(hi, y * (1 + tolerance))
            lo = max(lo, y * batch / b * (1 - tolerance))
        else:
            lo = max(lo, y * (1 - tolerance))
            hi = min(hi, y * (1 + tolerance))
    if hi == math.inf:
        hi = max(lo, float(floor)) * 1e6 + 1
    return int(lo), int(max(lo, hi))


class Ladder:
    """The batches one measurement runs, in the order it runs them (pure; the caller runs the steps).

    Where the model's high figure for the target batch fits ``memory_bytes``: the target first, then
    a quarter and a half of it (the target runs first, as in a fresh process: TensorFlow's BFC
    allocator left fragmented by smaller batches reads up to ~15% higher at a later one). Elsewhere
    it climbs: ``top`` = the largest ``target / 2**k`` the model's figure allows, then ``top / 4``,
    ``top / 2``, ``top`` smallest first, then doubling while the peaks measured so far predict the
    next fits (their least-squares line with :data:`LADDER_SAFETY` added; from one point, the
    model's growth, at most ``y x b / b1``), the target itself included. A batch predicted not to fit, or that
    ran out of memory (:meth:`failed`), ends the climb, and smaller batches are added below until
    ``points`` were measured or batch 1 was. ``predict_high(b)``: the model's high figure, used until
    something is measured.
    """

    def __init__(self, target: int, memory_bytes: int, predict_high: Callable[[int], int], points: int = 3):
        self.target = max(1, int(target))
        self.memory = int(memory_bytes)
        self.points = max(1, int(points))
        self.peaks: Dict[int, int] = {}
        self.refused: Dict[int, str] = {}
        self._prior = predict_high
        #: where ``memory_bytes`` comes from, in words
        self.memory_source = ""
        top = self.target
        while top > 1 and int(predict_high(top)) > self.memory:
            self.refused[top] = f"the model's high figure {int(predict_high(top)):,} B exceeds the {self.memory:,} B at hand"
            top //= 2
        self.climbing = top < self.target
        self.todo: List[int] = sorted({max(1, top // 4), max(1, top // 2), top})
        if not self.climbing:
            self.todo = [top] + self.todo[:-1]

    def predict(self, batch: int) -> int:
        """The high figure expected at ``batch`` from what was measured (the model's before)."""
        pts = sorted(self.peaks.items())
        if not pts:
            return int(self._prior(batch))
        if len(pts) == 1:
            # the model's growth from the measured batch, within what one point allows (y x b / b1)
            b, y = pts[0]
            grow = self._prior(batch) / max(1, self._prior(b)) if self._prior(b) else batch / b
            return int(y * max(1.0, min(batch / b, grow)) * (1 + LADDER_SAFETY))
        alpha, beta = least_squares(pts[-3:])
        return int(max(alpha + beta * batch, max(y for _, y in pts)) * (1 + LADDER_SAFETY))

    def next(self) -> Optional[int]:
        """The next batch to run, or None when the measurement is complete."""
        while True:
            if not self.todo and self.climbing and self.peaks:
                b = min(2 * max(self.peaks), self.target)
                if b in self.peaks or b <= max(self.peaks):
                    return None
                self.todo = [b]
            if not self.todo:
                return None
            b = self.todo[0]
            if self.peaks and self.predict(b) > self.memory:
                self.refused[b] = (f"predicted {self.predict(b):,} B from the peaks measured, over the "
                                   f"{self.memory:,} B at hand")
                self._stop_climbing()
                continue
            self.refused.pop(b, None)
            return b

    def record(self, batch: int, peak: int) -> None:
        self.peaks[int(batch)] = int(peak)
        if self.todo and self.todo[0] == int(batch):
            self.todo.pop(0)

    def failed(self, batch: int, why: str) -> None:
        """``batch`` ran out of memory (or could not run): measure below it instead."""
        self.refused[int(batch)] = why
        self._stop_climbing()

    def _stop_climbing(self) -> None:
        self.climbing = False
        self.todo = []
        low = min(list(self.peaks) + [b for b in self.refused if b not in self.peaks] + [self.target])
        b = low // 2
        while len(self.peaks) + len(self.todo) < self.points and b >= 1:
            if b not in self.peaks:
                self.todo.append(b)
            b //= 2
        self.todo.sort()

    def summary(self) -> Dict[str, object]:
        return {"target": self.target, "memory_bytes": self.memory, "memory_source": self.memory_source,
                "measured": sorted(self.peaks), "not_run": {str(b): w for b, w in sorted(self.refused.items())}}
