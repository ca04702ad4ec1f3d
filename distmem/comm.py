"""Gather to rank 0 and tiny all-reduces, over whatever the job already runs on.

Transports, chosen in this order: mpi4py when an MPI launcher started the job (point-to-point and
non-blocking collectives, so every call has a real timeout and names missing ranks); Horovod
when it is initialised (its collectives run in a helper thread bounded by the timeout);
torch.distributed when initialised; a tf.distribute strategy when one is given; else one process.

Every collective here is entered by all ranks in the same order; a call that cannot complete
returns (gather) or raises :class:`GatherTimeoutError` (all-reduce) within ``timeout`` seconds.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .errors import ConfigError, GatherTimeoutError

__all__ = ["Comm", "SingleComm", "MPIComm", "HorovodComm", "get_comm", "set_comm", "DEFAULT_TIMEOUT",
           "mpi_launched", "REDUCE_OPS"]

log = logging.getLogger("distmem")

#: Seconds a gather or all-reduce may take before distmem gives up on the missing ranks.
DEFAULT_TIMEOUT = float(os.environ.get("DISTMEM_TIMEOUT", "60"))
REDUCE_OPS = ("sum", "min", "max")
_POLL = 0.0005  # seconds between polls: short enough to add little latency, long enough not to spin


def _pause(started: float) -> None:
    """Back off while polling: spin for the first 200 microseconds, then sleep in 0.5 ms steps."""
    if time.monotonic() - started > 0.0002:
        time.sleep(_POLL)


def mpi_launched(env=os.environ) -> bool:
    """True when an MPI launcher (mpirun, horovodrun --mpi, srun with PMI) started this process."""
    return any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"))


class Comm:
    """A transport. ``gather`` returns ``(objects, missing)`` on the root, ``(None, [])`` elsewhere."""

    name = "base"
    rank = 0
    size = 1

    def gather(self, obj: Any, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Tuple[Optional[List[Any]], List[int]]:
        raise NotImplementedError

    def allreduce(self, values: Sequence[float], op: str = "sum", timeout: float = DEFAULT_TIMEOUT) -> List[float]:
        raise NotImplementedError

    def allgather(self, obj: Any, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
        raise NotImplementedError

    def barrier(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.allreduce([0.0], "sum", timeout)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ConfigError(f"reduce op {op!r} is not one of {', '.join(REDUCE_OPS)}")


def _reduce(rows: List[Sequence[float]], op: str) -> List[float]:
    fn: Callable = {"sum": sum, "min": min, "max": max}[op]
    return [float(fn(col)) for col in zip(*rows)]


class SingleComm(Comm):
    """One process: every collective is the identity."""

    name = "single"

    def gather(self, obj, root=0, timeout=DEFAULT_TIMEOUT):
        return [obj], []

    def allreduce(self, values, op="sum", timeout=DEFAULT_TIMEOUT):
        _check_op(op)
        return [float(v) for v in values]

    def allgather(self, obj, timeout=DEFAULT_TIMEOUT):
        return [obj]


class MPIComm(Comm):
    """mpi4py on COMM_WORLD, with tags of distmem's own range.

    No ``Dup()``: duplicating a communicator is itself a collective, and a rank that never arrives
    would hang the others before the first timeout could start. Horovod works on its own
    duplicate, so distmem's messages cannot clash with its traffic.
    """

    name = "mpi"
    _TAG_BASE = 7100
    _ACK = 8192  # acknowledgements use the data tag + this, a range of their own

    def __init__(self, comm: Any = None):
        from mpi4py import MPI  # initialises MPI if the launcher has not; only called under a launcher

        self._MPI = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._seq = 0

    def _next_tag(self) -> int:
        self._seq += 1
        return self._TAG_BASE + self._seq % 4096

    def gather(self, obj, root=0, timeout=DEFAULT_TIMEOUT):
        tag = self._next_tag()
        deadline = time.monotonic() + timeout
        if self.rank != root:
            # Raw bytes, not mpi4py's pickled isend/recv: its recv uses matched probes
            # (MPI_Mprobe), which crash Open MPI 4.1 while Horovod's thread uses MPI too.
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            req = self.comm.Isend([payload, self._MPI.BYTE], dest=root, tag=tag)
            started = time.monotonic()
            while not req.Test():
                if time.monotonic() > deadline:
                    req.Cancel()
                    log.warning("distmem: rank %d could not deliver its snapshot to rank %d within %.1f s",
                                self.rank, root, timeout)
                    return None, []
                _pause(started)
            # Wait for the root's acknowledgement, so that no rank runs ahead and exits (under
            # Horovod, a rank's exit shuts Horovod - and the MPI it owns - down on every rank)
            # while the root is still receiving.
            ack = bytearray(1)
            req = self.comm.Irecv([ack, self._MPI.BYTE], source=root, tag=tag + self._ACK)
            while not req.Test():
                if time.monotonic() > deadline:
                    req.Cancel()
                    log.warning("distmem: rank %d got no acknowledgement from rank %d within %.1f s",
                                self.rank, root, timeout)
                    break
                _pause(started)
            return None, []
        out: List[Any] = [None] * self.size
        out[root] = obj
        pending = set(range(self.size)) - {root}
        started = time.monotonic()
        while pending and time.monotonic() < deadline:
            for r in sorted(pending):
                status = self._MPI.Status()
                if self.comm.Iprobe(source=r, tag=tag, status=status):
                    buf = bytearray(status.Get_count(self._MPI.BYTE))
                    self.comm.Recv([buf, self._MPI.BYTE], source=r, tag=tag)
                    out[r] = pickle.loads(buf)
                    pending.discard(r)
            if pending:
                _pause(started)
        acks = [self.comm.Isend([b"\x01", self._MPI.BYTE], dest=r, tag=tag + self._ACK)
                for r in range(self.size) if r != root and r not in pending]
        end = time.monotonic() + min(1.0, timeout)
        while acks and time.monotonic() < end:
            acks = [a for a in acks if not a.Test()]
            if acks:
                _pause(started)
        return out, sorted(pending)

    def allreduce(self, values, op="sum", timeout=DEFAULT_TIMEOUT):
        import numpy as np

        _check_op(op)
        send = np.asarray(values, dtype=np.float64)
        recv = np.empty_like(send)
        mpi_op = {"sum": self._MPI.SUM, "min": self._MPI.MIN, "max": self._MPI.MAX}[op]
        req = self.comm.Iallreduce(send, recv, op=mpi_op)
        started = time.monotonic()
        deadline = started + timeout
        while not req.Test():
            if time.monotonic() > deadline:
                raise GatherTimeoutError(
                    f"all-reduce of {len(send)} value(s) did not complete within {timeout:.1f} s on rank "
                    f"{self.rank} of {self.size}: at least one rank never entered it (crashed, hung, or took "
                    "another code path); check the other ranks' logs, or raise timeout= / DISTMEM_TIMEOUT")
            _pause(started)
        return recv.tolist()

    def allgather(self, obj, timeout=DEFAULT_TIMEOUT):
        gathered, missing = self.gather(obj, 0, timeout)
        if self.rank == 0 and missing:
            gathered = gathered + [None]  # marks failure; broadcast below carries it
        payload = pickle.dumps((gathered, missing)) if self.rank == 0 else b""
        size = self.allreduce([len(payload)], "max", timeout)[0]
        import numpy as np

        buf = np.zeros(int(size), dtype=np.uint8)
        if self.rank == 0:
            buf[:] = np.frombuffer(payload, dtype=np.uint8)
        req = self.comm.Ibcast(buf, root=0)
        deadline = time.monotonic() + timeout
        while not req.Test():
            if time.monotonic() > deadline:
                raise GatherTimeoutError(f"allgather broadcast did not complete within {timeout:.1f} s")
            time.sleep(_POLL)
        gathered, missing = pickle.loads(buf.tobytes())
        if missing:
            raise GatherTimeoutError(f"allgather: ranks {missing} did not arrive within {timeout:.1f} s",
                                     missing)
        return gathered


def _bounded(fn: Callable[[], Any], timeout: float, what: str, rank: int, size: int) -> Any:
    """Run a blocking collective in a daemon thread; raise if it does not return in time."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"distmem-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise GatherTimeoutError(
            f"{what} did not complete within {timeout:.1f} s on rank {rank} of {size}: at least one rank never "
            "entered it; Horovod's stall warnings in the log name the missing ranks (HOROVOD_STALL_CHECK_TIME_SECONDS)")
    if "error" in box:
        raise box["error"]
    return box["value"]


