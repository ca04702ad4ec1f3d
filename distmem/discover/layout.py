"""The job's layout as it really runs: which ranks share a host, and which physical GPUs each can use.

Every rank knows its own host, local rank and visible GPUs (UUIDs after ``CUDA_VISIBLE_DEVICES``);
what it cannot know alone is what the other ranks of its host see - a wrapper may give each rank
its own GPU, or tell them all the same one. :func:`exchange` shares that among the ranks of a host
through a node-local folder only this user can use (:mod:`distmem.discover.private`):

* the folder is ``<DISTMEM_LAYOUT_DIR>/distmem-layout-<uid>/<launch>/<host>/``, every level 0700
  and checked (owner, mode, never a link); where another user made ``distmem-layout-<uid>`` first
  (or planted a link there), it is refused and the ranks meet in this user's own folder instead
  (``~/.cache/distmem/layout``, :func:`usable_base`), said once; ``<launch>`` is :func:`~distmem.discover.identity.job_key`
  of the launcher's per-launch ids and, under torchrun, a nonce drawn through its store
  (:func:`~distmem.discover.identity.launch_nonce`): the ranks of one launch agree on it, a later
  launch does not share it;
* each rank writes one record (rank, local rank, host, pid, its visible GPUs) as
  ``<local rank>.<round>.<token>.json``, 0600, atomically, and holds its lock for its life; ``round``
  counts this process's exchanges (a job that calls ``init()`` again - after ``distmem.reset()``,
  with other options - meets in a new round, never in an old record);
* then reads the folder until every local rank of its host (the launcher's ``local_size``) has a
  trusted record, or the deadline (``DISTMEM_LAYOUT_TIMEOUT``, 30 s) passes: then it raises on
  every waiting rank, naming the local ranks that did not arrive;
* a record is trusted when it is this user's regular file, its writer still holds its lock, its pid
  is a live process of this user that started when the record says, and every field has the type
  and value this launch expects: a stale, malformed or forged record is ignored, never a crash;
* a process removes its records when it ends (and its previous round's once a round completes);
  the last one out removes the folders; records a killed job left are swept by the next exchange.

No collective, nothing at import. Every rank of a host reads the same records, so every rank that
shares a GPU reaches the same decision. :func:`assumed` builds the layout the launchers' default
block mapping gives (every rank seeing every GPU of its node) for dry runs of a whole job.
"""
from __future__ import annotations

import atexit
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import session, settings
from ..errors import ConfigError, GatherTimeoutError
from . import private
from .gpus import MAX_FLEET_GPUS, Gpu, Inventory
from .identity import Topology, job_key, launch_nonce

__all__ = ["RankView", "Layout", "exchange", "assumed", "single", "live_layouts", "leave", "usable_base", "LayoutTimeoutError",
           "RECORD_FORMAT"]

#: The records' format: a record of another format (another distmem version) is never read as one.
RECORD_FORMAT = "distmem-layout/2"


class LayoutTimeoutError(GatherTimeoutError):
    """Ranks of this host did not publish their layout in time; ``missing`` lists their local ranks."""


@dataclass
class RankView:
    """One rank as its host sees it: the GPUs it can use, in its own framework order (``Gpu.index``
    is the ordinal in that rank's ``CUDA_VISIBLE_DEVICES``)."""

    rank: int
    host: str
    local_rank: int
    gpus: List[Gpu] = field(default_factory=list)
    pid: int = 0

    @property
    def gpu_set(self) -> tuple:
        return tuple(g.uuid for g in self.gpus)

    def to_dict(self) -> Dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "local_rank": self.local_rank, "pid": self.pid,
                "gpus": [{k: v for k, v in g.to_dict().items() if k != "processes"} for g in self.gpus]}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RankView":
        return cls(rank=int(d["rank"]), host=str(d["host"]), local_rank=int(d["local_rank"]), pid=int(d.get("pid", 0)),
                   gpus=[Gpu(**g) for g in d.get("gpus", [])])


@dataclass
class Layout:
    """The ranks this process knows about (its host's, or the whole job in a dry run) of a job of
    ``world_size`` ranks. ``complete`` when every rank of the job is listed; ``source`` says how
    the layout was learnt: ``single``, ``exchange`` (observed), ``launcher`` (the launcher's local
    rank alone; the host's other ranks, with negative placeholder ranks, assumed to see the same
    GPUs) or ``assumed`` (block mapping)."""

    world_size: int
    views: List[RankView]
    source: str = "single"

    @property
    def complete(self) -> bool:
        return sum(v.rank >= 0 for v in self.views) == self.world_size

    def view(self, rank: int) -> Optional[RankView]:
        return next((v for v in self.views if v.rank == rank), None)

    def hosts(self) -> List[str]:
        return sorted({v.host for v in self.views})


