"""One rank's out-of-memory record: what it held, what it asked for, and who else was on its GPU.

On an out-of-memory error each rank writes ``RUN_DIR/oom/rank-N.json`` (atomically, 0600 in a 0700
folder of this user's, no link followed, nothing done by name; where ``RUN_DIR/oom`` is another
user's, in this user's own folder for the run instead): the step, the plan's limit, the allocator's allocated / reserved bytes
and its largest free block (fragmentation), the live tensors grouped by the layer that made them,
and every process NVML lists on the rank's GPU. ``distmem postmortem RUN_DIR`` merges the records
(:mod:`distmem.report.postmortem`). The hooks that call :func:`write_record` (torch's
out-of-memory observer, the exception hook, the guard) live in :mod:`distmem.guard.oom`.

The allocator is read through a small backend object (:class:`TorchAllocator` on real torch; tests
pass a fake with the same methods), so every part of a record is built and checked on a CPU.
"""
from __future__ import annotations

import collections
import contextlib
import json
import linecache
import os
import re
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .. import session, settings, untrusted
from ..console import say
from ..plan.from_report import MAX_RECORD_BYTES, OOM_FOLDER, fallback_records_folder, read_oom_records

__all__ = ["RECORD_VERSION", "OOM_FOLDER", "TorchAllocator", "note_step", "note_layers", "note_estimate",
           "use_allocator", "batch_units", "request_from_text", "largest_free_block", "layer_groups", "build_record",
           "write_record", "record_path", "read_records", "current_step", "forget", "STEP_HISTORY", "KINDS"]

RECORD_VERSION = 1
#: The folder of the records inside the run folder.

_lock = threading.Lock()
#: Steps kept in a record's ``steps`` (the last ones, oldest first).
STEP_HISTORY = 64
#: ``kind`` of a record: ``oom`` (this rank ran out of memory) or ``stopped`` (another rank failed and
#: fail fast stopped this one: what it held then, for the post-mortem's comparison with its peers).
KINDS = ("oom", "stopped")
_state: Dict[str, Any] = {"step": None, "layers": None, "steps": collections.deque(maxlen=STEP_HISTORY),
                          "estimate": None, "allocator": None}

_UNITS = {"b": 1, "bytes": 1, "kib": 1024, "kb": 1024, "mib": 1024**2, "mb": 1024**2, "gib": 1024**3,
          "gb": 1024**3, "tib": 1024**4, "tb": 1024**4}
_TRIED = re.compile(r"tried to allocate\s+([0-9.]+)\s*([kmgt]i?b|bytes|b)\b", re.I)
_TF_SHAPE = re.compile(r"oom when allocating tensor with shape\s*\[([0-9, ]*)\]\s*and type\s+(\w+)", re.I)
_TF_DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
                   "int32": 4, "int64": 8, "int8": 1, "uint8": 1, "int16": 2, "bool": 1, "complex64": 8}


def note_step(step: Optional[int], batch: Any = None) -> None:
    """Tell the record which training step starts now (a hand-written loop calls it at the top of
    each step) and, with ``batch``, what this rank's step is fed: the batch itself (its first
    tensor's leading dimension is the samples, its element count the size the step's activations
    follow: tokens for a language model's ``(batch, sequence)`` ids) or a number of samples.

    Where the allocator runs it also books, in the record's ``steps``, what the allocator held as the
    step starts and its peak so far (one statistics read: the post-mortem prices the failing step
    from the steps before it, and sees memory that grows from step to step)."""
    _state["step"] = None if step is None else int(step)
    if step is None:
        return
    point: Dict[str, Any] = {"step": int(step), "time": time.time()}
    point.update(batch_units(batch))
    if _state["estimate"] is not None and point.get("samples"):
        _price(int(point["samples"]))
    figures = _allocator_now()
    if figures is not None:
        point.update(figures)
    _state["steps"].append(point)


def note_estimate(estimate: Any) -> None:
    """The estimate of this rank's model (``distmem.estimate(model, ...)``): a record prices its
    failing step with it at the batch :func:`note_step` was given (``estimate.train_bytes``), and
    groups live tensors by its layers (as :func:`note_layers`). None forgets it."""
    _state["estimate"] = estimate
    _state["priced"] = {}
    if estimate is not None and getattr(estimate, "layers", None):
        b = int(getattr(estimate, "batch_size", 0) or 0)
        note_layers([{"name": r.name, "total_bytes": r.state_bytes + r.activation_bytes(b)} for r in estimate.layers])