class HorovodComm(Comm):
    """Horovod collectives (Gloo or MPI controller), each bounded by the timeout."""

    name = "horovod"

    def __init__(self, hvd: Any):
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self._seq = 0

    def _name(self, what: str) -> str:
        self._seq += 1
        return f"distmem.{what}.{self._seq}"

    def allgather(self, obj, timeout=DEFAULT_TIMEOUT):
        name = self._name("allgather")
        return _bounded(lambda: self.hvd.allgather_object(obj, name=name), timeout, "Horovod allgather",
                        self.rank, self.size)

    def gather(self, obj, root=0, timeout=DEFAULT_TIMEOUT):
        try:
            rows = self.allgather(obj, timeout)
        except Exception as exc:  # noqa: BLE001 - a timeout, or "Horovod has been shut down" when a peer left
            if self.rank != root:
                return None, []
            log.warning("distmem: %s", exc)
            return [obj if r == root else None for r in range(self.size)], \
                [r for r in range(self.size) if r != root]
        return (list(rows), []) if self.rank == root else (None, [])

    def allreduce(self, values, op="sum", timeout=DEFAULT_TIMEOUT):
        # Through the object allgather on purpose: Horovod matches collectives by name, and a
        # tensor all-reduce whose name two diverged ranks reuse with different lengths fails with a
        # shape mismatch instead of the timeout that names the problem. Its message grows with the
        # number of ranks (8 bytes x values x ranks).
        _check_op(op)
        rows = self.allgather([float(v) for v in values], timeout)
        return _reduce(rows, op)


