"""The post-mortem of an out-of-memory error: every rank's record merged into one page. Pure.

It diagnoses the way the engineer who reads it would. For each rank that ran out: what its whole
step needed (:func:`distmem.plan.need.step_need`: its own earlier steps, its peers' steps scaled to
its batch, distmem's estimate, the trend of its steps, else what it held plus what it asked for)
against its limit; against its peers (the median of the other ranks of its stage); against what
was free on its GPU (other processes, memory outside the allocators). Each cause is one rule,
written once here (:data:`RULES`), and says its figures, the evidence they rest on and how sure it
is (``high``: the figures establish it; ``medium``: it rests on a lower bound or a trend; ``low``:
possible, not shown); several may apply, ranked by that, then by :data:`CAUSES`' order:

``imbalance``          its step needed :data:`~distmem.defaults.IMBALANCE_RATIO` x or more the median of its
                       peers' and more than its limit, where theirs fit: uneven data, a longer sequence
``growth``             what it held entering each step rose steadily: something keeps tensors across steps
``wrong_stage``        a pipeline stage needed more than its planned limit: the stage's estimate was short
``foreign_process``    within its limit, but the GPU was full and processes outside the job held it
``outside_allocator``  within its limit, but the GPU was full and the job's own processes held memory
                       outside their allocators beyond the plan's per-process overhead
``fragmentation``      the pool held the request's bytes free but not in one block, and the rest of the
                       step fits in what the pool held (a block within :data:`~distmem.defaults.FRAGMENTATION_TIE`
                       of the request is a tie, not fragmentation)
``over_plan``          the step needs more than the rank's limit
``unexplained``        none of the above (the figures are still listed)

Each cause carries the changes that would let the step train, each with the figure it gives
(:func:`distmem.plan.need.changes_for_need`), and names as ``change`` the first that fits.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from .. import defaults
from ..plan import need as needs
from ..units import MiB, format_bytes, plural

__all__ = ["attach_to_report", "job_records", "CAUSES", "CONFIDENCE", "RULES", "needed_bytes", "would_hold", "facts_of",
           "imbalance", "growth", "wrong_stage", "foreign_process", "outside_allocator", "fragmentation", "over_plan",
           "diagnose", "postmortem", "render_text", "report_peers"]

CAUSES = ("imbalance", "growth", "wrong_stage", "foreign_process", "outside_allocator", "fragmentation", "over_plan",
          "unexplained")
CONFIDENCE = ("high", "medium", "low")

Record = Dict[str, Any]
Cause = Dict[str, Any]


def _fmt(n: Optional[float]) -> str:
    return format_bytes(n) if n is not None else "?"


def needed_bytes(rec: Record) -> Optional[int]:
    """What the rank held at the failing allocation plus what it asked for (None without both): the
    lower bound of its step's need (:func:`distmem.plan.need.step_need` prices the whole step)."""
    return needs.at_failure(rec)


