"""The post-mortem of an out-of-memory error: every rank's record merged into one page. Pure.

Each cause is one rule, written once here (:data:`RULES`), over the figures of one record
(:mod:`distmem.observe.oom_record`) and, for a stage, the records of its other ranks:

``over_plan``        what the rank held plus what it asked for is above its planned limit
``fragmentation``    the allocator held enough free memory for the request, but not in one block
``foreign_process``  within its plan, but another process NVML lists on its GPU holds bytes the plan did not reserve
``wrong_stage``      a pipeline stage needed more than its planned limit: the stage's estimate was short
``unexplained``      none of the above (the figures are still listed)

Each cause carries its figures, a sentence, and what to change (the limit that would have held,
the command that plans the next run from this one).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from .. import defaults
from ..units import MiB, format_bytes, plural

__all__ = ["attach_to_report", "job_records", "CAUSES", "RULES", "needed_bytes", "over_plan", "fragmentation", "foreign_process", "wrong_stage",
           "diagnose", "postmortem", "render_text", "would_hold"]

CAUSES = ("over_plan", "fragmentation", "foreign_process", "wrong_stage", "unexplained")

Record = Dict[str, Any]
Cause = Dict[str, Any]


def _fmt(n: Optional[float]) -> str:
    return format_bytes(n) if n is not None else "?"


def needed_bytes(rec: Record) -> Optional[int]:
    """What the rank needed at the failing allocation: allocated + requested (None without both)."""
    a, r = rec.get("allocated_bytes"), rec.get("request_bytes")
    if a is None or r is None:
        return None
    return int(a) + int(r)


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


def over_plan(rec: Record, run_dir: str = "RUN_DIR", **_: Any) -> Optional[Cause]:
    """allocated + request above the rank's planned limit (a pipeline stage: see :func:`wrong_stage`)."""
    need, limit = needed_bytes(rec), rec.get("limit_bytes")
    if need is None or not limit or need <= limit or _stage_row(rec) is not None:
        return None
    hold = would_hold(need)
    return {"kind": "over_plan", "over_by_bytes": need - limit, "needed_bytes": need, "limit_bytes": limit,
            "would_hold_bytes": hold,
            "message": f"over its plan: {_fmt(rec.get('allocated_bytes'))} allocated + {_fmt(rec.get('request_bytes'))} "
                       f"asked for = {_fmt(need)}, {_fmt(need - limit)} over its planned {_fmt(limit)}",
            "remedy": f"plan it at {_fmt(hold)} (what it needed + {defaults.FROM_REPORT_MARGIN:.0%}): "
                      f"{_command(run_dir, rec)}; or a smaller micro-batch (distmem.guard.step falls back on its own)"}


def fragmentation(rec: Record, **_: Any) -> Optional[Cause]:
    """The pool's free bytes (reserved - allocated) would hold the request, its largest free block would not."""
    res, alloc, big, req = (rec.get(k) for k in ("reserved_bytes", "allocated_bytes", "largest_free_bytes",
                                                   "request_bytes"))
    if None in (res, alloc, big, req):
        return None
    free = int(res) - int(alloc)
    if free < max(int(req), defaults.FRAGMENTATION_MIN_BYTES) or int(big) >= int(req):
        return None
    return {"kind": "fragmentation", "pool_free_bytes": free, "largest_free_bytes": big, "request_bytes": req,
            "over_by_bytes": int(req) - int(big),
            "message": f"fragmentation: its allocator held {_fmt(free)} free ({_fmt(res)} reserved, {_fmt(alloc)} "
                       f"allocated) but its largest free block was {_fmt(big)}, short of the {_fmt(req)} asked for",
            "remedy": "let the allocator grow segments instead of splitting them: DISTMEM_TORCH_EXPANDABLE_SEGMENTS=1 "
                      "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) before init(); or allocate the large "
                      "buffers first and keep sizes steady (pad odd shapes to a few buckets)"}


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


