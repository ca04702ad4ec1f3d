"""The job's layout as it really runs: which ranks share a host, and which physical GPUs each can use.

Every rank knows its own host, local rank and visible GPUs (UUIDs after ``CUDA_VISIBLE_DEVICES``);
what it cannot know alone is what the other ranks of its host see - a wrapper may give each rank
its own GPU, or tell them all the same one. :func:`exchange` shares that among the ranks of a host
through a node-local folder, keyed by the launcher's job id and the host name:

* each rank writes one small record (rank, local rank, host, pid, its visible GPUs) atomically to
  ``<DISTMEM_LAYOUT_DIR>/distmem-layout-<uid>/<job key>/<host>/<local rank>.<round>.json``, where
  ``round`` counts this process's exchanges (a job that calls ``init()`` again - after
  ``distmem.reset()``, with other options - meets in a new round, never in an old record);
* then reads the folder until every local rank of its host (the launcher's ``local_size``) has a
  record, or the deadline (``DISTMEM_LAYOUT_TIMEOUT``, 30 s) passes: then it raises on every
  waiting rank, naming the local ranks that did not arrive;
* a record is trusted when its process is alive or it was written after this process started
  (less a grace period): state left by a dead earlier job with the same key is ignored.

No collective, nothing at import. Every rank of a host reads the same records, so every rank that
shares a GPU reaches the same decision. :func:`assumed` builds the layout the launchers' default
block mapping gives (every rank seeing every GPU of its node) for dry runs of a whole job.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .. import settings
from ..errors import GatherTimeoutError
from .gpus import Gpu, Inventory
from .identity import Topology, job_key

__all__ = ["RankView", "Layout", "exchange", "assumed", "single", "live_layouts", "LayoutTimeoutError",
           "STALE_GRACE_SECONDS"]

#: A record of a dead process is still trusted if written at most this long before this process
#: started: peers of one launch start within seconds of each other; a dead earlier job's are older.
STALE_GRACE_SECONDS = 300.0


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


def _start_time(pid: int) -> Optional[float]:
    """The process's start as seconds since boot (``/proc/<pid>/stat`` field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _alive(record: Dict[str, Any]) -> bool:
    pid = int(record.get("pid", 0))
    if pid <= 0:
        return False
    started = _start_time(pid)
    return started is not None and abs(started - float(record.get("start", -1))) < 0.05


def _write_atomic(path: str, data: Dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _process_age() -> float:
    """Seconds since this process started (wall clock)."""
    mine = _start_time(os.getpid())
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError):
        return 0.0
    return max(0.0, uptime - mine) if mine is not None else 0.0


_rounds: Dict[str, int] = {}


def exchange(topo: Topology, inv: Inventory, *, timeout: Optional[float] = None,
             directory: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> Layout:
    """The ranks of this host and their GPUs, learnt through the node-local folder (see the module
    docstring). Returns at once for a single process or a rank alone on its host."""
    me = RankView(topo.rank, topo.host, topo.local_rank, list(inv.gpus), os.getpid())
    if topo.size == 1 or topo.local_size <= 1:
        return Layout(topo.size, [me], "single" if topo.size == 1 else "exchange")
    key = job_key(os.environ if env is None else env)
    if key is None:
        # No launch id to meet under: trust the launcher's local rank, the others assumed to see the same GPUs.
        return Layout(topo.size, [me] + [RankView(-1 - lr, topo.host, lr, list(inv.gpus)) for lr in
                                         range(topo.local_size) if lr != topo.local_rank], "launcher")
    wait = settings.layout_timeout(env) if timeout is None else settings.positive_seconds(timeout, "timeout")
    root = directory or settings.layout_dir(env)
    folder = os.path.join(root, f"distmem-layout-{os.getuid()}", key, topo.host.replace(os.sep, "_"))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise LayoutTimeoutError(
            f"rank {topo.rank} cannot create the layout folder {folder} ({exc.strerror or exc}); set "
            "DISTMEM_LAYOUT_DIR to a node-local folder every rank of the job can write") from None
    start = _start_time(os.getpid())
    rnd = _rounds[folder] = _rounds.get(folder, 0) + 1
    record = dict(me.to_dict(), start=start, time=time.time(), round=rnd)
    _write_atomic(os.path.join(folder, f"{topo.local_rank}.{rnd}.json"), record)
    oldest = time.time() - _process_age() - STALE_GRACE_SECONDS
    deadline = time.monotonic() + wait
    found: Dict[int, Dict[str, Any]] = {}
    delay = 0.0005
    while True:
        for lr in range(topo.local_size):
            if lr in found:
                continue
            path = os.path.join(folder, f"{lr}.{rnd}.json")
            try:
                with open(path, encoding="utf-8") as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            if rec.get("local_rank") == lr and (_alive(rec) or float(rec.get("time", 0)) >= oldest):
                found[lr] = rec
        if len(found) == topo.local_size:
            break
        if time.monotonic() > deadline:
            missing = [lr for lr in range(topo.local_size) if lr not in found]
            raise LayoutTimeoutError(
                f"rank {topo.rank} (local rank {topo.local_rank} of {topo.local_size} on {topo.host}) waited "
                f"{wait:.1f} s for the other ranks of its host to publish which GPUs they see, and local rank(s) "
                f"{', '.join(map(str, missing))} did not arrive (round {rnd} in {folder}); every rank must call "
                "distmem.init() (or plan_from_env()) as often as the others; if they are slow to start, raise "
                "DISTMEM_LAYOUT_TIMEOUT; "
                "if they run on another machine under the same host name, set DISTMEM_LAYOUT_DIR to a "
                "node-local folder", missing)
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    views = sorted((RankView.from_dict(r) for r in found.values()), key=lambda v: v.local_rank)
    ranks = [v.rank for v in views]
    if len(set(ranks)) != len(ranks):
        raise LayoutTimeoutError(f"the layout records of host {topo.host} ({folder}) claim rank(s) "
                                 f"{sorted({r for r in ranks if ranks.count(r) > 1})} twice: two launches share the "
                                 "job key; set DISTMEM_LAYOUT_DIR to a folder of this launch's own")
    return Layout(topo.size, views, "exchange")


def live_layouts(host: str, directory: Optional[str] = None) -> Dict[str, Layout]:
    """The layouts of running jobs on ``host`` that exchanged through this machine's layout folder:
    job key -> the views of its latest round whose processes are still alive (``distmem doctor``
    uses it to name the job's ranks among NVML's processes)."""
    root = os.path.join(directory or settings.layout_dir(), f"distmem-layout-{os.getuid()}")
    out: Dict[str, Layout] = {}
    try:
        keys = os.listdir(root)
    except OSError:
        return out
    for key in keys:
        folder = os.path.join(root, key, host.replace(os.sep, "_"))
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        latest: Dict[int, Dict[str, Any]] = {}
        for name in names:
            if not name.endswith(".json") or name.count(".") != 2:
                continue
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            if not _alive(rec):
                continue
            lr = int(rec.get("local_rank", -1))
            if lr not in latest or int(rec.get("round", 0)) > int(latest[lr].get("round", 0)):
                latest[lr] = rec
        if latest:
            views = sorted((RankView.from_dict(r) for r in latest.values()), key=lambda v: v.local_rank)
            # Local ranks that left no live record keep their places (placeholders seeing the same GPUs).
            views += [RankView(-1 - lr, views[0].host, lr, list(views[0].gpus))
                      for lr in range(max(latest) + 1) if lr not in latest]
            out[key] = Layout(max(v.rank for v in views) + 1, sorted(views, key=lambda v: v.local_rank), "exchange")
    return out