def forget() -> None:
    """Forget the noted step, the steps before it and the estimate (a new job in this process: tests)."""
    _state["step"] = None
    _state["steps"].clear()
    _state["estimate"] = None
    _state["priced"] = {}


def use_allocator(allocator: Any) -> None:
    """The allocator :func:`note_step` reads (the post-mortem hooks' own: :mod:`distmem.guard.oom` sets it)."""
    _state["allocator"] = allocator


def batch_units(batch: Any) -> Dict[str, int]:
    """``samples`` (the leading dimension of a batch's first tensor, or the number given) and
    ``elements`` (that tensor's element count) of what a step is fed; {} where neither can be read."""
    if batch is None:
        return {}
    if isinstance(batch, bool):
        return {}
    if isinstance(batch, int):
        return {"samples": batch, "elements": batch} if batch > 0 else {}
    first = _first_tensor(batch, 0)
    if first is None:
        return {}
    shape = tuple(int(d) for d in getattr(first, "shape", ()) if d is not None)
    if not shape:
        return {}
    n = 1
    for d in shape:
        n *= d
    return {"samples": shape[0], "elements": n}


def _first_tensor(batch: Any, depth: int) -> Any:
    if depth > 4:
        return None
    if hasattr(batch, "shape") and getattr(batch, "shape", None) is not None and len(batch.shape) > 0:
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def _device() -> Optional[int]:
    plan = session.state.plan
    mine = plan.mine if plan is not None else None
    return mine.devices[0].index if mine is not None and mine.devices else None


def _allocator_now() -> Optional[Dict[str, int]]:
    """What the allocator holds now on this rank's device: allocated, reserved, its peak so far."""
    alloc, dev = _state["allocator"], _device()
    if alloc is None or dev is None:
        return None
    try:
        if not alloc.initialized():
            return None
        st = alloc.memory_stats(dev)
    except Exception:  # noqa: BLE001 - a step without figures beats a failed step
        return None
    return {"allocated_bytes": int(st.get("allocated_bytes.all.current", 0)),
            "reserved_bytes": int(st.get("reserved_bytes.all.current", 0)),
            "peak_bytes": int(st.get("allocated_bytes.all.peak", 0))}


def _price(samples: int) -> None:
    """The noted estimate's training-step peak at ``samples`` and at halves of it, computed once per
    batch size at the top of a step (never inside an out-of-memory callback: the estimator replays
    the step on the meta device, which needs autograd on)."""
    priced = _state.setdefault("priced", {})
    if samples in priced:
        return
    est = _state["estimate"]
    sizes = sorted({max(samples >> i, 1) for i in range(8)}, reverse=True)
    try:
        priced[samples] = {"points": [[s, int(est.train_bytes(s))] for s in sizes]}
    except Exception as exc:  # noqa: BLE001 - an estimate loaded from JSON cannot be replayed
        priced[samples] = {"points": [], "error": f"{type(exc).__name__}: {exc}"[:300]}


def _estimate_points(samples: Optional[int]) -> Optional[Dict[str, Any]]:
    """What the record says of the noted estimate: its batch, method, state, and the step's peak
    at this step's samples and halves of it (the post-mortem's figure for the whole step and for
    smaller micro-batches), as :func:`note_step` priced them."""
    est = _state["estimate"]
    if est is None:
        return None
    out: Dict[str, Any] = {"batch_size": getattr(est, "batch_size", None), "method": getattr(est, "method", None),
                           "state_bytes": getattr(est, "state_bytes", None), "points": []}
    out.update((_state.get("priced") or {}).get(int(samples or 0), {}))
    return out


def _in_backward() -> Optional[bool]:
    import sys

    torch = sys.modules.get("torch")
    task = getattr(getattr(torch, "_C", None), "_current_graph_task_id", None)
    if task is None:
        return None
    try:
        return int(task()) >= 0
    except Exception:  # noqa: BLE001
        return None