def foreign_process(rec: Record, **_: Any) -> Optional[Cause]:
    """Within its plan, but processes outside the job hold bytes on its GPU the plan did not reserve."""
    procs = rec.get("gpu_processes") or []
    others = [p for p in procs if p.get("who") == "other"]
    held = sum(int(p.get("bytes") or 0) for p in others)
    estimated = False
    if not others and any(p.get("who") == "unknown" for p in procs):
        held, estimated = _device_others(rec) or 0, True
    unplanned = held - int(rec.get("foreign_planned_bytes") or 0)
    need, limit = needed_bytes(rec), rec.get("limit_bytes")
    if unplanned < defaults.FOREIGN_MIN_BYTES or (need is not None and limit and need > limit):
        return None
    pids = ", ".join(f"pid {p['pid']} {_fmt(p.get('bytes'))}" for p in sorted(others, key=lambda p: -(p.get("bytes")
                                                                                                      or 0))[:6])
    if estimated:
        pids = ("NVML's pids are of another pid namespace: the device's used memory less this process and the "
                "job's planned ranks")
    free = rec.get("device_free_bytes")
    within = f"within its plan ({_fmt(need)} of {_fmt(limit)})" if need is not None and limit else "the device ran out"
    return {"kind": "foreign_process", "foreign_bytes": held, "unplanned_bytes": unplanned,
            "pids": [p["pid"] for p in others], "over_by_bytes": unplanned,
            "estimated": estimated,
            "message": f"a foreign process: {within}, but "
                       + (f"{plural(len(others), 'process', 'processes')} outside the job" if not estimated
                          else "processes outside the job") + f" held {_fmt(held)} on its GPU ({pids}); the plan reserved "
                       f"{_fmt(rec.get('foreign_planned_bytes') or 0)} for others"
                       + (f" and the device had {_fmt(free)} free" if free is not None else ""),
            "remedy": f"stop those processes, or plan around them: foreign='{_fmt(held)}' (distmem plan --foreign "
                      f"'{_fmt(held)}'), or run on a GPU of its own"}


def wrong_stage(rec: Record, records: Sequence[Record] = (), run_dir: str = "RUN_DIR", **_: Any) -> Optional[Cause]:
    """A pipeline stage needed more than its planned limit: the estimate behind that stage was short.
    The stage's need is the largest of its ranks' records."""
    row = _stage_row(rec)
    if row is None:
        return None
    stage = rec.get("stage")
    mates = [r for r in records if r.get("stage") == stage] or [rec]
    needs = [n for n in (needed_bytes(r) for r in mates) if n is not None]
    limit = row.get("planned_bytes") or rec.get("limit_bytes")
    if not needs or not limit or max(needs) <= limit:
        return None
    need = max(needs)
    est = row.get("demand_bytes")
    hold = would_hold(need)
    short = f"; its estimate {_fmt(est)} was short by {_fmt(need - est)} ({(need - est) / need:.0%})" if est else ""
    others = [r for r in (rec.get("stages") or []) if r.get("stage") != stage]
    return {"kind": "wrong_stage", "stage": stage, "needed_bytes": need, "limit_bytes": limit, "estimate_bytes": est,
            "over_by_bytes": need - limit, "would_hold_bytes": hold,
            "message": f"the plan got stage {stage} wrong: it needed {_fmt(need)} but was planned {_fmt(limit)}{short}"
                       + (f" (the other {plural(len(others), 'stage')} were planned "
                          + ", ".join(_fmt(r.get("planned_bytes")) for r in others) + ")" if others else ""),
            "remedy": f"plan stage {stage} at {_fmt(hold)} (what it needed + {defaults.FROM_REPORT_MARGIN:.0%}): "
                      f"{_command(run_dir, rec)}; or move layers off stage {stage} (--stages / a new partition)"}


#: Every rule, in the order its cause is named.
RULES: Dict[str, Callable[..., Optional[Cause]]] = {
    "wrong_stage": wrong_stage, "over_plan": over_plan, "fragmentation": fragmentation,
    "foreign_process": foreign_process,
}


