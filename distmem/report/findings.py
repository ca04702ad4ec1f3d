"""Every warning rule of a report, written once: thresholds, the sentence, the remedy.

Both report paths use these builders: the full report (``aggregate``, a row per rank) and the
summary report (``summary``, all-reduced figures). Each builder takes the figures the rule needs
and returns a finding - ``kind``, ``ranks``, ``message`` and the figures - so the same situation
reads the same on both paths. Where a summary cannot know a detail (the list of every rank
concerned, the pids on a GPU), the sentence leaves that part out and says where to find it.

Kinds:

``missing``            ranks that did not report within the timeout
``plan_mismatch``      ranks that computed different plans
``above_plan``         a rank's allocator peak (or reserved pool, if larger) above its planned bytes
``near_limit``         the same above ``WARN_NEAR_LIMIT`` of its planned bytes (and above the demand the
                       limit was made from, where it was: :func:`near_threshold`)
``shared_gpu``         more job ranks on a GPU than the plan put there (the every-rank-on-GPU-0 mistake)
``foreign_process``    processes outside the job on a GPU the job uses
``imbalance``          peaks of ranks with the same role (pipeline stage, or all ranks) far apart
``outside_allocator``  NVML usage minus allocator pool above the per-process overhead the plan assumed
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence

from ..units import MiB, format_bytes, plural

__all__ = ["WARN_NEAR_LIMIT", "WARN_IMBALANCE", "WARN_IMBALANCE_MIN_BYTES", "GROUP_ABOVE", "WARNING_KINDS",
           "Findings", "ranks_text", "usage_phrase", "missing", "missing_summary", "plan_mismatch", "above_plan",
           "near_limit", "near_threshold", "shared_gpu", "shared_gpu_summary", "foreign_process", "foreign_process_summary",
           "imbalance", "outside_allocator", "suggested_overhead", "PIN_REMEDY"]

#: A rank whose peak passes this share of its limit is warned about: the next larger batch or
#: fragmentation spike will run it out of memory.
WARN_NEAR_LIMIT = 0.90
#: Ranks with the same role whose peaks differ by more than this ratio (max / mean) are flagged.
WARN_IMBALANCE = 1.25
#: ... but only when the largest peak also exceeds the mean by this many bytes: a 2x spread of a
#: few MiB (CPU runs, tiny models) is noise, not a problem an operator can act on.
WARN_IMBALANCE_MIN_BYTES = 64 * MiB
#: Above this many ranks of one kind, a warning is one sentence naming the worst rank and a count,
#: not one sentence per rank (the findings still list every rank).
GROUP_ABOVE = 4



def near_threshold(limit: float, demand: Optional[float] = None, near: float = WARN_NEAR_LIMIT) -> float:
    """The usage above which a rank is near its limit (bytes): ``near`` of the limit; where the limit
    was made from the rank's own demand plus headroom (pipeline stages, model groups, sharded and
    auto layouts, a plan from a report), not before the usage passes that demand too. Up to its
    demand the rank runs as its plan computed, and the headroom above it is the room the plan left
    for the allocator's cache and a fragmentation spike on purpose: a rank that stays out of it is
    not a warning (a limit 10% over an exact demand sits at 91%)."""
    threshold = near * limit
    if demand and 0 < demand < limit:
        threshold = max(threshold, demand)
    return threshold


WARNING_KINDS = ("missing", "plan_mismatch", "above_plan", "near_limit", "shared_gpu", "foreign_process",
                 "imbalance", "outside_allocator")

PIN_REMEDY = ("pin each rank to its own device before its framework starts (call distmem.init() first, before "
              "any GPU op; never hard-code cuda:0 or /GPU:0). Usual causes of a stray context: CUDA started before "
              "init() - torch.load without map_location, a DataLoader pin_memory thread before the device was set, "
              "JAX/XLA preallocating every visible GPU, TensorFlow touched before init()")
FOREIGN_REMEDY = "they take memory the plan counted as free"
SAME_OPTIONS = "pass the same options (and DISTMEM_FLEET) on every rank"

Finding = Dict[str, Any]


def ranks_text(ranks: Sequence[int], limit: int = 12) -> str:
    ranks = sorted(ranks)
    text = ", ".join(map(str, ranks[:limit]))
    return text + (f", ... ({len(ranks)} ranks)" if len(ranks) > limit else "")


def usage_phrase(used: Optional[float], peak: Optional[float], reserved: Optional[float]) -> str:
    """How a rank's usage reads: ``peaked at X``, or its reserved pool when that is what counted."""
    if reserved is not None and used == reserved and peak is not None and peak < used:
        return f"holds {format_bytes(used)} in its allocator (reserved; peak allocated {format_bytes(peak)})"
    return f"peaked at {format_bytes(used)}"