def note_layers(rows: Sequence[Dict[str, Any]]) -> None:
    """The estimate's per-layer rows (``name`` and ``total_bytes``, as ``distmem estimate --per-layer
    --json`` writes them) the record groups live tensors against."""
    _state["layers"] = [dict(r) for r in rows]


def current_step() -> Optional[int]:
    """The step :func:`note_step` was told, else the last periodic report's step, else None."""
    if _state["step"] is not None:
        return _state["step"]
    timeline = session.state.extra.get("timeline") or []
    if timeline and isinstance(timeline[-1], dict):
        return timeline[-1].get("step")
    return None


def request_from_text(text: str) -> Optional[int]:
    """The bytes an error message says were asked for: torch's ``Tried to allocate 2.00 GiB``,
    TensorFlow's ``OOM when allocating tensor with shape[64,1024] and type float``; None otherwise."""
    m = _TRIED.search(text or "")
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    m = _TF_SHAPE.search(text or "")
    if m:
        dims = [int(d) for d in m.group(1).replace(" ", "").split(",") if d]
        n = 1
        for d in dims:
            n *= d
        return n * _TF_DTYPE_BYTES.get(m.group(2).lower(), 4)
    return None


class TorchAllocator:
    """torch's caching allocator as the record reads it (``torch.cuda.memory_stats``,
    ``torch.cuda.memory_snapshot``) and the out-of-memory observer it offers."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def initialized(self) -> bool:
        return bool(self.torch.cuda.is_available() and self.torch.cuda.is_initialized())

    def memory_stats(self, device: int) -> Dict[str, Any]:
        return dict(self.torch.cuda.memory_stats(device))

    def segments(self) -> List[Dict[str, Any]]:
        """Every segment of every device (``device``, ``total_size``, ``blocks`` with ``size``, ``state``
        and, where the allocator records history, ``frames``)."""
        return list(self.torch.cuda.memory_snapshot())

    def attach(self, observer: Callable[[int, int, int, int], None]) -> bool:
        """Call ``observer(device, requested, cap or total, free on the device)`` on every allocator
        out-of-memory error (inside the guard or not); queued until CUDA starts, so it never starts it."""
        attach = getattr(self.torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        self.torch.cuda._lazy_call(lambda: attach(observer))
        return True


def largest_free_block(segments: Sequence[Dict[str, Any]], device: Optional[int] = None) -> Optional[int]:
    """The largest block the allocator holds free (``inactive``) on ``device``: the largest request it
    could serve without asking the driver; None without segments."""
    sizes = [int(b.get("size", 0)) for s in segments if device is None or s.get("device") == device
             for b in s.get("blocks", []) if b.get("state") == "inactive"]
    return max(sizes) if sizes else (0 if segments else None)


_LIBRARY = ("/torch/", "/site-packages/", "/dist-packages/", "/tensorflow/", "/keras/")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # distmem's own frames


def _user_frames(frames: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    stdlib = os.path.dirname(os.__file__)
    return [f for f in frames if f.get("filename") and not str(f["filename"]).startswith(("<", stdlib, _PACKAGE))
            and not any(part in str(f["filename"]) for part in _LIBRARY)]


def _match(line: str, names: Sequence[str]) -> Optional[str]:
    """The estimate's layer a source line calls (``x = self.conv1(x)`` -> ``conv1``): the full
    dotted name, else its last part as a whole word."""
    for name in names:
        if name and name in line:
            return name
    for name in names:
        tail = name.rsplit(".", 1)[-1]
        if tail and re.search(r"\b" + re.escape(tail) + r"\b", line):
            return name
    return None


def layer_groups(segments: Sequence[Dict[str, Any]], layers: Optional[Sequence[Dict[str, Any]]],
                 device: Optional[int] = None, line_of: Callable[[str, int], str] = linecache.getline,
                 top: int = 12) -> Dict[str, Any]:
    """Live blocks on ``device`` grouped by the layer that made them: the innermost frame of the
    allocator's history outside torch, TensorFlow and distmem, matched against the estimate's layer
    names through its source line. Blocks without history (torch records it only after
    ``torch.cuda.memory._record_memory_history()``) or whose line names no layer of the estimate are
    grouped as ``unknown`` with the reason; nothing is guessed. Returns ``groups`` (largest first:
    ``layer``, ``bytes``, ``blocks``, ``estimate_bytes`` where the estimate has the row, ``where``),
    ``unknown_bytes`` and ``history`` (whether any block carried frames)."""
    names = [str(r.get("name")) for r in (layers or []) if r.get("name")]
    est = {str(r.get("name")): r.get("total_bytes") for r in (layers or []) if r.get("name")}
    groups: Dict[str, Dict[str, Any]] = {}
    history = False
    unknown = {"no_history": 0, "unmatched": 0}
    for s in segments:
        if device is not None and s.get("device") != device:
            continue
        for b in s.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            size = int(b.get("requested_size") or b.get("size") or 0)
            frames = b.get("frames") or []
            if not frames:
                unknown["no_history"] += size
                continue
            history = True
            user = _user_frames(frames)
            layer, where = None, None
            for f in user:
                line = line_of(str(f["filename"]), int(f.get("line") or 0)) or ""
                layer = _match(line, names) if names else None
                if layer is not None:
                    where = f"{os.path.basename(str(f['filename']))}:{f.get('line')} {line.strip()[:80]}"
                    break
            if layer is None:
                unknown["unmatched"] += size
                if user:  # still say where it came from
                    f = user[0]
                    key = f"unknown ({f.get('name')} at {os.path.basename(str(f['filename']))}:{f.get('line')})"
                    g = groups.setdefault(key, {"layer": key, "bytes": 0, "blocks": 0, "estimate_bytes": None,
                                                "where": None})
                    g["bytes"] += size
                    g["blocks"] += 1
                continue
            g = groups.setdefault(layer, {"layer": layer, "bytes": 0, "blocks": 0, "estimate_bytes": est.get(layer),
                                          "where": where})
            g["bytes"] += size
            g["blocks"] += 1
    ordered = sorted(groups.values(), key=lambda g: -g["bytes"])
    if unknown["no_history"]:
        ordered.append({"layer": "unknown (the allocator kept no history: call "
                                 "torch.cuda.memory._record_memory_history() at start to group by layer)",
                        "bytes": unknown["no_history"], "blocks": None, "estimate_bytes": None, "where": None})
    rest = ordered[top:]
    ordered = ordered[:top]
    if rest:
        ordered.append({"layer": f"{len(rest)} more groups", "bytes": sum(g["bytes"] for g in rest), "blocks": None,
                        "estimate_bytes": None, "where": None})
    return {"groups": ordered, "unknown_bytes": unknown["no_history"] + unknown["unmatched"], "history": history,
            "estimate_layers": len(names)}


def _plan_layers(plan: Any) -> Optional[List[Dict[str, Any]]]:
    """Layer names (and bytes where known) of the estimate behind the plan."""
    if _state["layers"]:
        return list(_state["layers"])
    for key in ("pipeline", "model"):
        part = ((plan.extras.get(key) or {}).get("partition") if plan is not None else None) or {}
        names = [n for p in part.get("parts", []) for n in p.get("layers", [])]
        if names:
            return [{"name": n} for n in names]
    return None


def _stage_rows(plan: Any) -> List[Dict[str, Any]]:
    pipe = (plan.extras.get("pipeline") or {}) if plan is not None else {}
    return [dict(r) for r in pipe.get("stages", [])]


def _gpu_processes(plan: Any, devices: Sequence[int]) -> Tuple[List[Dict[str, Any]], str]:
    """Every process NVML lists on the rank's planned GPUs: pid, bytes, and whose it is (this rank,
    another rank of the job, or another process). NVML through :mod:`distmem.discover` only."""
    inv = session.state.inventory
    if inv is None or not inv.real:
        return [], "no GPU seen by NVML (dry run or CPU)"
    from ..discover import gpus as discover_gpus
    from ..discover.nvml import nvml_error

    me = os.getpid()
    job = {v.pid: v.rank for v in (session.state.layout.views if session.state.layout is not None else []) if v.pid}
    out: List[Dict[str, Any]] = []
    note = nvml_error()
    for g in discover_gpus.with_live_processes([g for g in inv.gpus if g.index in devices]):
        holders = g.holders()
        mapped = me in holders or not holders
        if not mapped:  # NVML lists pids of another pid namespace (a container): whose is whose is unknown
            note = (f"NVML lists {len(holders)} processes on GPU {g.index} but not this one (pid {me}): its pids "
                    "are of another pid namespace, so none is called foreign")
        for pid, used in holders.items():
            who = ("self" if pid == me else (f"rank {job[pid]}" if pid in job else "other")) if mapped else "unknown"
            out.append({"device": g.index, "uuid": g.uuid, "pid": pid, "bytes": used, "who": who})
    return out, note


def build_record(*, source: str, error: str = "", request_bytes: Optional[int] = None, device: Optional[int] = None,
                 cap_bytes: Optional[int] = None, device_free_bytes: Optional[int] = None,
                 allocator: Any = None, kind: str = "oom") -> Dict[str, Any]:
    """This rank's record now (plain data). ``source``: what saw the error (``torch-allocator``,
    ``exception``, ``guard``, ``native-cap``, ``stopped``); ``cap_bytes``/``device_free_bytes``: what
    torch's observer passes (its cap, or the device total, and what the driver had free); ``kind``:
    one of :data:`KINDS`."""
    plan = session.state.plan
    mine = plan.mine if plan is not None else None
    devices = [d.index for d in mine.devices] if mine is not None else []
    dev = device if device is not None else (devices[0] if devices else None)
    rec: Dict[str, Any] = {
        "distmem_oom": RECORD_VERSION, "time": time.time(), "source": source, "error": error[:2000],
        "rank": mine.rank if mine is not None else int(os.environ.get("OMPI_COMM_WORLD_RANK", "0") or 0),
        "world_size": plan.world_size if plan is not None else None,
        "local_rank": mine.local_rank if mine is not None else None, "host": mine.host if mine is not None else "",
        "pid": os.getpid(), "step": current_step(), "device": dev, "strategy": plan.strategy if plan else None,
        "stage": mine.stage if mine is not None else None,
        "limit_bytes": mine.limit_bytes if mine is not None else None,
        "demand_bytes": mine.demand_bytes if mine is not None else None,
        "enforced": bool(mine is not None and any(d.enforce for d in mine.devices)),
        "foreign_planned_bytes": int((plan.options or {}).get("foreign_bytes") or 0) if plan is not None else 0,
        "device_total_bytes": next((d.total_bytes for d in mine.devices if d.index == dev), None) if mine else None,
        "shared_by": next((d.shared_by for d in mine.devices if d.index == dev), 1) if mine else 1,
        "overhead_bytes": plan.overhead_bytes if plan is not None else None,
        "driver_reserved_bytes": next((g.reserved_bytes for g in (session.state.inventory.gpus if
                                                                  session.state.inventory is not None else [])
                                       if g.index == dev), 0),
        "stages": _stage_rows(plan), "request_bytes": request_bytes if request_bytes is not None
        else request_from_text(error), "cap_bytes": cap_bytes, "device_free_bytes": device_free_bytes,
        "allocated_bytes": None, "reserved_bytes": None, "peak_bytes": None, "largest_free_bytes": None,
        "num_ooms": None, "segments": None, "layers": None, "gpu_processes": [], "nvml_note": "", "native": None,
    }
    rec.update(_step_content(plan, kind))
    if allocator is not None:
        try:
            if allocator.initialized() and dev is not None:
                st = allocator.memory_stats(dev)
                rec["allocated_bytes"] = int(st.get("allocated_bytes.all.current", 0))
                rec["reserved_bytes"] = int(st.get("reserved_bytes.all.current", 0))
                rec["peak_bytes"] = int(st.get("allocated_bytes.all.peak", 0))
                rec["num_ooms"] = int(st.get("num_ooms", 0))
                segs = allocator.segments()
                rec["segments"] = sum(1 for s in segs if s.get("device") == dev)
                rec["largest_free_bytes"] = largest_free_block(segs, dev)
                rec["layers"] = layer_groups(segs, _plan_layers(plan), dev)
        except Exception as exc:  # noqa: BLE001 - a record with fewer figures beats none
            rec["allocator_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if settings.raw("DISTMEM_CAP_BYTES"):
        try:
            from ..apply import native

            st = native.status(dev)
            rec["native"] = {k: st.get(k) for k in ("active", "cap_bytes", "used_bytes", "peak_bytes", "denials",
                                                     "last_denied_bytes")}
            if st.get("denials"):
                rec["source"] = "native-cap" if source != "torch-allocator" else source
                if rec["request_bytes"] is None:
                    rec["request_bytes"] = st.get("last_denied_bytes")
        except Exception as exc:  # noqa: BLE001
            rec["native"] = {"error": str(exc)[:300]}
    try:
        rec["gpu_processes"], rec["nvml_note"] = _gpu_processes(plan, [dev] if dev is not None else [])
    except Exception as exc:  # noqa: BLE001
        rec["nvml_note"] = f"NVML query failed: {exc}"[:300]
    return rec


def _step_content(plan: Any, kind: str) -> Dict[str, Any]:
    """What the post-mortem prices the failing step with: the steps before it (:func:`note_step`),
    what this step is fed, the noted estimate at that batch, whether the backward was running, and
    what the plan gave the GPU (its reserve, whether ``limit=`` was stated)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    steps = [dict(p) for p in _state["steps"]]
    now = current_step()
    units = {k: steps[-1][k] for k in ("samples", "elements") if k in steps[-1]} if steps and now is not None \
        and steps[-1].get("step") == now else {}
    options = (plan.options or {}) if plan is not None else {}
    return {"kind": kind, "steps": steps, "units": units, "estimate": _estimate_points(units.get("samples")),
            "in_backward": _in_backward(), "reserve_bytes": plan.reserve_bytes if plan is not None else None,
            "explicit_limit": options.get("limit") is not None}