def would_hold(need: int, margin: float = defaults.FROM_REPORT_MARGIN) -> int:
    """The limit that would have held ``need``: it plus ``margin``, rounded up to a whole MiB."""
    return -(-int(need * (1 + margin)) // MiB) * MiB


def _stage_row(rec: Record) -> Optional[Dict[str, Any]]:
    stage = rec.get("stage")
    if stage is None:
        return None
    return next((r for r in rec.get("stages") or [] if r.get("stage") == stage), None)


def _command(run_dir: str, rec: Record) -> str:
    strategy = rec.get("strategy") or "data"
    return f"distmem plan --from {run_dir} --strategy {strategy} (with the job's other options)"


def facts_of(rec: Record, records: Sequence[Record] = ()) -> Dict[str, Any]:
    """What every rule reads about ``rec``, computed once: its step's need, its peers and how it
    compares with them, the growth of its steps, by how much the device itself was short."""
    peers = needs.peers_of(rec, records)
    need = needs.step_need(rec, peers)
    reserved_of = {int(r["rank"]): int(r["reserved_bytes"]) for r in records
                   if r.get("rank") is not None and isinstance(r.get("reserved_bytes"), int)}
    return {"need": need, "peers": peers, "imbalance": needs.imbalance(rec, need, peers),
            "growth": needs.growth(rec), "device_short": needs.device_short(rec), "reserved_of": reserved_of,
            "limit": rec.get("limit_bytes"), "records": list(records)}


def _facts(rec: Record, records: Sequence[Record], facts: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    return facts if facts is not None else facts_of(rec, records)


def _chosen(changes: List[Dict[str, Any]], order: Sequence[str]) -> Optional[Dict[str, Any]]:
    """The first change in ``order`` that fits; None where none is known to."""
    for kind in order:
        for c in changes:
            if c["change"] == kind and c.get("fits"):
                return c
    return None


def _cause(kind: str, confidence: str, message: str, evidence: str, changes: List[Dict[str, Any]],
           order: Sequence[str], fallback: str, **figures: Any) -> Cause:
    change = _chosen(changes, order)
    remedy = change["text"] if change is not None else fallback
    others = [c["text"] + ("" if c.get("fits") else (" - does not fit" if c.get("fits") is False else ""))
              for c in changes if c is not change]
    return {"kind": kind, "confidence": confidence, "message": message, "evidence": evidence, "change": change,
            "changes": changes, "remedy": remedy, "also": others, **figures}


_PLAIN = ("limit", "micro_batch", "fewer_ranks", "balance_batch", "recompute")


def _at_cap(rec: Record) -> bool:
    """The allocator's pool could not grow: what it reserved plus the request is above the limit."""
    res, req, limit = rec.get("reserved_bytes"), rec.get("request_bytes"), rec.get("limit_bytes")
    return None not in (res, req, limit) and int(res) + int(req) > int(limit)


def _over(rec: Record, need: Any, limit: Optional[int]) -> bool:
    """The step needs more than the limit: its figure says so, or (only a lower bound known) the
    rank failed with its pool at the limit."""
    if need.bytes is None or not limit:
        return False
    return need.bytes > limit or (need.lower_bound and _at_cap(rec))


def over_plan(rec: Record, records: Sequence[Record] = (), run_dir: str = "RUN_DIR",
              facts: Optional[Dict[str, Any]] = None, **_: Any) -> Optional[Cause]:
    """The step needs more than the rank's limit (a pipeline stage: see :func:`wrong_stage`)."""
    f = _facts(rec, records, facts)
    need, limit = f["need"], f["limit"]
    if not _over(rec, need, limit) or _stage_row(rec) is not None:
        return None
    sure = need.at_failure is not None and need.at_failure > limit
    confidence = ("high" if sure or (not need.lower_bound and need.source in ("history", "peers", "estimate"))
                  else "medium")
    changes = needs.changes_for_need(rec, need, f["peers"])
    for c in changes:
        if c["change"] == "limit" and c["fits"]:
            c["text"] = c["text"].replace("RUN_DIR", run_dir)
    return _cause("over_plan", confidence,
                  (f"the step needs more than its limit: {_fmt(need.bytes)} against {_fmt(limit)}, "
                   f"{_fmt(need.bytes - limit)} over" + (" (at least)" if need.lower_bound else "")
                   if need.bytes > limit else
                   f"the step needs more than its limit: it held {_fmt(rec.get('allocated_bytes'))} and asked for "
                   f"{_fmt(rec.get('request_bytes'))} with its pool ({_fmt(rec.get('reserved_bytes'))}) at its limit "
                   f"{_fmt(limit)}; the rest of the step is not known"),
                  f"{need.source}: {need.evidence}", changes, _PLAIN,
                  f"plan it at {_fmt(would_hold(need.bytes))}: {_command(run_dir, rec)}; or a smaller micro-batch",
                  over_by_bytes=max(need.bytes - limit, 0), needed_bytes=need.bytes, limit_bytes=limit,
                  would_hold_bytes=would_hold(need.bytes), source=need.source)


def imbalance(rec: Record, records: Sequence[Record] = (), facts: Optional[Dict[str, Any]] = None,
              **_: Any) -> Optional[Cause]:
    """Its step needed :data:`defaults.IMBALANCE_RATIO` x the median of its peers' or more, more than
    its limit, where the median fits it: the batch (or sequence, or stage) is out of balance."""
    f = _facts(rec, records, facts)
    need, limit, imb = f["need"], f["limit"], f["imbalance"]
    if imb is None or not _over(rec, need, limit) or imb["median_bytes"] > limit:
        return None
    if imb["ratio"] < defaults.IMBALANCE_RATIO:
        return None
    if imb.get("units_ratio") is not None and imb["units_ratio"] < defaults.IMBALANCE_RATIO:
        return None  # it was fed what its peers were: their figures are partial (stopped mid-step), not smaller
    low = imb.get("at_failure_ratio") or 0
    confidence = ("high" if (not need.lower_bound or low >= defaults.IMBALANCE_RATIO)
                  and (imb.get("units_ratio") is not None or imb.get("peers_complete")) else "medium")
    fed = ""
    if imb.get("units_ratio"):
        fed = (f"; it was fed {imb['units_ratio']:.1f}x the median of theirs ({need.elements} elements"
               + (f", {need.samples} samples" if need.samples else "") + f" against {imb['median_elements']}"
               + (f", {imb['median_samples']:.0f} samples" if imb.get("median_samples") else "") + ")")
    changes = needs.changes_for_need(rec, need, f["peers"])
    return _cause("imbalance", confidence,
                  f"out of balance with its peers: its step needs {_fmt(need.bytes)}"
                  + (" (at least)" if need.lower_bound else "")
                  + f", {imb['ratio']:.1f}x the median of its {plural(imb['peers'], 'peer')} ({_fmt(imb['median_bytes'])}),"
                  f" against its limit {_fmt(limit)}{fed}",
                  f"{need.source}: {need.evidence}; peers: the median of "
                  + ", ".join(f"rank {p.get('rank')} {_fmt(needs.peer_figure(p))}" for p in f["peers"][:8]),
                  changes, ("balance_batch", "micro_batch", "fewer_ranks", "recompute"),
                  "give it the batch its peers get (theirs fit: the median peaked at "
                  f"{_fmt(imb['median_bytes'])})",
                  ratio=round(imb["ratio"], 2), median_bytes=imb["median_bytes"], needed_bytes=need.bytes,
                  limit_bytes=limit, units_ratio=imb.get("units_ratio"), over_by_bytes=max(need.bytes - limit, 0))


def growth(rec: Record, records: Sequence[Record] = (), facts: Optional[Dict[str, Any]] = None,
           **_: Any) -> Optional[Cause]:
    """What the rank held entering each step rose steadily, and without that rise its step fits."""
    f = _facts(rec, records, facts)
    g, need, limit = f["growth"], f["need"], f["limit"]
    if g is None or need.bytes is None or not limit:
        return None
    without = need.bytes - g["grew_bytes"]
    if without * (1 + defaults.FROM_REPORT_MARGIN) > limit or need.bytes * (1 + defaults.FROM_REPORT_MARGIN) <= limit:
        return None  # without the growth it would not fit either / with it, it still fits: not why it ran out
    change = {"change": "release_kept", "per_step_bytes": g["per_step_bytes"], "need_bytes": without,
              "limit_bytes": limit, "fits": True,
              "text": "keep nothing on the GPU across steps that grows with them (a loss history as tensors: "
                      "loss.item(); outputs kept for a metric: .detach().cpu(); a cache: bound it): without "
                      f"the {_fmt(g['grew_bytes'])} it gathered the step needs about {_fmt(without)}"}
    return _cause("growth", "high" if g["r2"] >= 0.9 else "medium",
                  f"memory grows from step to step: what it held entering each step rose "
                  f"{_fmt(g['per_step_bytes'])} a step over {g['steps']} steps (from {_fmt(g['first_bytes'])} at step "
                  f"{g['since']} to {_fmt(g['last_bytes'])}), until the step needed {_fmt(need.bytes)} against its "
                  f"limit {_fmt(limit)}",
                  f"its steps' starts (note_step): a line of slope {_fmt(g['per_step_bytes'])}/step, r2 {g['r2']}; "
                  f"{need.source}: {need.evidence}", [change], ("release_kept",), change["text"],
                  per_step_bytes=g["per_step_bytes"], grew_bytes=g["grew_bytes"], needed_bytes=need.bytes,
                  limit_bytes=limit, over_by_bytes=max(need.bytes - limit, 0))


def fragmentation(rec: Record, records: Sequence[Record] = (), facts: Optional[Dict[str, Any]] = None,
                  **_: Any) -> Optional[Cause]:
    """The pool's free bytes would hold the request, its largest free block would not (by more than
    a tie), and the rest of the step fits in what the pool held."""
    res, alloc, big, req = (rec.get(k) for k in ("reserved_bytes", "allocated_bytes", "largest_free_bytes",
                                                   "request_bytes"))
    if None in (res, alloc, big, req):
        return None
    f = _facts(rec, records, facts)
    need, limit = f["need"], f["limit"]
    free = int(res) - int(alloc)
    if free < max(int(req), defaults.FRAGMENTATION_MIN_BYTES) or int(big) >= int(req) * (1 - defaults.FRAGMENTATION_TIE):
        return None
    room = max(int(res), int(limit or 0))  # what the pool held, or could grow to within its limit
    if need.bytes is not None and need.bytes > room:
        return None  # the step needs more than the pool could hold: not the pool's shape
    confidence = "low" if need.lower_bound else "high"
    fits = need.bytes is not None and (not limit or need.bytes <= limit)
    change = {"change": "expandable_segments", "need_bytes": need.bytes, "limit_bytes": limit, "fits": fits,
              "text": "let the allocator grow segments instead of splitting them: DISTMEM_TORCH_EXPANDABLE_SEGMENTS=1 "
                      "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) before init()"
                      + (f": the step's {_fmt(need.bytes)} then fits its {_fmt(limit)}" if fits else "")}
    shape = (f"the whole step fits in what the pool could hold ({_fmt(room)})" if not need.lower_bound
             else "whether the rest of the step fits in it is not known")
    return _cause("fragmentation", confidence,
                  f"fragmentation: its allocator held {_fmt(free)} free ({_fmt(res)} reserved, {_fmt(alloc)} "
                  f"allocated) but its largest free block was {_fmt(big)}, {_fmt(int(req) - int(big))} short of the "
                  f"{_fmt(req)} asked for; {shape} (the step needs {_fmt(need.bytes)})",
                  f"{need.source}: {need.evidence}", [change], ("expandable_segments",),
                  change["text"] + "; or allocate the large buffers first and keep sizes steady (pad odd shapes "
                                   "to a few buckets)",
                  pool_free_bytes=free, largest_free_bytes=big, request_bytes=req, over_by_bytes=int(req) - int(big),
                  needed_bytes=need.bytes)


def _device_others(rec: Record) -> Optional[int]:
    """Where NVML's pids cannot be told apart (another pid namespace): the device's used bytes
    (total - what the driver keeps - free at the failure) less this process (its pool and overhead) and the job's other ranks
    on the GPU (their limits and overheads): what someone else must hold. None without the figures."""
    total, free, res = rec.get("device_total_bytes"), rec.get("device_free_bytes"), rec.get("reserved_bytes")
    if total is None or free is None or res is None:
        return None
    over = int(rec.get("overhead_bytes") or 0)
    mates = max(int(rec.get("shared_by") or 1) - 1, 0) * (int(rec.get("limit_bytes") or 0) + over)
    driver = int(rec.get("driver_reserved_bytes") or 0)  # NVML's total counts what CUDA's free never can
    return max(int(total) - driver - int(free) - int(res) - over - mates, 0)


def _within(rec: Record, f: Dict[str, Any]) -> bool:
    """The rank failed within its limit because the device itself was full (where that is known)."""
    low, limit, short = f["need"].at_failure, f["limit"], f["device_short"]
    if low is not None and limit and low > limit:
        return False
    return short is None or short > 0


def _within_text(rec: Record, need: Any) -> str:
    return (_fmt(need.at_failure) if need.at_failure is not None
            else f"{_fmt(rec.get('allocated_bytes'))} allocated, the request's size not known")


def foreign_process(rec: Record, records: Sequence[Record] = (), facts: Optional[Dict[str, Any]] = None,
                    **_: Any) -> Optional[Cause]:
    """Within its limit, the GPU was full, and processes outside the job held bytes on it the plan
    did not reserve."""
    f = _facts(rec, records, facts)
    procs = rec.get("gpu_processes") or []
    others = [p for p in procs if p.get("who") == "other"]
    held = sum(int(p.get("bytes") or 0) for p in others)
    estimated = False
    if not others and any(p.get("who") == "unknown" for p in procs):
        held, estimated = _device_others(rec) or 0, True
    unplanned = held - int(rec.get("foreign_planned_bytes") or 0)
    if unplanned < defaults.FOREIGN_MIN_BYTES or not _within(rec, f):
        return None
    need, limit = f["need"], f["limit"]
    pids = ", ".join(f"pid {p['pid']} {_fmt(p.get('bytes'))}" for p in sorted(others, key=lambda p: -(p.get("bytes")
                                                                                                      or 0))[:6])
    if estimated:
        pids = ("NVML's pids are of another pid namespace: the device's used memory less this process and the "
                "job's planned ranks")
    free = rec.get("device_free_bytes")
    shared = needs.equal_share(rec, foreign=held)
    k = max(int(rec.get("shared_by") or 1), 1)
    plan_fits = bool(shared and need.bytes and need.bytes * (1 + defaults.FROM_REPORT_MARGIN) <= shared)
    changes = [{"change": "plan_foreign", "foreign_bytes": held, "share_bytes": shared, "need_bytes": need.bytes,
                "fits": plan_fits,
                "text": f"plan around them: foreign='{_fmt(held)}' (distmem plan --foreign '{_fmt(held)}'): each of "
                        f"the {plural(k, 'rank')} on the GPU then gets {_fmt(shared)}"
                        + (f" for its step's {_fmt(need.bytes)}" if need.bytes else "")},
               {"change": "stop_foreign", "pids": [p["pid"] for p in others], "need_bytes": need.bytes,
                "limit_bytes": limit, "fits": bool(need.bytes is not None and limit and need.bytes <= limit),
                "text": "stop the processes outside the job on its GPU (" + (pids or "not listed") + "), or run on a "
                        f"GPU of its own: its step's {_fmt(need.bytes)} fits its limit {_fmt(limit)}"}]
    within = f"within its limit ({_within_text(rec, need)} of {_fmt(limit)})" if limit else "the device ran out"
    return _cause("foreign_process", "medium" if estimated else "high",
                  f"a foreign process: {within}, but " + (f"{plural(len(others), 'process', 'processes')} outside the job"
                                                          if not estimated else "processes outside the job")
                  + f" held {_fmt(held)} on its GPU ({pids}); the plan reserved {_fmt(rec.get('foreign_planned_bytes') or 0)}"
                  " for others" + (f" and the device had {_fmt(free)} free" if free is not None else ""),
                  "NVML's processes on the GPU at the failure" + (f"; the driver had {_fmt(free)} free for a "
                                                                   f"{_fmt(rec.get('request_bytes'))} request"
                                                                   if free is not None else ""),
                  changes, ("plan_foreign", "stop_foreign"), changes[1]["text"],
                  foreign_bytes=held, unplanned_bytes=unplanned, pids=[p["pid"] for p in others],
                  over_by_bytes=unplanned, estimated=estimated)


def outside_allocator(rec: Record, records: Sequence[Record] = (), facts: Optional[Dict[str, Any]] = None,
                      **_: Any) -> Optional[Cause]:
    """Within its limit, the GPU was full, and the job's own processes held memory outside their
    allocators (NVML's bytes less the pool) beyond the plan's per-process overhead."""
    f = _facts(rec, records, facts)
    if not _within(rec, f):
        return None
    outside = needs.outside_bytes(rec, f["reserved_of"])
    excess = {who: b for who, b in outside.items() if b > 0}
    total = sum(excess.values())
    if total < defaults.OUTSIDE_MIN_BYTES:
        return None
    need, limit = f["need"], f["limit"]
    ov = int(rec.get("overhead_bytes") or 0)
    k = max(int(rec.get("shared_by") or 1), 1)
    # each rank's limit set to its step's need + the margin, what the GPU leaves each process outside it
    each = needs.equal_share(rec, k, overhead=0)
    hold = would_hold(need.bytes) if need.bytes else None
    allowed = (each - hold) // MiB * MiB if each is not None and hold is not None else None
    worst = max(excess.values())
    planned = needs.equal_share(rec, overhead=ov + worst)
    changes = [{"change": "outside_cap", "max_outside_bytes": allowed, "overhead_bytes": allowed, "need_bytes": need.bytes,
                "limit_bytes": hold, "fits": allowed is not None and allowed > ov,
                "text": f"keep each process's memory outside its allocator under {_fmt(allowed)} (its CUDA context "
                        "and libraries: NCCL communicators, a library's own pool such as CuPy's, workspaces outside the "
                        f"allocator) and plan it so: overhead='{_fmt(allowed)}' gives each rank {_fmt(hold)}, its "
                        f"step's {_fmt(need.bytes)} + {defaults.FROM_REPORT_MARGIN:.0%}"},
               {"change": "plan_overhead", "overhead_bytes": ov + worst, "share_bytes": planned,
                "need_bytes": need.bytes,
                "fits": bool(planned and need.bytes and need.bytes * (1 + defaults.FROM_REPORT_MARGIN) <= planned),
                "text": f"plan what it holds now: overhead='{_fmt(ov + worst)}' (distmem plan --overhead): each rank "
                        f"then gets {_fmt(planned)} for its step's {_fmt(need.bytes)}"}]
    changes += [c for c in needs.changes_for_need(rec, need, f["peers"]) if c["change"] == "fewer_ranks"]
    who = ", ".join(f"{w} {_fmt(b)}" for w, b in sorted(excess.items(), key=lambda x: -x[1])[:6])
    return _cause("outside_allocator", "high",
                  f"memory outside the allocator: within its limit ({_within_text(rec, need)} of {_fmt(limit)}) the "
                  f"GPU was full; the job's processes on it held {_fmt(total)} outside their allocators beyond the "
                  f"plan's {_fmt(ov)} per process ({who})",
                  "NVML's bytes per process less its allocator's pool (its record)"
                  + (f"; the driver had {_fmt(rec.get('device_free_bytes'))} free for a {_fmt(rec.get('request_bytes'))}"
                     " request" if rec.get("device_free_bytes") is not None else ""),
                  changes, ("outside_cap", "plan_overhead", "fewer_ranks"), changes[0]["text"],
                  outside_bytes=total, by_process=excess, over_by_bytes=total)


def wrong_stage(rec: Record, records: Sequence[Record] = (), run_dir: str = "RUN_DIR",
                facts: Optional[Dict[str, Any]] = None, **_: Any) -> Optional[Cause]:
    """A pipeline stage needed more than its planned limit: the estimate behind that stage was short.
    The stage's need is the largest of its ranks' steps."""
    row = _stage_row(rec)
    if row is None:
        return None
    f = _facts(rec, records, facts)
    stage = rec.get("stage")
    mates = [r for r in records if r.get("stage") == stage and needs.ran_out(r) and r is not rec]
    figures = [f["need"]] + [needs.step_need(r, needs.peers_of(r, records)) for r in mates]
    known = [n for n in figures if n.bytes is not None]
    limit = row.get("planned_bytes") or rec.get("limit_bytes")
    if not known or not limit or max(n.bytes for n in known) <= limit:  # type: ignore[operator]
        return None
    top = max(known, key=lambda n: n.bytes)  # type: ignore[arg-type,return-value]
    need = int(top.bytes)  # type: ignore[arg-type]
    est = row.get("demand_bytes")
    hold = would_hold(need)
    share = needs.rank_share(rec)
    short = f"; its estimate {_fmt(est)} was short by {_fmt(need - est)} ({(need - est) / need:.0%})" if est else ""
    others = [r for r in (rec.get("stages") or []) if r.get("stage") != stage]
    changes = [{"change": "plan_from", "limit_bytes": hold, "share_bytes": share, "need_bytes": need,
                "fits": share is None or hold <= share,
                "text": f"plan stage {stage} at {_fmt(hold)} (what it needed + {defaults.FROM_REPORT_MARGIN:.0%}"
                        + (f", within the {_fmt(share)} its GPU offers it" if share else "") + f"): "
                        f"{_command(run_dir, rec)}"}]
    changes += [c for c in needs.changes_for_need(rec, top, f["peers"]) if c["change"] in ("micro_batch", "recompute")]
    return _cause("wrong_stage", "high" if not top.lower_bound else "medium",
                  f"the plan got stage {stage} wrong: it needed {_fmt(need)} but was planned {_fmt(limit)}{short}"
                  + ((" (the other stage was planned " if len(others) == 1 else
                      f" (the other {plural(len(others), 'stage')} were planned ")
                     + ", ".join(_fmt(r.get("planned_bytes")) for r in others) + ")" if others else ""),
                  f"{top.source}: {top.evidence}", changes, ("plan_from", "micro_batch"),
                  f"move layers off stage {stage} (--stages / a new partition)",
                  stage=stage, needed_bytes=need, limit_bytes=limit, estimate_bytes=est, over_by_bytes=need - limit,
                  would_hold_bytes=hold)


#: Every rule, in the order its cause is named when two are as sure.
RULES: Dict[str, Callable[..., Optional[Cause]]] = {
    "imbalance": imbalance, "growth": growth, "wrong_stage": wrong_stage, "foreign_process": foreign_process,
    "outside_allocator": outside_allocator, "fragmentation": fragmentation, "over_plan": over_plan,
}


def diagnose(rec: Record, records: Sequence[Record] = (), run_dir: str = "RUN_DIR",
             rules: Optional[Dict[str, Callable[..., Optional[Cause]]]] = None) -> List[Cause]:
    """Every cause ``rec`` shows, surest first (``unexplained`` with its figures when none does).
    ``records``: every record of the job (the other ranks' too: ``stopped`` ones and report rows)."""
    facts = facts_of(rec, records)
    found = [c for c in (rule(rec, records=records, run_dir=run_dir, facts=facts)
                         for rule in (rules or RULES).values()) if c]
    if found:
        return sorted(found, key=lambda c: (CONFIDENCE.index(c["confidence"]), CAUSES.index(c["kind"])))
    need, limit = facts["need"], rec.get("limit_bytes")
    return [{"kind": "unexplained", "confidence": "low", "over_by_bytes": None, "change": None, "changes": [],
             "also": [], "evidence": f"{need.source}: {need.evidence}",
             "message": f"no rule explains it: {_fmt(rec.get('allocated_bytes'))} allocated, "
                        f"{_fmt(rec.get('reserved_bytes'))} reserved, asked for {_fmt(rec.get('request_bytes'))}"
                        + (f", planned {_fmt(limit)}" if limit else "")
                        + (f", the step needs {_fmt(need.bytes)} ({need.source})" if need.bytes else "")
                        + (f", the device had {_fmt(rec.get('device_free_bytes'))} free"
                           if rec.get("device_free_bytes") is not None else ""),
             "remedy": "the other ranks on this GPU may have gone over their plans: run with a periodic report "
                       "(distmem.ReportEvery) and read `distmem report`; note_step(step, batch) in the loop "
                       "records what prices the step"}]


def report_peers(report: Optional[Dict[str, Any]]) -> List[Record]:
    """A report's per-rank rows (``distmem.report``/``ReportEvery`` JSON) as peers for the median:
    ``kind`` ``report``, the rank's stage and allocator peak."""
    out: List[Record] = []
    for row in (report or {}).get("ranks") or []:
        peak = row.get("peak_bytes") if row.get("peak_bytes") is not None else row.get("current_bytes")
        if row.get("rank") is None or not isinstance(peak, int) or peak < 0:
            continue
        out.append({"kind": "report", "rank": row["rank"], "stage": row.get("stage"), "peak_bytes": peak})
    return out


def postmortem(records: Sequence[Record], run_dir: str = "RUN_DIR", world_size: Optional[int] = None,
               rules: Optional[Dict[str, Callable[..., Optional[Cause]]]] = None,
               report: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The page as data: the ranks that ran out (first one first), each with its step's need, its
    causes (surest first) and the change each names; the ranks fail fast stopped, as its peers.
    ``report``: the run's report (its rows stand in for peers that wrote no record)."""
    recs = sorted(records, key=lambda r: (r.get("time") or 0.0, r.get("rank") or 0))
    out = [r for r in recs if needs.ran_out(r)]
    seen = {r.get("rank") for r in recs}
    every = recs + [p for p in report_peers(report) if p["rank"] not in seen]
    size = world_size or max([r.get("world_size") or 0 for r in recs] + [0]) or None
    entries = []
    for r in out:
        causes = diagnose(r, every, run_dir, rules)
        need = needs.step_need(r, needs.peers_of(r, every))
        entries.append({k: r.get(k) for k in ("rank", "host", "device", "stage", "step", "time", "source", "error",
                                              "limit_bytes", "request_bytes", "allocated_bytes", "reserved_bytes",
                                              "largest_free_bytes", "device_free_bytes", "count", "nvml_note", "units")}
                       | {"needed_bytes": needed_bytes(r), "step_need_bytes": need.bytes, "step_need_source": need.source,
                          "step_need_evidence": need.evidence, "causes": causes,
                          "layers": (r.get("layers") or {}).get("groups", []),
                          "gpu_processes": [p for p in r.get("gpu_processes") or [] if p.get("who") != "self"]})
    counts: Dict[str, int] = {}
    for e in entries:
        for c in e["causes"][:1]:
            counts[c["kind"]] = counts.get(c["kind"], 0) + 1
    peers = [{"rank": r.get("rank"), "stage": r.get("stage"), "step": r.get("step"), "peak_bytes": r.get("peak_bytes"),
              "allocated_bytes": r.get("allocated_bytes"), "units": r.get("units")} for r in recs if needs.stopped(r)]
    return {"distmem_postmortem": 2, "run_dir": run_dir, "world_size": size, "ranks_out": [e["rank"] for e in entries],
            "first": entries[0]["rank"] if entries else None, "causes": counts, "entries": entries, "stopped": peers,
            "next_plan": f"distmem plan --from {run_dir}" if entries else None}


def render_text(page: Dict[str, Any]) -> str:
    """The page as text: one paragraph per rank that ran out, first one first."""
    entries = page["entries"]
    if not entries:
        return f"distmem postmortem {page['run_dir']}: no out-of-memory record (no rank wrote RUN_DIR/oom/rank-N.json)\n"
    size = page.get("world_size")
    first = entries[0]
    when = time.strftime("%H:%M:%S UTC", time.gmtime(first["time"])) if first.get("time") else "?"
    lines = [f"distmem postmortem {page['run_dir']}: {len(entries)}"
             + (f" of {size}" if size else "") + f" {'rank' if len(entries) == 1 and not size else 'ranks'} ran out of memory; "
             f"first: rank {first['rank']}" + (f" on {first['host']}" if first.get("host") else "")
             + (f" at step {first['step']}" if first.get("step") is not None else "") + f" ({when})", ""]
    for e in entries:
        where = [f"host {e['host']}" if e.get("host") else None,
                 f"GPU {e['device']}" if e.get("device") is not None else None,
                 f"stage {e['stage']}" if e.get("stage") is not None else None,
                 f"step {e['step']}" if e.get("step") is not None else None, f"seen by {e.get('source')}"]
        lines.append(f"rank {e['rank']} ({', '.join(w for w in where if w)}): asked for {_fmt(e.get('request_bytes'))}"
                     f" with {_fmt(e.get('allocated_bytes'))} allocated, {_fmt(e.get('reserved_bytes'))} reserved, "
                     f"largest free block {_fmt(e.get('largest_free_bytes'))}; planned {_fmt(e.get('limit_bytes'))}"
                     + (f" ({e['count']} OOMs in this process)" if (e.get("count") or 1) > 1 else ""))
        if e.get("error"):
            lines.append(f"  error: {e['error'][:200]}")
        if e.get("step_need_bytes") is not None:
            lines.append(f"  the step needed: {_fmt(e['step_need_bytes'])} ({e['step_need_source']}: "
                         f"{e['step_need_evidence']})")
        for i, c in enumerate(e["causes"]):
            lines.append(f"  {'cause' if i == 0 else 'also'} [{c.get('confidence', '?')}]: {c['message']}")
            lines.append(f"    change: {c['remedy']}")
            for other in (c.get("also") or [])[:4] if i == 0 else []:
                lines.append(f"    or: {other}")
        if e["layers"]:
            lines.append("  live tensors by layer: " + "; ".join(
                f"{g['layer']} {_fmt(g['bytes'])}" + (f" (estimate {_fmt(g['estimate_bytes'])})"
                                                       if g.get("estimate_bytes") else "") for g in e["layers"][:8]))
        if e["gpu_processes"]:
            lines.append(f"  others on GPU {e.get('device')}: " + ", ".join(
                f"pid {p['pid']} {_fmt(p.get('bytes'))} ({'not in the job' if p['who'] == 'other' else p['who']})"
                for p in e["gpu_processes"][:8]))
        elif e.get("nvml_note"):
            lines.append(f"  others on its GPU: not known ({e['nvml_note']})")
        lines.append("")
    if page.get("stopped"):
        lines.append("stopped by fail fast: " + "; ".join(
            f"rank {p['rank']}" + (f" stage {p['stage']}" if p.get("stage") is not None else "")
            + f" peak {_fmt(p.get('peak_bytes'))}" + (f" at step {p['step']}" if p.get("step") is not None else "")
            for p in page["stopped"][:16]))
    if page.get("next_plan"):
        lines.append(f"next run planned from this one: {page['next_plan']} (each rank's limit from its observed "
                     f"peak + {defaults.FROM_REPORT_MARGIN:.0%}, what ran out from what its step needed, never above "
                     "its share of the GPU)")
    return "\n".join(lines).rstrip() + "\n"


def job_records(records: Sequence[Record], pids: Sequence[int], since: Optional[float]) -> List[Record]:
    """The records of this job: written by a process that reported (its pid), or since ``since``
    (this process's start) by a rank that did not - not a record an earlier run left in the folder."""
    mine = set(pids)
    return [r for r in records if r.get("pid") in mine or (since is not None and (r.get("time") or 0) >= since)]


def _process_start() -> Optional[float]:
    import os

    try:
        return os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return None


def attach_to_report(report: Any, run_dir: str) -> Optional[Dict[str, Any]]:
    """Rank 0's report, while the job still can make one: the out-of-memory records of this job in
    ``run_dir`` as ``aggregates["postmortem"]`` (ranks, causes) and one warning per rank that ran out."""
    from ..observe.oom_record import read_records

    records = job_records(read_records(run_dir), [s.pid for s in report.ranks], _process_start())
    if not any(needs.ran_out(r) for r in records):
        return None
    rows = {"ranks": [{"rank": s.rank, "stage": getattr(s, "stage", None), "peak_bytes": s.peak_bytes}
                      for s in report.ranks if isinstance(getattr(s, "peak_bytes", None), int)]}
    page = postmortem(records, run_dir=run_dir, world_size=report.world_size, report=rows)
    report.aggregates["postmortem"] = {"run_dir": run_dir, "ranks_out": page["ranks_out"], "first": page["first"],
                                       "causes": page["causes"]}
    for e in page["entries"]:
        c = e["causes"][0]
        report.warnings.append(f"rank {e['rank']} ran out of memory" + (f" at step {e['step']}" if e.get("step")
                                                                          is not None else "")
                               + f": {c['message']}; {c['remedy']} (distmem postmortem {run_dir})")
    return page