def _finding(kind: str, ranks: Iterable[Optional[int]], message: str, **values: Any) -> Finding:
    return dict(kind=kind, ranks=sorted({r for r in ranks if r is not None}), message=message, **values)


class Findings:
    """Collects findings; ``sentences`` are their messages, in order."""

    def __init__(self) -> None:
        self.items: List[Finding] = []

    def add(self, finding: Finding) -> None:
        self.items.append(finding)

    @property
    def sentences(self) -> List[str]:
        return [f["message"] for f in self.items]


def missing(ranks: Sequence[int]) -> Finding:
    return _finding("missing", ranks, f"{plural(len(list(ranks)), 'rank', bare=True)} {ranks_text(list(ranks))} did not report within the timeout "
                    "(crashed, hung, or never called distmem.report()); their rows are missing", count=len(ranks))


def missing_summary(timeout: float, size: int) -> Finding:
    msg = (f"the summary all-reduce did not complete within {timeout:.1f} s: at least one of {size} ranks "
           "never entered distmem.report() (crashed, hung, or took another code path); a summary cannot name "
           "it: call distmem.report(detail='full') to list missing ranks. Until that rank arrives, later "
           "collectives of distmem on this job may pair up out of step")
    return _finding("missing", [], msg)


def plan_mismatch(groups: Optional[Dict[str, List[int]]] = None, pair: Sequence[Optional[int]] = ()) -> Finding:
    """``groups``: fingerprint -> ranks (full report); ``pair``: two ranks known to differ (summary)."""
    if groups is not None:
        ranks = [r for rs in groups.values() for r in rs]
        return _finding("plan_mismatch", ranks, "ranks computed different plans: "
                        + "; ".join(f"{fp}: ranks {ranks_text(rs)}" for fp, rs in groups.items())
                        + f" - {SAME_OPTIONS}", fingerprints=groups)
    a, b = (list(pair) + [None, None])[:2]
    return _finding("plan_mismatch", [a, b], f"ranks computed different plans (at least rank {a} and rank {b} "
                    f"differ) - {SAME_OPTIONS}; detail='full' lists every rank's plan")


def _listed(ranks: Optional[Sequence[int]]) -> str:
    return f" (ranks {ranks_text(ranks)})" if ranks else ""


def above_plan(rank: int, used: float, limit: float, ratio: float, *, peak: Optional[float] = None,
               reserved: Optional[float] = None, enforced: bool = True, count: int = 1,
               ranks: Optional[Sequence[int]] = None, **values: Any) -> Finding:
    """The worst rank above its plan; ``count`` > 1 makes it one sentence for ``count`` ranks."""
    usage = usage_phrase(used, peak, reserved)
    if count <= 1:
        msg = (f"rank {rank} {usage}, above its plan of {format_bytes(limit)} ({ratio:.0%})"
               + ("" if enforced else "; it is not hard-limited, so a neighbour may run out")
               + "; give it a larger share (fewer ranks per GPU, limit=) or lower its batch size")
    else:
        msg = (f"{count} ranks went above their plan{_listed(ranks)}; the worst, rank {rank}, {usage} = {ratio:.0%} of "
               f"{format_bytes(limit)}; give them a larger share or lower the batch size")
    return _finding("above_plan", ranks or [rank], msg, peak_bytes=peak, reserved_bytes=reserved, used_bytes=used,
                    limit_bytes=limit, ratio=ratio, count=count, worst_rank=rank, **values)