def record_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, OOM_FOLDER, f"rank-{int(rank)}.json")


@contextlib.contextmanager
def _records_folder(run_dir: str) -> Iterator[untrusted.Folder]:
    """``RUN_DIR/oom`` as this user's own 0700 folder (:func:`distmem.untrusted.private_folder`); where
    that is another user's (or a link), this user's own folder for the run's records instead
    (:func:`distmem.plan.from_report.fallback_records_folder`, which every reader of the records
    also reads), said once."""
    own = os.path.join(run_dir, OOM_FOLDER)
    try:
        with untrusted.private_folder(own) as folder:
            yield folder
            return
    except untrusted.Unsafe as exc:
        if exc.path != own:
            raise
        other = fallback_records_folder(run_dir)
        if not _state.get("said_fallback"):
            _state["said_fallback"] = True
            say(f"[distmem] out-of-memory records: refused {untrusted.printable(exc, 300)}; this rank's record goes "
                f"to {other} instead (distmem postmortem {run_dir} reads it there)")
    with untrusted.private_folder(other) as folder:
        yield folder


def write_record(record: Dict[str, Any], run_dir: Optional[str] = None, count: bool = True) -> str:
    """Write ``record`` to ``RUN_DIR/oom/rank-N.json`` atomically (0600 in a 0700 folder of this user's;
    readers never see half a file; nothing followed or done by name); a later record of the same
    process replaces it, keeps the first one's figures under ``first`` and counts them (``count``;
    False: a rewrite of the same record). Returns the path."""
    run = os.path.abspath(run_dir or settings.run_dir())
    name = f"rank-{int(record['rank'])}.json"
    with _lock, _records_folder(run) as folder:
        earlier = 0
        if count:
            try:
                old = folder.read_json(name, max_bytes=MAX_RECORD_BYTES, what="the earlier record")
                if isinstance(old, dict) and old.get("pid") == record.get("pid") and old.get("kind", "oom") == "oom":
                    earlier = int(old.get("count", 1))
                    record.setdefault("first", {k: old.get(k) for k in ("time", "step", "source", "request_bytes")}
                                      if "first" not in old else old["first"])
            except (OSError, ValueError, TypeError):
                pass
        if count or "count" not in record:
            record["count"] = earlier + 1
        body = (json.dumps(record, indent=1, sort_keys=True, default=str) + "\n").encode("utf-8")
        return folder.write(name, body, mode=0o600, suffix=".oom")


def read_records(run_dir: str) -> List[Dict[str, Any]]:
    """Every rank's record under ``RUN_DIR/oom/`` (links and files that are not records skipped), by rank."""
    return read_oom_records(run_dir)