class TorchDistComm(Comm):
    """torch.distributed (torchrun) object collectives on the default group."""

    name = "torch.distributed"

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def allgather(self, obj, timeout=DEFAULT_TIMEOUT):
        def run():
            out: List[Any] = [None] * self.size
            self.dist.all_gather_object(out, obj)
            return out

        return _bounded(run, timeout, "torch.distributed all_gather_object", self.rank, self.size)

    def gather(self, obj, root=0, timeout=DEFAULT_TIMEOUT):
        rows = self.allgather(obj, timeout)
        return (rows, []) if self.rank == root else (None, [])

    def allreduce(self, values, op="sum", timeout=DEFAULT_TIMEOUT):
        _check_op(op)
        return _reduce(self.allgather([float(v) for v in values], timeout), op)


_current: dict = {"comm": None}


def set_comm(comm: Optional[Comm]) -> None:
    """Use this transport from now on (None: detect again on next use)."""
    _current["comm"] = comm


def _initialised_horovod() -> Any:
    for name in ("horovod.tensorflow", "horovod.torch"):
        hvd = sys.modules.get(name)
        if hvd is not None:
            try:
                if hvd.is_initialized():
                    return hvd
            except Exception:  # noqa: BLE001
                continue
    return None


def get_comm() -> Comm:
    """The transport for this process, detected once and cached."""
    if _current["comm"] is not None:
        return _current["comm"]
    comm: Comm
    if mpi_launched() and os.environ.get("DISTMEM_COMM", "auto") in ("auto", "mpi"):
        try:
            comm = MPIComm()
        except ImportError:
            comm = None  # type: ignore[assignment]
            log.info("distmem: launched by MPI but mpi4py is missing (pip install mpi4py); trying Horovod")
        else:
            _current["comm"] = comm
            return comm
    hvd = _initialised_horovod()
    if hvd is not None:
        comm = HorovodComm(hvd)
    elif "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_available() \
            and sys.modules["torch.distributed"].is_initialized():
        comm = TorchDistComm()
    else:
        comm = SingleComm()
    if isinstance(comm, SingleComm):
        from .topology import from_env

        topo = from_env()
        if topo is not None and topo.size > 1:
            raise ConfigError(
                f"this process is rank {topo.rank} of {topo.size} ({topo.source}) but no transport is ready to "
                "gather from the other ranks; call hvd.init() first, install mpi4py for mpirun jobs, init "
                "torch.distributed, or for tf.distribute (TF_CONFIG) call distmem.comm_tf.use_strategy(strategy) "
                "after creating the strategy")
    _current["comm"] = comm
    return comm
