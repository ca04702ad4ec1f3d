"""The next plan from the last run: each rank's (or pipeline stage's) limit from what it was seen to
use, plus a stated margin (:data:`distmem.defaults.FROM_REPORT_MARGIN`).

A step of the plan request (:class:`distmem.plan.request.PlanRequest` ``from_report=``), so every
door gets it: ``distmem plan --from runs/last/report.json``, ``init(from_report=...)``,
``plan_from_env(from_report=...)``. What a rank was seen to use is its allocator peak in the report
(``distmem.report()``/``ReportEvery`` JSON) and, where it ran out of memory, what it needed at the
failing allocation (allocated + asked for, from its ``oom/rank-N.json`` record beside the report).
A pipeline stage takes the largest figure of its ranks. A rank with no figure keeps the estimate's
limit. No limit goes above what the GPU offers the rank (its equal share); a rank that needed more
is named. The plan's ``extras["from_report"]`` lists every rank that changed and by how much.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .. import defaults, untrusted
from ..errors import ConfigError
from ..units import MiB, format_bytes
from ..untrusted import printable
from . import need as need_of

__all__ = ["OOM_FOLDER", "Observed", "read_observed", "read_oom_records", "read_oom_records_noted", "read_report_file",
           "record_folders", "fallback_records_folder", "checked_figures", "observed_from_dicts", "apply_observed",
           "describe_changes", "record_figure", "gpu_share", "changes_for", "balanced_for"]

OOM_FOLDER = "oom"  #: under the run folder: one record per rank that ran out of memory


@dataclass(frozen=True)
class Observed:
    """What a run used: ``ranks`` (rank -> bytes) and ``stages`` (stage -> the largest of its
    ranks), with ``sources`` saying per rank whether the figure is its ``peak`` or, where it ran
    out, what it ``needed``."""

    path: str
    world_size: Optional[int]
    strategy: Optional[str]
    ranks: Dict[int, int] = field(default_factory=dict)
    stages: Dict[int, int] = field(default_factory=dict)
    sources: Dict[int, str] = field(default_factory=dict)
    stage_of: Dict[int, Optional[int]] = field(default_factory=dict)
    ignored: List[str] = field(default_factory=list)  #: files left out and why (another user's, a link...)
    #: the out-of-memory records the figures came from (the changes a capped rank is told are priced on them)
    records: List[Dict[str, Any]] = field(default_factory=list)


def observed_from_dicts(report: Optional[Dict[str, Any]], records: List[Dict[str, Any]], path: str = "") -> Observed:
    """:class:`Observed` from a report's plain data and the out-of-memory records beside it. Every
    figure is checked first (:func:`checked_figures`): ConfigError for one that is not a number of
    bytes a rank could have used."""
    checked_figures(report, records, path)
    ranks: Dict[int, int] = {}
    sources: Dict[int, str] = {}
    stage_of: Dict[int, Optional[int]] = {}
    size = strategy = None
    if report is not None:
        size, strategy = report.get("world_size"), report.get("strategy")
        for row in report.get("ranks") or []:
            rank = row.get("rank")
            peak = row.get("peak_bytes") if row.get("peak_bytes") is not None else row.get("current_bytes")
            if rank is None or peak is None:
                continue
            ranks[int(rank)], sources[int(rank)] = int(peak), "peak"
            stage_of[int(rank)] = row.get("stage")
    for rec in records:
        rank = rec.get("rank")
        figure = record_figure(rec, records)
        if rank is None or figure is None:
            continue
        need, source = figure
        if need > ranks.get(int(rank), 0):
            ranks[int(rank)], sources[int(rank)] = need, source
        stage_of.setdefault(int(rank), rec.get("stage"))
        size = size or rec.get("world_size")
        strategy = strategy or rec.get("strategy")
    stages: Dict[int, int] = {}
    for rank, b in ranks.items():
        s = stage_of.get(rank)
        if s is not None:
            stages[int(s)] = max(stages.get(int(s), 0), b)
    return Observed(path, size, strategy, ranks, stages, sources, stage_of, records=list(records))


def record_figure(rec: Dict[str, Any], records: List[Dict[str, Any]]) -> Optional[Tuple[int, str]]:
    """The bytes a record says its rank needs, and why: where it ran out, its whole step's need
    (:func:`distmem.plan.need.step_need`, not only what it held at the failing allocation); where
    fail fast stopped it, its allocator peak once it had finished a step (a peak from inside its
    first step misses the rest of that step: no figure)."""
    if need_of.ran_out(rec):
        n = need_of.step_need(rec, need_of.peers_of(rec, records))
        return None if n.bytes is None else (int(n.bytes), "needed")
    peak = rec.get("peak_bytes")
    if need_of.stopped(rec) and isinstance(peak, int) and peak > 0 and (rec.get("step") or 0) >= 1:
        return peak, "peak"
    return None


# ---------------------------------------------------------------------- reading (checked)

#: The largest figure a file may give: the largest size distmem takes anywhere.
MAX_BYTES = 2**63 - 1
#: A figure whose limit (with the margin) would be under this is refused: no plan gets a limit under 1 MiB.
MIN_LIMIT_BYTES = MiB
#: The largest out-of-memory record read (one is a few kB: layer groups, processes on the GPU).
MAX_RECORD_BYTES = 4 * 1024**2
#: The largest report read (thousands of ranks with a long timeline fit).
MAX_REPORT_BYTES = 256 * 1024**2
#: A rank number or job size past this is not one.
MAX_RANKS = 2**31 - 1
#: The figures of a record that are bytes (each checked like a report's peak).
RECORD_BYTE_FIELDS = ("allocated_bytes", "request_bytes", "reserved_bytes", "peak_bytes", "limit_bytes",
                      "demand_bytes", "largest_free_bytes", "device_total_bytes", "device_free_bytes", "cap_bytes",
                      "overhead_bytes", "driver_reserved_bytes", "foreign_planned_bytes")


def _bad_bytes(value: Any) -> Optional[str]:
    """Why ``value`` is not a number of bytes (None when it is one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{printable(repr(value), 60)} is not a number"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r} is not a finite number"
    if value < 0:
        return f"{value!r} is negative"
    if value > MAX_BYTES:
        return f"{value!r} is above {MAX_BYTES} bytes (8 EiB), the largest size distmem takes"
    if isinstance(value, float) and not value.is_integer():
        return f"{value!r} is not a whole number of bytes"
    return None


def _bad_whole(value: Any, low: int, high: int) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return f"{printable(repr(value), 60)} is not a whole number from {low} to {high}"
    return None


def checked_figures(report: Optional[Dict[str, Any]], records: List[Dict[str, Any]], path: str = "") -> None:
    """ConfigError naming the file, the rank and the value for a figure the next plan cannot come
    from: not a number (a string, ``NaN``, infinity), negative, above 2**63 - 1 bytes, a rank or a
    job size that is not a whole number in range - or a figure so small that its limit would be
    under 1 MiB (a peak of 0 B: the rank used nothing this plan could size)."""
    where = path or "the report"
    if report is not None:
        for key, low in (("world_size", 1),):
            if report.get(key) is not None and _bad_whole(report.get(key), low, MAX_RANKS):
                raise ConfigError(f"--from {where}: its {key} {_bad_whole(report.get(key), low, MAX_RANKS)}; the file "
                                  "was changed or damaged: write it again with distmem.report(path=...)")
        rows = report.get("ranks") or []
        if not isinstance(rows, list):
            raise ConfigError(f"--from {where}: its 'ranks' is not a list of rows; the file was changed or damaged")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ConfigError(f"--from {where}: row {i} of 'ranks' is not an object; the file was changed or damaged")
            _check_row(row, ("peak_bytes", "current_bytes"), where, f"row {i}")
    for rec in records:
        _check_row(rec, ("allocated_bytes", "request_bytes"), where, "out-of-memory record")


def _check_row(row: Dict[str, Any], fields: tuple, where: str, what: str) -> None:
    rank = row.get("rank")
    if rank is not None and _bad_whole(rank, 0, MAX_RANKS):
        raise ConfigError(f"--from {where}: {what}'s rank {_bad_whole(rank, 0, MAX_RANKS)}; the file was changed "
                          "or damaged: write it again with distmem.report(path=...)")
    stage = row.get("stage")
    if stage is not None and _bad_whole(stage, 0, MAX_RANKS):
        raise ConfigError(f"--from {where}: rank {rank}'s stage {_bad_whole(stage, 0, MAX_RANKS)}; the file was "
                          "changed or damaged")
    for key in fields:
        value = row.get(key)
        if value is None:
            continue
        bad = _bad_bytes(value)
        if bad is None and key != "request_bytes" and value * (1 + defaults.FROM_REPORT_MARGIN) < MIN_LIMIT_BYTES:
            bad = (f"{format_bytes(int(value))}, so small that a limit from it would be under 1 MiB (the rank "
                   "used nothing this plan could size)")
        if bad is not None:
            raise ConfigError(f"--from {where}: rank {rank}'s {key} {bad}; plan from the estimate (leave out "
                              "--from / from_report=) or give the report of a run that trained")


def record_folders(run_dir: str) -> List[str]:
    """Where the out-of-memory records of ``run_dir`` are: its ``oom/``, and the folder of this
    user's own they go to when that one belongs to someone else (:func:`fallback_records_folder`)."""
    return [os.path.join(run_dir, OOM_FOLDER), fallback_records_folder(run_dir)]


def fallback_records_folder(run_dir: str) -> str:
    """This user's own folder for the records of ``run_dir`` when ``RUN_DIR/oom`` is another user's:
    under ``~/.cache/distmem/runs/`` (:func:`distmem.untrusted.home_folder`), named by the run folder."""
    import hashlib

    key = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    return untrusted.home_folder("runs", key, OOM_FOLDER)


def read_report_file(path: str) -> Dict[str, Any]:
    """A report JSON read with the checks of :mod:`distmem.untrusted` (no link, no FIFO, bounded,
    this user's own in a folder others can write); ConfigError saying what is wrong with it."""
    try:
        report = untrusted.read_json(path, max_bytes=MAX_REPORT_BYTES, what="the report")
    except untrusted.Unsafe as exc:
        raise ConfigError(f"--from {printable(exc, 600)}; give the report distmem.report(path=...) wrote, from a "
                          "folder of your own") from None
    except ConfigError as exc:
        raise ConfigError(f"--from {printable(exc, 600)}; give the report distmem.report(path=...) or "
                          "ReportEvery(path=...) wrote") from None
    except OSError as exc:
        raise ConfigError(f"--from {path!r} cannot be read ({exc.strerror or exc})") from None
    if not isinstance(report, dict) or "world_size" not in report:
        raise ConfigError(f"--from {path!r} is not a distmem report (no 'world_size'); give the report "
                          "distmem.report(path=...) or ReportEvery(path=...) wrote")
    return report


def read_observed(path: str) -> Observed:
    """The figures of a report JSON (``runs/last/report.json``) or of a run folder (its
    ``report.json`` and ``oom/``); the records of ``oom/`` beside a report are read too. Every
    file is read with the checks of :mod:`distmem.untrusted`; records that are not this user's are
    left out (``Observed.ignored`` says which and why)."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    report_file = os.path.join(path, "report.json") if os.path.isdir(path) else path
    report = None
    if os.path.lexists(report_file):
        report = read_report_file(report_file)
    elif not os.path.isdir(path):
        raise ConfigError(f"--from {path!r} does not exist; give the last run's report (runs/last/report.json) or "
                          "its run folder")
    records, ignored = read_oom_records_noted(folder)
    if report is None and not records:
        raise ConfigError(f"--from {path!r}: the folder holds neither report.json nor oom/ records of this user"
                          + (f" ({len(ignored)} ignored: {'; '.join(ignored[:3])})" if ignored else "")
                          + "; give the last run's report file")
    observed = observed_from_dicts(report, records, path)
    observed.ignored.extend(ignored)
    return observed


def read_oom_records(run_dir: str) -> List[Dict[str, Any]]:
    """Every rank's out-of-memory record of ``run_dir`` (:func:`read_oom_records_noted`), by rank."""
    return read_oom_records_noted(run_dir)[0]


def read_oom_records_noted(run_dir: str) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Every rank's out-of-memory record in ``run_dir``'s record folders (:func:`record_folders`), by
    rank, and a line for each file left out and why: the one reader of what
    :mod:`distmem.observe.oom_record` writes (here, the earlier stage, so that the plan and the
    post-mortem both read it). Each file is read with the checks of :mod:`distmem.untrusted` (a
    link, a FIFO, a file over 4 MiB, another user's file - or another user's ``oom/`` - in a folder
    others can write: left out, never followed, never blocking); a record must be a JSON object of a
    rank (``distmem_oom``, a whole ``rank``) whose byte figures are numbers of bytes."""
    out: Dict[Tuple[Any, Any], Dict[str, Any]] = {}
    ignored: List[str] = []
    for where in record_folders(run_dir):
        try:
            with untrusted.folder(where, what="the out-of-memory records' folder") as f:
                for name in f.names():
                    if not (name.startswith("rank-") and name.endswith(".json")):
                        continue
                    try:
                        data = f.read_json(name, max_bytes=MAX_RECORD_BYTES, what="the record")
                    except (ConfigError, OSError) as exc:
                        ignored.append(printable(str(exc), 300))
                        continue
                    why = _bad_record(data)
                    if why is not None:
                        ignored.append(f"{printable(os.path.join(where, name), 200)}: {why}")
                        continue
                    out.setdefault((data.get("rank"), data.get("pid")), data)
        except FileNotFoundError:
            continue
        except (untrusted.Unsafe, OSError) as exc:
            ignored.append(printable(str(exc), 300))
    records = sorted(out.values(), key=lambda r: (r.get("rank") is None, r.get("rank")))
    return records, ignored


def _bad_record(data: Any) -> Optional[str]:
    """Why ``data`` is not an out-of-memory record distmem can use (None when it is one)."""
    if not isinstance(data, dict) or not data.get("distmem_oom"):
        return "not an out-of-memory record (no 'distmem_oom')"
    bad = _bad_whole(data.get("rank"), 0, MAX_RANKS)
    if bad is not None:
        return f"its rank {bad}"
    for key in ("world_size", "stage", "pid"):
        if data.get(key) is not None and _bad_whole(data.get(key), 0, MAX_RANKS):
            return f"its {key} {_bad_whole(data.get(key), 0, MAX_RANKS)}"
    for key in RECORD_BYTE_FIELDS:
        if data.get(key) is not None and _bad_bytes(data[key]) is not None:
            return f"its {key} {_bad_bytes(data[key])}"
    return None


def _ceil_mib(n: float) -> int:
    return -(-int(n) // MiB) * MiB


def apply_observed(plan: Any, observed: Observed, ctx: Any = None, margin: Optional[float] = None) -> Any:
    """Re-limit ``plan``'s ranks from ``observed`` (in place; returns the plan): figure x (1 + margin),
    in whole MiB, never above the rank's share of its GPU (:func:`gpu_share`). A pipeline rank takes
    its stage's figure; a rank with no figure keeps its limit. A rank whose figure does not fit its
    share keeps the share and is told which changes would fit, each with its figure
    (:func:`changes_for`). Records everything in ``plan.extras["from_report"]``."""
    margin = defaults.FROM_REPORT_MARGIN if margin is None else float(margin)
    if not 0 <= margin <= 10:
        raise ConfigError(f"from_margin={margin!r}: give the margin over the observed peak as a ratio, e.g. 0.1 for "
                          "10%")
    by_stage = plan.strategy == "pipeline" and bool(observed.stages)
    same_job = observed.world_size in (None, plan.world_size)
    changed: List[Dict[str, Any]] = []
    kept: List[int] = []
    capped: List[Dict[str, Any]] = []
    rows = {r.get("stage"): r for r in ((plan.extras.get("pipeline") or {}).get("stages") or [])}
    wanted: Dict[int, Tuple[int, int, str]] = {}  # rank -> (limit wanted, figure, source)
    for a in plan.allocations:
        figure = source = None
        if by_stage and a.stage is not None and a.stage in observed.stages:
            figure, source = observed.stages[a.stage], f"stage {a.stage}"
        elif same_job and a.rank in observed.ranks:
            figure, source = observed.ranks[a.rank], observed.sources.get(a.rank, "peak")
        if figure is None or len(a.devices) != 1:
            kept.append(a.rank)
            continue
        wanted[a.rank] = (_ceil_mib(figure * (1 + margin)), figure, source)
    shares = gpu_share(plan, wanted, ctx)
    for a in plan.allocations:
        if a.rank not in wanted:
            continue
        new, figure, source = wanted[a.rank]
        d = a.devices[0]
        share = shares.get(a.rank)
        if share is not None and new > share:
            capped.append({"rank": a.rank, "stage": a.stage, "wanted_bytes": new, "share_bytes": share,
                           "given_bytes": share,
                           "figure_bytes": figure, "source": source})
            new = capped[-1]["given_bytes"]
        old = d.planned_bytes
        if new == old:
            kept.append(a.rank)
            continue
        d.planned_bytes = new
        a.breakdown["planned_bytes"] = new
        a.breakdown["observed_bytes"] = figure
        if a.demand_bytes is not None:
            a.breakdown["headroom_bytes"] = new - a.demand_bytes
        a.headroom = margin
        why = "its share of the GPU" if capped and capped[-1]["rank"] == a.rank else f"+ {margin:.0%}"
        a.notes.append(f"limit {format_bytes(old)} -> {format_bytes(new)} from the last run ({source} "
                       f"{format_bytes(figure)}; {why})")
        changed.append({"rank": a.rank, "stage": a.stage, "old_bytes": old, "new_bytes": new, "observed_bytes": figure,
                        "source": source, "change_bytes": new - old})
        if a.stage in rows and by_stage:
            rows[a.stage]["planned_bytes"] = new
    for c in capped:
        c["changes"] = changes_for(c, observed, margin)
    balanced_for(plan, capped, shares, changed, margin)
    changed.sort(key=lambda c: c["rank"])
    plan.extras["from_report"] = {"path": observed.path, "margin": margin, "changed": changed, "kept": sorted(kept),
                                  "capped": capped, "report_world_size": observed.world_size}
    if not same_job and not by_stage:
        plan.warnings.append(f"the report at {observed.path} is of a job of {observed.world_size} ranks, this one has "
                             f"{plan.world_size}: ranks are planned from the estimate")
    for c in capped:
        fits = [x for x in c["changes"] if x.get("fits")]
        plan.warnings.append(
            f"rank {c['rank']} needed {format_bytes(c['figure_bytes'])} last run ({format_bytes(c['wanted_bytes'])} "
            f"with the margin) but its share of the GPU is {format_bytes(c['share_bytes'])}: planned "
            f"{format_bytes(c['given_bytes'])}, it will run out again unless the job changes: "
            + ("; ".join(x["text"] + (" (fits)" if x.get("fits") else "") for x in (fits or c["changes"])[:4])
               if c["changes"] else "run fewer ranks per GPU, a smaller micro-batch, recompute, or more stages"))
    return plan


def balanced_for(plan: Any, capped: List[Dict[str, Any]], shares: Dict[int, int], changed: List[Dict[str, Any]],
                 margin: float) -> None:
    """Where the change that fits a capped rank is to balance the batch, its peers (the ranks of its
    stage) will take their share of that batch: none is planned below what the balanced step needs
    (+ ``margin``), within its share - their own peaks were of the smaller batch they got."""
    for c in capped:
        fit = next((x for x in c.get("changes") or [] if x.get("fits")), None)
        if fit is None or fit["change"] != "balance_batch":
            continue
        floor = _ceil_mib(fit["need_bytes"] * (1 + margin))
        c["balanced_bytes"] = floor
        for a in plan.allocations:
            if a.stage != c.get("stage") or len(a.devices) != 1 or a.rank == c["rank"]:
                continue
            d = a.devices[0]
            new = min(floor, shares.get(a.rank, floor))
            if d.planned_bytes >= new:
                continue
            old = d.planned_bytes
            d.planned_bytes = a.breakdown["planned_bytes"] = new
            a.notes.append(f"limit {format_bytes(old)} -> {format_bytes(new)}: rank {c['rank']}'s batch balanced over "
                           f"the ranks needs about {format_bytes(fit['need_bytes'])} each")
            entry = next((x for x in changed if x["rank"] == a.rank), None)
            if entry is None:
                changed.append({"rank": a.rank, "stage": a.stage, "old_bytes": old, "new_bytes": new,
                                "observed_bytes": fit["need_bytes"], "source": "the balanced batch",
                                "change_bytes": new - old})
            else:
                entry.update(new_bytes=new, change_bytes=new - entry["old_bytes"], observed_bytes=fit["need_bytes"],
                             source=f"its {entry['source']} {format_bytes(entry['observed_bytes'])}; the balanced "
                                    "batch")


def gpu_share(plan: Any, wanted: Dict[int, Tuple[int, int, str]], ctx: Any) -> Dict[int, int]:
    """The most each rank may be planned (rank -> bytes; absent where ``ctx`` cannot say). Data
    parallel: the limit the job stated per rank (``limit=``), else the GPU's equal share - what one
    rank leaves unused is not another's. Pipeline (per-stage limits follow demand): what the GPU
    offers its ranks together less what the other ranks on it are planned (their new figure where
    they have one), in stage order."""
    out: Dict[int, int] = {}
    if ctx is None:
        return out
    if plan.strategy != "pipeline":
        stated = (plan.options or {}).get("limit") is not None
        for a in plan.allocations:
            if len(a.devices) == 1:
                share = a.devices[0].planned_bytes if stated else _share(ctx, a.devices[0])
                if share is not None:
                    out[a.rank] = share
        return out
    on_gpu: Dict[str, List[Any]] = {}
    for a in plan.allocations:
        if len(a.devices) == 1:
            d = a.devices[0]
            on_gpu.setdefault(d.uuid or str(d.index), []).append(a)
    for mates in on_gpu.values():
        offer = _offer(ctx, mates[0].devices[0], len(mates))
        if offer is None:
            continue
        for a in mates:
            others = sum(wanted[m.rank][0] if m.rank in wanted else m.devices[0].planned_bytes
                         for m in mates if m is not a)
            out[a.rank] = max(offer - others, 0) // MiB * MiB
    return out


def changes_for(capped: Dict[str, Any], observed: Observed, margin: float) -> List[Dict[str, Any]]:
    """What would let a capped rank's step train within its share, each with its figure: priced on
    its out-of-memory record where it has one (:func:`distmem.plan.need.changes_for_need`)."""
    rec = next((r for r in observed.records if r.get("rank") == capped["rank"] and need_of.ran_out(r)), None)
    if rec is None:
        return []
    mine = dict(rec, limit_bytes=capped["share_bytes"])
    peers = need_of.peers_of(rec, observed.records)
    n = need_of.step_need(rec, peers)
    return [c for c in need_of.changes_for_need(mine, n, peers, margin) if c["change"] != "limit"]


def _gpu_of(ctx: Any, slot: Any) -> Any:
    gpus = [g for host in (ctx.host_gpus or []) for g in host] + list(getattr(ctx.inventory, "gpus", []))
    gpu = next((g for g in gpus if slot.uuid and g.uuid == slot.uuid), None)
    if gpu is None:
        gpu = next((g for g in gpus if g.total_bytes == slot.total_bytes), None)
    return gpu


def _offer(ctx: Any, slot: Any, k: int) -> Optional[int]:
    gpu = _gpu_of(ctx, slot)
    return None if gpu is None else max(int(ctx.budget.offered(gpu, k)), 0)


def _share(ctx: Any, slot: Any) -> Optional[int]:
    """What the GPU of ``slot`` offers each of the ranks sharing it (None where ``ctx`` cannot say)."""
    if ctx is None:
        return None
    gpu = _gpu_of(ctx, slot)
    if gpu is None:
        return None
    return int(ctx.budget.share_or_zero(gpu, max(slot.shared_by, 1))) or None


def describe_changes(plan: Any) -> List[str]:
    """One line per rank the last run re-planned (and one for those that kept the estimate)."""
    info = plan.extras.get("from_report")
    if not info:
        return []
    lines = [f"from {info['path']}: limits are the observed peak + {info['margin']:.0%} "
             f"({len(info['changed'])} changed, {len(info['kept'])} kept)"]
    for c in info["changed"][:256]:
        sign = "+" if c["change_bytes"] > 0 else "-"
        lines.append(f"  rank {c['rank']}" + (f" stage {c['stage']}" if c.get("stage") is not None else "")
                     + f": {format_bytes(c['old_bytes'])} -> {format_bytes(c['new_bytes'])} ({sign}"
                     f"{format_bytes(abs(c['change_bytes']))}; {c['source']} {format_bytes(c['observed_bytes'])})")
    if info["kept"]:
        lines.append(f"  kept (no figure, or unchanged): ranks {', '.join(map(str, info['kept'][:32]))}"
                     + (" ..." if len(info["kept"]) > 32 else ""))
    return lines
