"""The model behind ``distmem top``: every rank of a running job, from the files its reports write.

Pure: it takes a file's text (a report or timeline JSON that ``distmem.report(path=...)`` /
``ReportEvery(path=...)`` writes, or a Prometheus textfile of ``ReportEvery(prometheus=...)``)
and keeps, per rank, the latest planned / current / peak figures with its host and stage, the
imbalance (largest peak over the mean peak, per stage and over the job) and every warning in the
order it first appeared. :func:`render` turns it into the lines of the terminal view; the command
(:mod:`distmem.cli.top`) does the reading, the keys and the screen.

Several files merge by job and rank: a job may write one file (rank 0's gather) or one per host (a
node_exporter folder on each host); a rank's row is the one from the most recently made report of
its job. A job is the file's owner and the job id its writer put in it (``job_id``; a file without
one: its ``run`` label and job size), so another job's rank 0 - another user's above all - never
replaces this job's. Every text a file carries (host names, label values, warnings) is shown with
its control characters escaped (:func:`distmem.untrusted.printable`): a file is anyone's text.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..units import format_bytes
from ..untrusted import owner_name, printable

__all__ = ["RankRow", "Seen", "LiveJob", "ViewState", "SORTS", "parse_report", "parse_prometheus", "parse",
           "render", "imbalance"]

SORTS = ("rank", "peak", "current", "use", "host")


@dataclass
class RankRow:
    """One rank as the latest report saw it. Bytes; None where the report had no figure."""
    rank: int
    host: str = "?"
    stage: Optional[int] = None
    planned: Optional[int] = None   #: bytes the plan gives the rank (its limit)
    current: Optional[int] = None   #: allocator bytes in use
    peak: Optional[int] = None      #: allocator peak (or current, where no peak is kept)
    reserved: Optional[int] = None  #: allocator pool held from the driver
    nvml: Optional[int] = None      #: the process's GPU memory as NVML sees it
    up: bool = True                 #: False: missing from the last report
    step: Optional[int] = None
    made: float = 0.0               #: when its report was made (Unix seconds)
    source: str = ""
    job: str = ""                   #: the job it belongs to (owner and job id): rows merge by job and rank

    @property
    def use(self) -> Optional[float]:
        """Peak over planned (1.0 = at the plan), or None."""
        if self.planned and self.peak is not None:
            return self.peak / self.planned
        return None


@dataclass
class Seen:
    """A warning, with when this view first saw it."""
    text: str
    kind: str
    first_seen: float
    source: str


def parse_report(text: str) -> Tuple[List[RankRow], List[Tuple[str, str, str]], Dict[str, Any]]:
    """Rows, ``(kind, warning, key)`` triples and facts (``world_size``, ``step``, ``made``) of a report JSON."""
    d = json.loads(text)
    if not isinstance(d, dict) or "world_size" not in d:
        raise ValueError("JSON but not a distmem report (no 'world_size')")
    made = _finite(d.get("created"))
    step = None
    timeline = d.get("timeline") or []
    if timeline and isinstance(timeline[-1], dict):
        step = timeline[-1].get("step")
    rows: List[RankRow] = []
    for r in d.get("ranks") or []:
        nv = r.get("nvml_bytes") or {}
        vals = [v for v in nv.values() if v is not None] if isinstance(nv, dict) else []
        peak = r.get("peak_bytes")
        vals = [v for v in vals if _whole(v) is not None]
        peak = r.get("peak_bytes")
        rows.append(RankRow(rank=_rank(r["rank"]), host=printable(r.get("host") or "?", 64), stage=_whole(r.get("stage")),
                            planned=_whole(r.get("limit_bytes")), current=_whole(r.get("current_bytes")),
                            peak=_whole(peak) if peak is not None else _whole(r.get("current_bytes")),
                            reserved=_whole(r.get("reserved_bytes")), nvml=sum(vals) if vals else None,
                            step=_whole(r.get("step")) if r.get("step") is not None else _whole(step), made=made))
    for m in d.get("missing") or []:
        rows.append(RankRow(rank=_rank(m), up=False, step=_whole(step), made=made))
    findings = d.get("findings") or []
    warnings = list(d.get("warnings") or [])
    pairs = []
    for i, w in enumerate(warnings):
        f = findings[i] if i < len(findings) and isinstance(findings[i], dict) else {}
        # The same finding (kind, ranks) in a later report is the same warning with new figures.
        pairs.append((printable(f.get("kind", "warning"), 40), printable(w),
                      f"{f.get('kind')}:{f.get('ranks')}" if f else str(w)))
    agg = d.get("aggregates") if isinstance(d.get("aggregates"), dict) else {}
    return rows, pairs, {"world_size": _rank(d["world_size"]), "step": _whole(step), "made": made,
                         "job_id": printable(agg.get("job_id"), 64) if agg.get("job_id") else None, "run": None}


def _whole(v: Any) -> Optional[int]:
    """A figure as a whole number (bytes, a step, a stage), None where it is not one."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and (not math.isfinite(v) or not v.is_integer()):
        return None
    return int(v) if -2**63 <= v <= 2**63 - 1 else None


