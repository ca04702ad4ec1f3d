"""From real training steps at small batches to the target batch, with the model as the prior. Pure.

A measurement gives the allocator peak ``y(b)`` at a few small batches ``b``; the model (Keras:
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
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

__all__ = ["RULES", "RULE", "residual_terms", "extrapolate", "measure_batches", "held_out_errors"]

RULES = ("offset", "linear", "ratio", "scale", "blend", "measured", "model")

#: The rule each framework's measured path uses (chosen on held-out halves of its zoo; see the
#: module docstring and docs/estimate.md).
RULE = {"keras": "scale", "torch": "blend"}


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