def diagnose(rec: Record, records: Sequence[Record] = (), run_dir: str = "RUN_DIR",
             rules: Optional[Dict[str, Callable[..., Optional[Cause]]]] = None) -> List[Cause]:
    """Every cause ``rec`` shows (``unexplained`` with its figures when none does)."""
    found = [c for c in ((rule(rec, records=records, run_dir=run_dir)) for rule in (rules or RULES).values()) if c]
    if found:
        return found
    need, limit = needed_bytes(rec), rec.get("limit_bytes")
    return [{"kind": "unexplained", "over_by_bytes": None,
             "message": f"no rule explains it: {_fmt(rec.get('allocated_bytes'))} allocated, "
                        f"{_fmt(rec.get('reserved_bytes'))} reserved, asked for {_fmt(rec.get('request_bytes'))}"
                        + (f", planned {_fmt(limit)}" if limit else "")
                        + (f", the device had {_fmt(rec.get('device_free_bytes'))} free"
                           if rec.get("device_free_bytes") is not None else ""),
             "remedy": "the other ranks on this GPU may have gone over their plans: run with a periodic report "
                       "(distmem.ReportEvery) and read `distmem report`" + (f"; needed {_fmt(need)}" if need else "")}]


def postmortem(records: Sequence[Record], run_dir: str = "RUN_DIR", world_size: Optional[int] = None,
               rules: Optional[Dict[str, Callable[..., Optional[Cause]]]] = None) -> Dict[str, Any]:
    """The page as data: the ranks that ran out (first one first), each with its causes and remedies."""
    recs = sorted(records, key=lambda r: (r.get("time") or 0.0, r.get("rank") or 0))
    size = world_size or max([r.get("world_size") or 0 for r in recs] + [0]) or None
    entries = []
    for r in recs:
        causes = diagnose(r, recs, run_dir, rules)
        entries.append({k: r.get(k) for k in ("rank", "host", "device", "stage", "step", "time", "source", "error",
                                              "limit_bytes", "request_bytes", "allocated_bytes", "reserved_bytes",
                                              "largest_free_bytes", "device_free_bytes", "count", "nvml_note")}
                       | {"needed_bytes": needed_bytes(r), "causes": causes,
                          "layers": (r.get("layers") or {}).get("groups", []),
                          "gpu_processes": [p for p in r.get("gpu_processes") or [] if p.get("who") != "self"]})
    counts: Dict[str, int] = {}
    for e in entries:
        for c in e["causes"]:
            counts[c["kind"]] = counts.get(c["kind"], 0) + 1
    return {"distmem_postmortem": 1, "run_dir": run_dir, "world_size": size, "ranks_out": [e["rank"] for e in entries],
            "first": entries[0]["rank"] if entries else None, "causes": counts, "entries": entries,
            "next_plan": f"distmem plan --from {run_dir}" if entries else None}


def render_text(page: Dict[str, Any]) -> str:
    """The page as text: one paragraph per rank that ran out, first one first."""
    entries = page["entries"]
    if not entries:
        return f"distmem postmortem {page['run_dir']}: no out-of-memory record (no rank wrote RUN_DIR/oom/rank-N.json)\n"
    size = page.get("world_size")
    first = entries[0]
    when = time.strftime("%H:%M:%S", time.localtime(first["time"])) if first.get("time") else "?"
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
        for c in e["causes"]:
            lines.append(f"  cause: {c['message']}")
            lines.append(f"  change: {c['remedy']}")
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
    if page.get("next_plan"):
        lines.append(f"next run planned from this one: {page['next_plan']} (each rank's limit from its observed "
                     f"peak + {defaults.FROM_REPORT_MARGIN:.0%}; what ran out from what it needed)")
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
    if not records:
        return None
    page = postmortem(records, run_dir=run_dir, world_size=report.world_size)
    report.aggregates["postmortem"] = {"run_dir": run_dir, "ranks_out": page["ranks_out"], "first": page["first"],
                                       "causes": page["causes"]}
    for e in page["entries"]:
        c = e["causes"][0]
        report.warnings.append(f"rank {e['rank']} ran out of memory" + (f" at step {e['step']}" if e.get("step")
                                                                          is not None else "")
                               + f": {c['message']}; {c['remedy']} (distmem postmortem {run_dir})")
    return page