def _rank(v: Any) -> int:
    n = _whole(v)
    if n is None or not 0 <= n < 2**31:
        raise ValueError(f"{printable(repr(v), 40)} is not a rank")
    return n


def _finite(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


_PROM_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)\s*$')
_PROM_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_PROM_FIELDS = {"distmem_rank_current_bytes": "current", "distmem_rank_peak_bytes": "peak",
                "distmem_rank_limit_bytes": "planned", "distmem_rank_reserved_bytes": "reserved",
                "distmem_rank_nvml_bytes": "nvml"}


def _unescape(v: str) -> str:
    return v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def parse_prometheus(text: str) -> Tuple[List[RankRow], List[Tuple[str, str, str]], Dict[str, Any]]:
    """Rows, warnings (one per kind with a non-zero count: the textfile keeps counts, not sentences)
    and facts of a textfile :func:`distmem.report.sinks.prometheus.prometheus_text` wrote."""
    rows: Dict[Tuple[str, int], RankRow] = {}
    facts: Dict[str, Any] = {"world_size": None, "step": None, "made": 0.0, "job_id": None, "run": None}
    warnings: List[Tuple[str, str, str]] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m:
            continue
        name, labels_text, value_text = m.group(1), m.group(3) or "", m.group(4)
        labels = {k: printable(_unescape(v), 120) for k, v in _PROM_LABEL.findall(labels_text)}
        try:
            value = float(value_text)
        except ValueError:
            continue
        if not math.isfinite(value) or abs(value) > 2**63 - 1:
            continue
        if labels.get("job_id"):
            facts["job_id"] = labels["job_id"]
        if labels.get("run"):
            facts["run"] = labels["run"]
        if name == "distmem_job_ranks":
            facts["world_size"] = int(value)
        elif name == "distmem_report_step":
            facts["step"] = int(value)
        elif name == "distmem_report_timestamp_seconds":
            facts["made"] = value
        elif name == "distmem_warnings" and value > 0:
            kind = labels.get("kind", "warning")
            warnings.append((kind, f"{int(value)} {kind.replace('_', ' ')} warning(s) in the last report", kind))
        elif name == "distmem_rank_up" or name in _PROM_FIELDS:
            if not labels.get("rank", "").isdigit() or len(labels["rank"]) > 9:
                continue
            run = labels.get("run", "")
            key = (run, int(labels["rank"]))
            row = rows.setdefault(key, RankRow(rank=key[1]))
            if labels.get("host"):
                row.host = labels["host"][:64]
            if labels.get("stage", "").lstrip("-").isdigit():
                row.stage = int(labels["stage"])
            if name == "distmem_rank_up":
                row.up = value >= 1
            else:
                setattr(row, _PROM_FIELDS[name], int(value))
    for row in rows.values():
        row.step, row.made = facts["step"], facts["made"]
        if row.peak is None:
            row.peak = row.current
    return list(rows.values()), warnings, facts