def single(topo: Topology, inv: Inventory) -> Layout:
    """This rank alone (one process, or the only rank of its host)."""
    return Layout(topo.size, [RankView(topo.rank, topo.host, topo.local_rank, list(inv.gpus), os.getpid())],
                  "single" if topo.size == 1 else "exchange")


def assumed(topo: Topology, inv: Inventory, hosts: Optional[Sequence[str]] = None,
            inventories: Optional[Dict[str, Inventory]] = None) -> Layout:
    """The whole job under the block mapping: ``topo.local_size`` consecutive ranks per host, every
    rank seeing its host's GPUs (``inventories[host]``, else ``inv``). For ``distmem plan`` and tests."""
    per = max(topo.local_size, 1)
    views = []
    for r in range(topo.size):
        index = r // per
        host = hosts[index] if hosts and index < len(hosts) else (topo.host if topo.size <= per and topo.host
                                                                    else f"host{index}")
        gpus = (inventories or {}).get(host, inv).gpus
        views.append(RankView(r, host, r % per, list(gpus)))
    return Layout(topo.size, views, "assumed")


# --- records: what a rank writes, and what makes one trusted --------------------------------------

_GPU_FIELDS = {"index": int, "nvml_index": (int, type(None)), "uuid": str, "name": str, "total_bytes": int,
               "used_bytes": int, "free_bytes": int, "mig": bool, "reserved_bytes": int}
_GPU_REQUIRED = {"index", "nvml_index", "uuid", "name", "total_bytes"}  # Gpu's fields without a default