def near_limit(rank: int, used: float, limit: float, ratio: float, *, near: float = WARN_NEAR_LIMIT,
               peak: Optional[float] = None, reserved: Optional[float] = None, count: int = 1,
               ranks: Optional[Sequence[int]] = None, **values: Any) -> Finding:
    usage = usage_phrase(used, peak, reserved)
    if count <= 1:
        msg = (f"rank {rank} {usage} = {ratio:.0%} of its limit {format_bytes(limit)} (warning above {near:.0%}); "
               "a larger batch or a fragmentation spike will run out of memory")
    else:
        msg = (f"{count} ranks went above {near:.0%} of their limit{_listed(ranks)}; the highest, rank {rank}, {usage} = "
               f"{ratio:.0%} of {format_bytes(limit)}; a larger batch will run out of memory")
    return _finding("near_limit", ranks or [rank], msg, peak_bytes=peak, reserved_bytes=reserved, used_bytes=used,
                    limit_bytes=limit, ratio=ratio, count=count, worst_rank=rank, **values)


def shared_gpu(host: str, gpu: str, label: Any, planned: Sequence[int], on_gpu: Dict[int, Optional[int]],
               pids: Optional[Dict[int, int]] = None) -> Finding:
    """A GPU NVML shows ranks on that the plan did not put there (full report: every rank named, with
    its pid and the bytes NVML gives it there)."""
    mine = set(planned)
    everyone = sorted(set(on_gpu) | mine)
    intruders = sorted(set(on_gpu) - mine)
    sizes = ", ".join(f"rank {r}" + (f" pid {pids[r]}" if pids and r in pids else "") + f": {format_bytes(on_gpu.get(r))}"
                      for r in everyone if r in on_gpu)
    plan_text = (f"planned for rank {min(mine)} alone" if len(mine) == 1 else
                 f"planned for ranks {ranks_text(sorted(mine))}" if mine else "planned for no rank")
    return _finding("shared_gpu", everyone,
                    f"GPU {label} on {host} ({gpu}) was {plan_text}, but NVML shows ranks {ranks_text(everyone)} on "
                    f"it ({sizes}); ranks {ranks_text(intruders)} took a GPU the plan gave to another: {PIN_REMEDY}",
                    host=host, gpu=gpu, planned_ranks=sorted(mine), ranks_on_gpu=everyone,
                    bytes_by_rank={str(r): on_gpu.get(r) for r in everyone if r in on_gpu},
                    stray=[{"rank": r, "pid": (pids or {}).get(r), "host": host, "gpu": gpu, "bytes": on_gpu.get(r)}
                           for r in intruders])


def shared_gpu_summary(count: int, rank: int, device: int, used: Optional[float], owner: Optional[int] = None,
                       owner_device: Optional[int] = None, owner_pids: Optional[int] = None,
                       owner_planned: Optional[int] = None) -> Finding:
    """The same rule from all-reduced figures: the lowest intruding rank and one crowded GPU."""
    return _finding("shared_gpu", [rank, owner],
                    f"{plural(count, 'rank')} run on a GPU the plan gave to another rank: rank {rank} holds "
                    f"{format_bytes(used) if used is not None and used >= 0 else 'memory'} on GPU {device}"
                    + (f", whose GPU (rank {owner}'s GPU {owner_device}) lists {owner_pids} processes for "
                       f"{plural(owner_planned, 'planned rank')}" if owner is not None else "")
                    + f"; {PIN_REMEDY}; detail='full' names every rank on each GPU",
                    count=count, intruder_rank=rank, gpu=device, owner_rank=owner)