def parse(name: str, text: str) -> Tuple[List[RankRow], List[Tuple[str, str, str]], Dict[str, Any]]:
    """By the file's name: ``.prom`` is a Prometheus textfile, anything else a report JSON."""
    if name.endswith(".prom"):
        return parse_prometheus(text)
    return parse_report(text)


def imbalance(rows: Sequence[RankRow]) -> Optional[float]:
    """Largest peak over the mean peak of the rows that have one (1.0 = even), or None."""
    peaks = [r.peak for r in rows if r.up and r.peak]
    if len(peaks) < 2:
        return None
    mean = sum(peaks) / len(peaks)
    return max(peaks) / mean if mean else None


class LiveJob:
    """Every rank of a job from the files read so far; :meth:`update` with each file that changed."""

    def __init__(self) -> None:
        self.by_source: Dict[str, List[RankRow]] = {}
        self.facts: Dict[str, Dict[str, Any]] = {}
        self.errors: Dict[str, str] = {}
        self.warnings: List[Seen] = []
        self._seen: Dict[Tuple[str, str], Seen] = {}  # (file, finding key) -> its warning
        self.updates = 0

    def update(self, source: str, text: str, now: Optional[float] = None, owner: Optional[int] = None) -> bool:
        """Take a file's new text (``owner``: the file's owner, when known). False (and the error kept
        for the view) when it does not parse: the file's earlier rows stay."""
        now = time.time() if now is None else now
        try:
            rows, warnings, facts = parse(source, text)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            self.errors[source] = f"{type(exc).__name__}: {printable(exc, 120)}"
            return False
        self.errors.pop(source, None)
        job = job_name(facts, owner)
        for r in rows:
            r.source = source
            r.job = job
        self.by_source[source] = rows
        self.facts[source] = facts
        for kind, text_, key in warnings:
            seen = self._seen.get((source, key))
            if seen is None:
                seen = Seen(text_, kind, now, source)
                self._seen[(source, key)] = seen
                self.warnings.append(seen)
            else:
                seen.text = text_  # the same warning, its latest figures
        self.updates += 1
        return True

    def forget(self, source: str) -> None:
        self.by_source.pop(source, None)
        self.facts.pop(source, None)
        self.errors.pop(source, None)

    def rows(self) -> List[RankRow]:
        """One row per job and rank: the one from the most recently made report of that job."""
        best: Dict[Tuple[str, int], RankRow] = {}
        for rows in self.by_source.values():
            for r in rows:
                old = best.get((r.job, r.rank))
                if old is None or (r.made, r.up) > (old.made, old.up):
                    best[(r.job, r.rank)] = r
        return [best[k] for k in sorted(best)]

    def jobs(self) -> List[str]:
        """The jobs seen, in order."""
        return sorted({r.job for rows in self.by_source.values() for r in rows})

    def world_size(self) -> Optional[int]:
        sizes = [f.get("world_size") for f in self.facts.values() if f.get("world_size")]
        return max(sizes) if sizes else None

    def step(self) -> Optional[int]:
        steps = [f.get("step") for f in self.facts.values() if f.get("step") is not None]
        return max(steps) if steps else None

    def made(self) -> float:
        return max([f.get("made") or 0.0 for f in self.facts.values()] or [0.0])

    def to_dict(self) -> Dict[str, Any]:
        rows = self.rows()
        stages = sorted({r.stage for r in rows if r.stage is not None})
        return {"world_size": self.world_size(), "step": self.step(), "made": self.made(),
                "ranks": [dict(asdict(r), use=r.use) for r in rows],
                "hosts": {h: _host_totals([r for r in rows if r.host == h]) for h in sorted({r.host for r in rows})},
                "imbalance": imbalance(rows),
                "stage_imbalance": {str(s): imbalance([r for r in rows if r.stage == s]) for s in stages},
                "warnings": [asdict(w) for w in self.warnings], "errors": dict(self.errors)}