def _whole(value: Any, low: int = 0, high: int = 2**63 - 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _gpu_of(d: Any) -> Optional[Gpu]:
    """A GPU of a record, or None unless every field has its type (and sizes their range)."""
    if not isinstance(d, dict) or set(d) - set(_GPU_FIELDS) or not _GPU_REQUIRED <= set(d):
        return None
    for name, kind in _GPU_FIELDS.items():
        if name in d and (not isinstance(d[name], kind) or (kind is not bool and isinstance(d[name], bool))):
            return None
    if not all(_whole(d[k]) for k in ("index", "total_bytes", "used_bytes", "free_bytes", "reserved_bytes")
               if k in d) or len(d["uuid"]) > 256 or len(d["name"]) > 256:
        return None
    return Gpu(**d)


def _process_start(pid: int) -> Optional[int]:
    """The process's start (``/proc/<pid>/stat`` field 22, clock ticks since boot) if it is alive
    and this user's, else None."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return None
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _record(topo: Topology, me: RankView, key: str, rnd: int) -> Dict[str, Any]:
    return dict(me.to_dict(), format=RECORD_FORMAT, uid=os.geteuid(), key=key, round=rnd, size=topo.size,
                start=_process_start(os.getpid()), time=time.time())


def _view_of(rec: Dict[str, Any], lr: int, rnd: Optional[int], key: str, host: Optional[str],
             size: Optional[int]) -> Optional[RankView]:
    """The rank a record describes, or None unless it is a record of this launch's round, host and
    local rank whose writer is a live process of this user (the one that wrote it: same start)."""
    if (rec.get("format") != RECORD_FORMAT or rec.get("uid") != os.geteuid() or rec.get("key") != key
            or rec.get("local_rank") != lr or not _whole(rec.get("size"), 1) or not _whole(rec.get("round"), 1)
            or not isinstance(rec.get("host"), str) or not _whole(rec.get("pid"), 1)
            or not _whole(rec.get("start")) or not isinstance(rec.get("gpus"), list)):
        return None
    if (rnd is not None and rec["round"] != rnd) or (host is not None and rec["host"] != host):
        return None
    if (size is not None and rec["size"] != size) or not _whole(rec.get("rank"), 0, rec["size"] - 1):
        return None
    if len(rec["gpus"]) > MAX_FLEET_GPUS or _process_start(rec["pid"]) != rec["start"]:
        return None
    gpus = [_gpu_of(g) for g in rec["gpus"]]
    if any(g is None for g in gpus):
        return None
    return RankView(rec["rank"], rec["host"], lr, gpus, rec["pid"])  # type: ignore[arg-type]


# --- the folders, and this process's records in them ----------------------------------------------

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _folder_name(text: str) -> str:
    """``text`` as one folder name: never a path, ``.`` or ``..`` (a host name from the environment
    is anyone's text); a name that had to change gets a hash of the original."""
    safe = _SAFE.sub("_", text).lstrip(".")[:100] or "_"
    if safe == text:
        return safe
    import hashlib

    return f"{safe}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


@dataclass
class _Held:
    """This process's entries in one host folder: by round, the names and the descriptors holding
    their locks; the last round it completed (every local rank's record read)."""

    path: Tuple[str, str, str]  # base, launch key folder, host folder
    local_rank: int
    local_size: int
    entries: Dict[int, List[Tuple[str, int]]] = field(default_factory=dict)
    completed: int = 0
    pid: int = field(default_factory=os.getpid)  # a forked child inherits the table, not the entries


_held: Dict[Tuple[str, str, str], _Held] = {}
_held_lock = threading.Lock()
#: At exit, how long a rank waits at most for the peers of its last round to have read its record.
EXIT_WAIT_SECONDS = 30.0


def _open_host_folder(base: str, key: str, host: str) -> Tuple[int, int, int]:
    """Descriptors of this user's folder, the launch's and the host's (created, checked, the
    user's folder swept of stale entries first). Retried when a folder vanishes in between (the
    last rank of another job removing it the same instant)."""
    for attempt in range(5):
        user = private.open_user_folder(base)
        assert user is not None
        try:
            private.sweep(user)
            launch = private.open_folder(user, key, os.path.join(base, private.user_folder_name(), key))
            assert launch is not None
            try:
                folder = private.open_folder(launch, host, os.path.join(base, private.user_folder_name(), key, host))
                assert folder is not None
                return user, launch, folder
            except BaseException:
                os.close(launch)
                raise
        except FileNotFoundError:
            os.close(user)
            if attempt == 4:
                raise
        except BaseException:
            os.close(user)
            raise
    raise AssertionError("unreachable")


def _hold(base: str, key: str, host: str, topo: Topology) -> _Held:
    held = _held.get((base, key, host))
    if held is None or held.pid != os.getpid():
        held = _held[(base, key, host)] = _Held((base, key, host), topo.local_rank, topo.local_size)
    return held


def _publish(base: str, key: str, host: str, topo: Topology, rnd: int, record: Dict[str, Any]
             ) -> Tuple[int, int, int, str]:
    """Write this rank's record; the folders' descriptors and the record's name."""
    for attempt in range(5):
        user, launch, folder = _open_host_folder(base, key, host)
        name = private.record_name(topo.local_rank, rnd)
        try:
            fd = private.write_record(folder, name, record)
        except FileNotFoundError:  # the empty folder was swept away under us: make it again
            for d in (folder, launch, user):
                os.close(d)
            if attempt == 4:
                raise
            continue
        except BaseException:
            for d in (folder, launch, user):
                os.close(d)
            raise
        with _held_lock:
            _hold(base, key, host, topo).entries.setdefault(rnd, []).append((name, fd))
        return user, launch, folder, name
    raise AssertionError("unreachable")


def _complete(base: str, key: str, host: str, topo: Topology, folder: int, rnd: int) -> None:
    """Round ``rnd`` is read: leave the marker that says so, and remove this process's entries of
    earlier rounds (every local rank has moved past them, or this round could not have completed)."""
    name = private.record_name(topo.local_rank, rnd, "done")
    fd = private.write_record(folder, name, {"format": RECORD_FORMAT, "round": rnd})
    with _held_lock:
        held = _hold(base, key, host, topo)
        held.entries.setdefault(rnd, []).append((name, fd))
        held.completed = rnd
        for r in [r for r in held.entries if r < rnd]:
            for old, old_fd in held.entries.pop(r):
                private.unlink(folder, old)
                os.close(old_fd)


def _peers_done(folder: int, held: _Held) -> bool:
    """True once every other local rank of the last completed round has left its marker, or has no
    live record of that round any more (it ended): nobody still needs this process's record."""
    rnd = held.completed
    done, live = set(), set()
    for name, lr, r, kind in private.list_records(folder):
        if r != rnd or lr == held.local_rank:
            continue
        if kind == "done":
            done.add(lr)
        elif private.read_record(folder, name)[1]:
            live.add(lr)
    return not (live - done)


def _leave() -> None:
    """At exit: once the peers of its last round have read its record (bounded by
    :data:`EXIT_WAIT_SECONDS`), remove this process's entries, then every folder left empty - the
    last rank out removes the launch's folder and the user's. A forked child leaves its parent's alone."""
    with _held_lock:
        items = [h for h in _held.values() if h.pid == os.getpid()]
        _held.clear()
    for held in items:
        base, key, host = held.path
        try:
            user = private.open_user_folder(base, create=False)
            launch = private.open_folder(user, key, key, create=False) if user is not None else None
            folder = private.open_folder(launch, host, host, create=False) if launch is not None else None
        except (ConfigError, OSError):
            user = launch = folder = None
        if folder is not None and held.completed:
            deadline, delay = time.monotonic() + EXIT_WAIT_SECONDS, 0.002
            while not _peers_done(folder, held) and time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        for names in held.entries.values():
            for name, fd in names:
                if folder is not None:
                    private.unlink(folder, name)
                os.close(fd)
        for parent, child, name in ((launch, folder, host), (user, launch, key)):
            if child is not None:
                os.close(child)
            if parent is not None:
                private.remove_empty(parent, name)
        if user is not None:
            os.close(user)
            private.remove_user_folder(base)


atexit.register(_leave)
#: The same, for a launcher wrapper (distmem-exec) about to exec its command: no exit handler runs at
#: exec, and the wrapper's records would otherwise outlive it under the command's pid.
leave = _leave


# --- the exchange ----------------------------------------------------------------------------------

_rounds: Dict[Tuple[str, str, str], int] = {}


_said: Dict[str, bool] = {}


def usable_base(base: str, local_rank: int = 0) -> str:
    """``base`` when this user's folder in it is (or can be made) this user's own; where another
    user took ``distmem-layout-<uid>`` there first (or planted a link), that folder is refused and
    never used, and the job still runs: every rank of the host meets in this user's own folder
    instead (:func:`distmem.discover.private.fallback_base`), said once (by local rank 0)."""
    try:
        fd = private.open_user_folder(base)
    except private.ForeignFolder as exc:
        other = private.fallback_base()
        if local_rank == 0 and not _said.get(base):
            _said[base] = True
            from ..console import say
            from ..untrusted import printable

            say(f"[distmem] {printable(exc, 600)}. This job's ranks meet in {other} instead (this user's own).")
        return other
    if fd is not None:
        os.close(fd)
    return base


def _launcher_layout(topo: Topology, me: RankView, inv: Inventory) -> Layout:
    """No launch id to meet under: the launcher's local rank, the others assumed to see the same GPUs."""
    return Layout(topo.size, [me] + [RankView(-1 - lr, topo.host, lr, list(inv.gpus)) for lr in
                                     range(topo.local_size) if lr != topo.local_rank], "launcher")


def exchange(topo: Topology, inv: Inventory, *, timeout: Optional[float] = None,
             directory: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> Layout:
    """The ranks of this host and their GPUs, learnt through this user's node-local folder (see the
    module docstring). Returns at once for a single process or a rank alone on its host."""
    me = RankView(topo.rank, topo.host, topo.local_rank, list(inv.gpus), os.getpid())
    if topo.size == 1 or topo.local_size <= 1:
        return Layout(topo.size, [me], "single" if topo.size == 1 else "exchange")
    env = dict(os.environ) if env is None else env
    if job_key(env) is None:
        return _launcher_layout(topo, me, inv)
    wait = settings.layout_timeout(env) if timeout is None else settings.positive_seconds(timeout, "timeout")
    deadline = time.monotonic() + wait
    key = job_key(env, launch_nonce(env, wait)) or ""
    if session.wrapper:
        # A launcher wrapper (distmem-exec) and the command it execs are one rank under one pid: the
        # wrappers of a launch meet apart, so no command ever reads a wrapper's record as its peer's.
        key = f"{key}.{_folder_name(session.wrapper)}"
    base = usable_base(directory or settings.layout_dir(env), topo.local_rank)
    host = _folder_name(topo.host)
    rnd = _rounds[(base, key, host)] = _rounds.get((base, key, host), 0) + 1
    user, launch, folder, mine = _publish(base, key, host, topo, rnd, _record(topo, me, key, rnd))
    where = os.path.join(base, private.user_folder_name(), key, host)
    try:
        views = _wait_for_host(folder, topo, me, key, rnd, mine, deadline, wait, where)
        _complete(base, key, host, topo, folder, rnd)
    finally:
        for fd in (folder, launch, user):
            os.close(fd)
    ranks = [v.rank for v in views]
    if len(set(ranks)) != len(ranks):
        raise LayoutTimeoutError(f"the layout records of host {topo.host} ({where}) claim rank(s) "
                                 f"{sorted({r for r in ranks if ranks.count(r) > 1})} twice: two launches share the "
                                 "job key; set DISTMEM_LAYOUT_DIR to a folder of this launch's own")
    return Layout(topo.size, views, "exchange")


def _wait_for_host(folder: int, topo: Topology, me: RankView, key: str, rnd: int, mine: str, deadline: float,
                   wait: float, where: str) -> List[RankView]:
    """Poll the host folder until every local rank has a trusted record of round ``rnd``."""
    seen: Dict[str, Optional[RankView]] = {mine: me}  # a record, once judged, is final: files never change
    delay = 0.0005
    while True:
        for name, lr, r, kind in private.list_records(folder):
            if kind == "json" and r == rnd and name not in seen and 0 <= lr < topo.local_size:
                rec, live = private.read_record(folder, name)
                seen[name] = _view_of(rec, lr, rnd, key, topo.host, topo.size) if rec is not None and live else None
        found: Dict[int, List[RankView]] = {}
        for view in seen.values():
            if view is not None:
                found.setdefault(view.local_rank, []).append(view)
        twice = sorted(lr for lr, vs in found.items() if len(vs) > 1)
        if twice:
            raise LayoutTimeoutError(
                f"rank {topo.rank} found two live processes claiming local rank(s) {twice} of {topo.host} in round "
                f"{rnd} ({where}): two launches share the job key; set DISTMEM_LAYOUT_DIR to a folder of this "
                "launch's own", [])
        if len(found) == topo.local_size:
            return sorted((vs[0] for vs in found.values()), key=lambda v: v.local_rank)
        if time.monotonic() > deadline:
            missing = [lr for lr in range(topo.local_size) if lr not in found]
            ignored = sum(v is None for v in seen.values())
            raise LayoutTimeoutError(
                f"rank {topo.rank} (local rank {topo.local_rank} of {topo.local_size} on {topo.host}) waited "
                f"{wait:.1f} s for the other ranks of its host to publish which GPUs they see, and local rank(s) "
                f"{', '.join(map(str, missing))} did not arrive (round {rnd} in {where}"
                + (f"; {ignored} record(s) there were ignored: stale, malformed, or not this user's live processes"
                   if ignored else "")
                + "); every rank must call distmem.init() (or plan_from_env()) as often as the others; if they are "
                "slow to start, raise DISTMEM_LAYOUT_TIMEOUT; if they run on another machine under the same host "
                "name, set DISTMEM_LAYOUT_DIR to a node-local folder", missing)
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def live_layouts(host: str, directory: Optional[str] = None) -> Dict[str, Layout]:
    """The layouts of this user's running jobs on ``host`` that exchanged through this machine's
    layout folder: launch key -> the views of its latest round whose processes are still alive
    (``distmem doctor`` uses it to name the job's ranks among NVML's processes). Reads only:
    nothing is created, and a folder that is not this user's own gives nothing."""
    out: Dict[str, Layout] = {}
    for base in (directory or settings.layout_dir(), private.fallback_base()):
        try:
            user = private.open_user_folder(base, create=False)
        except (ConfigError, OSError):
            continue
        if user is None:
            continue
        try:
            for key in sorted(os.listdir(user))[:256]:
                layout = _live_layout(user, key, _folder_name(host))
                if layout is not None:
                    out.setdefault(key, layout)
        finally:
            os.close(user)
    return out


def _live_layout(user: int, key: str, host: str) -> Optional[Layout]:
    try:
        launch = private.open_folder(user, key, key, create=False)
    except (ConfigError, OSError):
        return None
    if launch is None:
        return None
    try:
        folder = private.open_folder(launch, host, host, create=False)
    except (ConfigError, OSError):
        folder = None
    finally:
        os.close(launch)
    if folder is None:
        return None
    latest: Dict[int, Tuple[int, RankView, int]] = {}
    try:
        for name, lr, rnd, kind in private.list_records(folder):
            if kind != "json":
                continue
            rec, live = private.read_record(folder, name)
            view = _view_of(rec, lr, None, key, None, None) if rec is not None and live else None
            if view is not None and (lr not in latest or rnd > latest[lr][0]):
                latest[lr] = (rnd, view, int(rec["size"]))  # type: ignore[index]
    finally:
        os.close(folder)
    if not latest:
        return None
    views = [v for _, v, _ in latest.values()]
    # Local ranks that left no live record keep their places (placeholders seeing the same GPUs).
    views += [RankView(-1 - lr, views[0].host, lr, list(views[0].gpus)) for lr in range(max(latest) + 1)
              if lr not in latest]
    size = max(s for _, _, s in latest.values())
    return Layout(size, sorted(views, key=lambda v: v.local_rank), "exchange")