def foreign_process(host: str, gpu: str, label: Any, users: Sequence[int], procs: Dict[int, Optional[int]]) -> Finding:
    known = [b for b in procs.values() if b is not None]
    total = sum(known) if known else None
    listed = ", ".join(f"pid {p} ({format_bytes(b)})" for p, b in sorted(procs.items())[:5])
    return _finding("foreign_process", users,
                    f"GPU {label} on {host} ({gpu}), used by {plural(len(users), 'rank', bare=True)} {ranks_text(users)}, also runs {len(procs)} "
                    f"process(es) outside this job holding {format_bytes(total)}: {listed}; {FOREIGN_REMEDY}: pass "
                    f"foreign='" + (format_bytes(total) if total else "<bytes>")
                    + "' to distmem.init() or move the job to a free GPU",
                    host=host, gpu=gpu, pids=sorted(procs), foreign_bytes=total)


def foreign_process_more(gpus: List[List[str]], hosts: List[str], users: List[int], pids: List[int]) -> Finding:
    return _finding("foreign_process", users,
                    f"{plural(len(gpus), 'more GPU', 'more GPUs')} on {plural(len(hosts), 'host')} ({', '.join(hosts[:5])}"
                    + (", ..." if len(hosts) > 5 else "") + f") also run processes outside this job (ranks "
                    f"{ranks_text(users)}); the JSON report's findings list each", gpus=gpus, pids=pids)


def foreign_process_summary(count: int, rank: int, device: int, pids: int, planned: int, extra: int) -> Finding:
    return _finding("foreign_process", [rank],
                    f"{plural(count, 'rank')} share their GPU with processes outside the plan: rank {rank}'s GPU {device} "
                    f"lists {plural(pids, 'process', 'processes')} for {plural(planned, 'planned rank')}; {FOREIGN_REMEDY}: pass foreign= to "
                    "distmem.init() or move to a free GPU; detail='full' lists their pids and bytes",
                    count=count, worst_rank=rank, extra_processes=extra)


def imbalance(stage: Optional[int], n: int, top_rank: Optional[int], top_peak: float, mean: float,
              low_rank: Optional[int], low_peak: float, ratio: float, limit: float = WARN_IMBALANCE,
              ranks: Optional[Sequence[int]] = None) -> Finding:
    where = f"across the {n} ranks" if stage is None else f"in stage {stage} ({n} ranks)"
    return _finding("imbalance", ranks if ranks is not None else [top_rank, low_rank],
                    f"memory imbalance {where}: rank {top_rank} peaked at {format_bytes(top_peak)}, {ratio:.2f}x the "
                    f"mean {format_bytes(mean)} (lowest: rank {low_rank} at {format_bytes(low_peak)}; warning above "
                    f"{limit:.2f}x); uneven batches or sequence lengths, or a rank holding extra state",
                    stage=stage, max_rank=top_rank, max_peak_bytes=top_peak, mean_peak_bytes=mean,
                    min_rank=low_rank, min_peak_bytes=low_peak, ratio=ratio)


def suggested_overhead(outside: float) -> int:
    """The ``overhead=`` to suggest: what was measured outside the allocator, rounded up to 64 MiB."""
    return -(-int(outside) // (64 * MiB)) * 64 * MiB


def outside_allocator(rank: int, nvml: float, pool: float, outside: float, assumed: float, *,
                      reserved_known: bool, count: int = 1, ranks: Optional[Sequence[int]] = None) -> Finding:
    want = suggested_overhead(outside)
    what = "reserved" if reserved_known else "peak"
    if count <= 1:
        who = f"rank {rank}"
    else:
        who = f"{count} ranks hold more outside the allocator than planned{_listed(ranks)}; the worst, rank {rank},"
    return _finding("outside_allocator", ranks or [rank],
                    f"{who} holds {format_bytes(nvml)} on its GPU per NVML but its allocator {what} is "
                    f"{format_bytes(pool)}: {format_bytes(outside)} outside the allocator (CUDA context, cuBLAS/cuDNN "
                    f"workspaces, NCCL buffers) against the {format_bytes(assumed)} per process the plan assumed; "
                    f"pass overhead='{format_bytes(want, 0).replace(' ', '')}' to distmem.init() so the plan leaves "
                    "room for it", worst_rank=rank, nvml_bytes=nvml, pool_bytes=pool, outside_bytes=outside,
                    assumed_bytes=assumed, suggested_overhead_bytes=want, count=count)