def job_name(facts: Dict[str, Any], owner: Optional[int] = None) -> str:
    """The job a file's rows belong to: its job id (else its ``run`` label and job size), and its
    owner when that is another user."""
    import os

    if facts.get("job_id"):
        name = f"job {facts['job_id']}"
    else:
        name = f"job of {facts.get('world_size') or '?'} rank(s)" + (f" run={facts['run']}" if facts.get("run") else "")
    if owner is not None and owner != os.geteuid():
        name += f" of {owner_name(owner)}"
    return name


def _host_totals(rows: Sequence[RankRow]) -> Dict[str, Any]:
    def total(attr: str) -> Optional[int]:
        vals = [getattr(r, attr) for r in rows if getattr(r, attr) is not None]
        return sum(vals) if vals else None

    peaks = [r.peak for r in rows if r.peak is not None]
    return {"ranks": len(rows), "up": sum(1 for r in rows if r.up), "planned": total("planned"),
            "current": total("current"), "peak_max": max(peaks) if peaks else None, "imbalance": imbalance(rows)}


@dataclass
class ViewState:
    """What the keys change: the sort, its direction, hosts collapsed to one line, the scroll."""
    sort: str = "rank"
    reverse: bool = False
    collapsed: bool = False
    offset: int = 0
    paused: bool = False
    started: float = field(default_factory=time.time)

    def next_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]


# ---------------------------------------------------------------------- rendering

_RESET, _BOLD, _DIM, _RED, _YELLOW, _GREEN, _CYAN, _REV = ("\x1b[0m", "\x1b[1m", "\x1b[2m", "\x1b[31m", "\x1b[33m",
                                                          "\x1b[32m", "\x1b[36m", "\x1b[7m")


def _b(v: Optional[int]) -> str:
    return "-" if v is None else format_bytes(v)


def _bar(use: Optional[float], width: int = 10) -> str:
    if use is None:
        return " " * width
    full = min(width, int(round(min(use, 1.0) * width)))
    return "#" * full + "." * (width - full)


def _key(sort: str):
    def key(r: RankRow) -> Tuple:
        v = {"rank": r.rank, "peak": r.peak, "current": r.current, "use": r.use, "host": r.host}[sort]
        return (v is None, v if v is not None else 0, r.rank)

    return key


_COLS = f"{'':2}{'RANK':>6} {'STAGE':>5} {'PLANNED':>10} {'CURRENT':>10} {'PEAK':>10} {'PEAK/PLAN':>9} {'':10} NVML"


def _row_line(r: RankRow, color: bool) -> str:
    use = r.use
    pct = "-" if use is None else f"{use * 100:.0f}%"
    stage = "-" if r.stage is None else str(r.stage)
    if not r.up:
        text = f"  {r.rank:>6} {stage:>5} {'missing from the last report':<55}"
        return f"{_RED}{text}{_RESET}" if color else text
    text = (f"  {r.rank:>6} {stage:>5} {_b(r.planned):>10} {_b(r.current):>10} {_b(r.peak):>10} {pct:>9} "
            f"{_bar(use)} {_b(r.nvml)}")
    if color and use is not None:
        if use >= 1.0:
            return f"{_RED}{_BOLD}{text}{_RESET}"
        if use >= 0.9:
            return f"{_YELLOW}{text}{_RESET}"
    return text


def _host_line(host: str, rows: Sequence[RankRow], color: bool) -> str:
    t = _host_totals(rows)
    imb = "-" if t["imbalance"] is None else f"{t['imbalance']:.2f}"
    down = "" if t["up"] == t["ranks"] else f", {t['ranks'] - t['up']} missing"
    text = (f"{host}: {t['ranks']} rank(s){down}  planned {_b(t['planned'])}  current {_b(t['current'])}  "
            f"peak max {_b(t['peak_max'])}  imbalance {imb}")
    return f"{_BOLD}{_CYAN}{text}{_RESET}" if color else text


