"""``find_batch_size``: the largest batch that fits on every rank, found by all ranks together.

Each probe runs ``trial(batch_size)`` on every rank and ends with the guard's flag all-reduce, so a
probe that runs out of memory on any rank counts as a failure everywhere. The search is a function of
those shared verdicts only, so every rank walks the same sequence and returns the same number (checked
once more at the end: the minimum over ranks must equal the maximum).

    descend:  start, start/2, ...            until one fits (a failure at ``lower`` raises)
    ascend:   (only when ``upper`` is given and ``start`` fit) double up to ``upper``
    bisect:   between the largest fit and the smallest failure, to ``granularity``
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from ..comm import Comm
from ..errors import ConfigError, DistmemError
from ..units import plural
from .errors import BatchSizeFloorError
from .flags import FlagReducer, Status
from .protocol import Agreement, attempt, free_memory, say, summarise

__all__ = ["find_batch_size"]


def _round_down(b: int, granularity: int, lower: int) -> int:
    return max(lower, (b // granularity) * granularity)


def _check_arguments(start: int, lower: int, upper: Optional[int], search: str, granularity: int) -> None:
    if search not in ("bisect", "halve"):
        raise ConfigError(f"search={search!r} is not 'bisect' or 'halve'")
    for name, v in (("start", start), ("lower", lower), ("granularity", granularity)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    if lower > start:
        raise ConfigError(f"lower={lower} is above start={start}; start at or above the lower bound")
    if upper is not None and (not isinstance(upper, int) or upper < start):
        raise ConfigError(f"upper={upper!r} must be an integer >= start={start}")


def _search(probe: Callable[[int], bool], start: int, lower: int, upper: Optional[int], search: str,
            granularity: int, tried: List[Tuple[int, bool]], last_failure: dict) -> int:
    """Halve from ``start`` to the first size that fits (the floor raises), double up to ``upper``
    when ``start`` fits, then bisect the gap to the smallest failure down to ``granularity``."""
    fit: Optional[int] = None
    fail: Optional[int] = None
    b = start
    while True:
        if probe(b):
            fit = b
            break
        fail = b
        if b <= lower:
            seq = ", ".join(str(s) for s, _ in tried)
            raise BatchSizeFloorError(
                f"find_batch_size: even the lower bound, batch {lower}, runs out of memory on "
                f"{plural(len(last_failure['ranks']), 'rank', bare=True)} {last_failure['ranks']} ({summarise(last_failure['ranks'], last_failure['descs'])}); tried {seq}. "
                "Lower lower=, shrink the model or inputs, enable activation checkpointing or mixed precision, or "
                "spread the model over more devices", last_failure["ranks"], last_failure["descs"])
        b = _round_down(b // 2, granularity, lower) if b // 2 >= lower else lower
    if fail is None and upper is not None:
        while fit < upper:
            b = min(upper, fit * 2)
            if probe(b):
                fit = b
            else:
                fail = b
                break
    if search == "bisect" and fail is not None:
        while True:
            mid = _round_down((fit + fail) // 2, granularity, lower)
            if mid <= fit or mid >= fail:
                break
            if probe(mid):
                fit = mid
            else:
                fail = mid
    return int(fit)


def find_batch_size(trial: Callable[[int], Any], start: int, *, lower: int = 1, upper: Optional[int] = None,
                    search: str = "bisect", granularity: int = 1, comm: Optional[Comm] = None,
                    timeout: Optional[float] = None, flags: Optional[FlagReducer] = None,
                    on_oom: Optional[Callable[[], None]] = None, verbose: bool = True) -> int:
    """Collective: the largest batch size in ``[lower, upper]`` for which ``trial`` fits on every rank.

    trial: ``trial(batch_size)`` runs one representative step on this rank (forward, backward, and an
        optimizer step if its state counts) and enters no collective: ranks may disagree mid-probe.
    start: the first size tried. ``search="halve"`` stops at the first size that fits; ``"bisect"``
        (default) then narrows the gap to the smallest failure down to ``granularity`` (e.g. 8).
    lower: the smallest acceptable size; if it fails on any rank, every rank raises BatchSizeFloorError.
    upper: when given and ``start`` fits, sizes double up to it before bisecting.
    A non-OOM error in ``trial`` propagates: unchanged on its rank, as PeerError on the others.
    Returns the same int on every rank.
    """
    _check_arguments(start, lower, upper, search, granularity)
    agreement = Agreement(comm, timeout, flags)
    rank = agreement.rank
    args = (start, lower, upper, search, granularity)
    if agreement.size > 1:
        seen = agreement.comm.allgather(args, agreement.timeout)
        if any(tuple(s) != args for s in seen):
            raise ConfigError("find_batch_size() got different arguments on different ranks (start, lower, upper, "
                              "search, granularity): " + ", ".join(f"rank {r}: {tuple(s)}" for r, s in enumerate(seen))
                              + "; pass the same values everywhere")
    tried: List[Tuple[int, bool]] = []

    def probe(b: int) -> bool:
        where = f"find_batch_size probe {len(tried)} (batch {b})"
        status, _, own, desc, _ = attempt(lambda: trial(b), [False])
        verdict = agreement.verdict(status, where)
        ok = verdict.ok
        if not ok:
            descs = agreement.descriptions(desc, where)
            agreement.raise_if_failed(verdict, status, own, descs, where)
            if on_oom is not None:
                on_oom()
            free_memory(full=status == Status.OOM)
            if verbose and rank == 0:
                say(rank, f"find_batch_size: batch {b} runs out of memory on {plural(len(verdict.oom), 'rank', bare=True)} {verdict.oom} "
                          f"({summarise(verdict.oom, descs, 1)})")
            last_failure["descs"], last_failure["ranks"] = descs, verdict.oom
        tried.append((b, ok))
        return ok

    last_failure: dict = {"descs": {}, "ranks": []}
    fit = _search(probe, start, lower, upper, search, granularity, tried, last_failure)
    lo, hi = (agreement.comm.allreduce([fit], "min", agreement.timeout)[0],
              agreement.comm.allreduce([fit], "max", agreement.timeout)[0]) if agreement.size > 1 else (fit, fit)
    if lo != hi:  # cannot happen when every rank passed the same arguments; kept as a tripwire
        raise DistmemError(f"find_batch_size: ranks settled on different sizes (min {lo:g}, max {hi:g}); this is "
                           "a distmem bug, please report it with the log of every rank")
    if verbose and rank == 0:
        say(rank, f"find_batch_size: {fit} fits on every rank (probes: "
                  + ", ".join(f"{s}{'' if ok else ' OOM'}" for s, ok in tried) + ")")
    return int(fit)