def render(job: LiveJob, state: ViewState, width: int = 120, height: Optional[int] = None, color: bool = False,
           now: Optional[float] = None, keys: bool = True) -> List[str]:
    """The view as lines (no trailing newlines): a header, then per host (sorted by name) a host line
    and, unless collapsed, its ranks grouped by stage and sorted by ``state.sort``; then the
    warnings, newest last. ``height`` limits the rank area (scrolled by ``state.offset``)."""
    now = time.time() if now is None else now
    rows = job.rows()
    hosts = sorted({r.host for r in rows})
    made = job.made()
    ago = f"{max(0.0, now - made):.1f} s ago" if made else "-"
    imb = imbalance(rows)
    stages = sorted({r.stage for r in rows if r.stage is not None})
    stage_imb = ", ".join(f"stage {s} {v:.2f}" for s in stages
                          for v in [imbalance([r for r in rows if r.stage == s])] if v is not None)
    size = job.world_size()
    njobs = len({r.job for r in rows})
    head = (f"distmem top - {len(rows)}" + (f" of {size}" if size and size != len(rows) and njobs == 1 else "")
            + f" rank(s) on {len(hosts)} host(s)" + (f" in {njobs} jobs" if njobs > 1 else "")
            + f" - step {job.step() if job.step() is not None else '-'} - "
            f"report made {ago} - sort {state.sort}{' desc' if state.reverse else ''}"
            + (" - paused" if state.paused else ""))
    imb_line = (f"imbalance {'-' if imb is None else f'{imb:.2f}'} (largest peak / mean peak)"
                + (f"; by stage: {stage_imb}" if stage_imb else ""))
    out = [(f"{_BOLD}{head}{_RESET}" if color else head[:width]), imb_line[:width]]
    if keys:
        out.append("keys: q quit  s sort  r reverse  h hosts collapse  j/k scroll  p pause"[:width])
    body: List[str] = [(f"{_REV}{_COLS}{_RESET}" if color else _COLS)]
    jobs = sorted({r.job for r in rows})
    for job_ in jobs:
        in_job = [r for r in rows if r.job == job_]
        if len(jobs) > 1:  # several jobs in the files: each under its own line, never merged
            line = f"{job_}: {len(in_job)} rank(s)"
            body.append(f"{_BOLD}{line}{_RESET}" if color else line)
        for host in sorted({r.host for r in in_job}):
            mine = [r for r in in_job if r.host == host]
            body.append(_host_line(host, mine, color))
            if state.collapsed:
                continue
            mine.sort(key=_key(state.sort), reverse=state.reverse)
            mine.sort(key=lambda r: (r.stage is None, r.stage or 0))  # stable: grouped by stage, sorted within
            for r in mine:
                body.append(_row_line(r, color))
    warn: List[str] = []
    if job.warnings:
        warn.append(f"{_BOLD}warnings (newest last){_RESET}" if color else "warnings (newest last)")
        for w in job.warnings[-8:]:
            stamp = time.strftime("%H:%M:%S", time.localtime(w.first_seen))
            new = now - w.first_seen < 10
            line = f"  {stamp} [{w.kind}] {w.text}"[:width]
            warn.append(f"{_YELLOW}{line}{_RESET}" if (color and new) else line)
    for src, err in sorted(job.errors.items()):
        warn.append(f"  cannot read {printable(src, 200)}: {printable(err)}"[:width])
    if height is not None:
        room = max(3, height - len(out) - len(warn))
        if len(body) > room:
            state.offset = max(0, min(state.offset, len(body) - room + 1))
            shown = body[:1] + body[1 + state.offset: state.offset + room - 1]
            rest = len(body) - 1 - state.offset - (room - 2)
            shown.append(f"  ... {rest} more line(s): j/k scroll, h collapses hosts" if rest > 0 else "")
            body = shown
        else:
            state.offset = 0
    return out + [b if color else b[:width] for b in body] + warn
