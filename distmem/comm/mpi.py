"""mpi4py: point-to-point gathers and non-blocking collectives, every call with a real timeout.

Isolation from the user's own MPI traffic: distmem works on a communicator of its own, a
duplicate of ``COMM_WORLD`` made with the non-blocking ``MPI_Comm_idup`` at the first collective
(every rank enters distmem's collectives in the same order, so the duplicate is matched) and
polled against that call's deadline - a rank that never arrives cannot hang the others. Messages
on it can never meet the user's receives, wildcard tags included. Should the duplicate not
complete in time, distmem stays on ``COMM_WORLD`` for the rest of the process, with tags from a
range reserved at the top of ``MPI_TAG_UB`` (the user's ``ANY_TAG`` receives could then still see
them: the report says so).

Requests that time out are never dropped while active: freeing an active request is erroneous in
MPI (a late peer would write into freed buffers). They are kept with their buffers and completed
(tested) at later calls.
"""
from __future__ import annotations

import logging
import pickle
import time
from typing import Any, Dict, List, Optional, Tuple

from ..errors import GatherTimeoutError
from .base import (Comm, FlagReducer, check_op, decode_rows, encode_row, flag_timeout_error, resolve_timeout,
                   undecodable_error, wait_until)

__all__ = ["MPIComm", "MPIFlags", "TAG_RANGE", "bounded_mpi_init"]

log = logging.getLogger("distmem")

#: Tags distmem may use: the top ``TAG_RANGE`` values below ``MPI_TAG_UB`` (half data, half acks).
TAG_RANGE = 1 << 21


class _Pending:
    """Requests abandoned at a timeout, kept alive with their buffers until they complete."""

    def __init__(self) -> None:
        self.items: List[Tuple[Any, Tuple[Any, ...]]] = []

    def keep(self, req: Any, *buffers: Any) -> None:
        self.items.append((req, buffers))

    def drain(self) -> None:
        still = []
        for req, bufs in self.items:
            try:
                done = req.Test()
            except Exception:  # noqa: BLE001 - a request MPI already failed: nothing left to free
                done = True
            if not done:
                still.append((req, bufs))
        self.items = still

    def __len__(self) -> int:
        return len(self.items)


#: The private duplicate, once per process and world communicator: every MPIComm made later (after
#: ``distmem.reset()``, a second transport) reuses it, so the duplicates of all ranks stay matched.
_PRIVATE: Dict[int, Dict[str, Any]] = {}


def bounded_mpi_init(timeout: float) -> None:
    """Start MPI (``MPI_Init_thread``, thread-multiple) within ``timeout`` seconds, unless mpi4py or
    another library (Horovod) already did. ``MPI_Init`` waits for every rank of the job; a rank lost
    before it would block the others there forever, and mpi4py holds the GIL inside it, so the call
    goes through ctypes (which releases the GIL) on a daemon thread that can be abandoned.
    GatherTimeoutError when it does not return in time; ImportError without mpi4py."""
    import sys

    import mpi4py

    if "mpi4py.MPI" in sys.modules:
        return
    import ctypes
    import ctypes.util
    import threading

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("mpi") or "libmpi.so.40", mode=ctypes.RTLD_GLOBAL)
        flag = ctypes.c_int(0)
        lib.MPI_Initialized(ctypes.byref(flag))
    except (OSError, AttributeError):
        return  # no C library to call directly: mpi4py initialises as usual
    if flag.value:
        mpi4py.rc.initialize = False
        return
    provided = ctypes.c_int(-1)
    done = threading.Event()

    def start() -> None:
        lib.MPI_Init_thread(None, None, 3, ctypes.byref(provided))  # MPI_THREAD_MULTIPLE
        done.set()

    threading.Thread(target=start, name="distmem-mpi-init", daemon=True).start()
    if not done.wait(timeout):
        raise GatherTimeoutError(
            f"MPI_Init did not complete within {timeout:.1f} s: at least one rank of the job never started MPI "
            "(it was lost before distmem's first collective, or took another code path); every rank that waits "
            "raises this instead of hanging. Check the other ranks' logs, or raise DISTMEM_TIMEOUT")
    mpi4py.rc.initialize = False
    import atexit

    def finalize() -> None:
        # distmem started MPI, so it ends it at exit as mpi4py would have: a process that leaves
        # without MPI_Finalize is an abnormal termination to mpirun.
        done_flag = ctypes.c_int(0)
        lib.MPI_Finalized(ctypes.byref(done_flag))
        if not done_flag.value:
            lib.MPI_Finalize()

    atexit.register(finalize)


class MPIComm(Comm):
    """mpi4py on a private duplicate of COMM_WORLD (made without a blocking collective)."""

    name = "mpi"

    def __init__(self, comm: Any = None, timeout: Optional[float] = None):
        if comm is None:
            bounded_mpi_init(resolve_timeout(timeout))
        from mpi4py import MPI  # attaches to the MPI started above (or by the launcher's library)

        self.MPI = MPI
        self.world = comm or MPI.COMM_WORLD
        self.comm = self.world  # until the private duplicate exists
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        ub = self.world.Get_attr(MPI.TAG_UB) or 32767
        span = min(TAG_RANGE, (int(ub) + 1) // 4)
        self._tag_base = int(ub) - 2 * span + 1
        self._tag_span = span
        self._seq = 0
        self.pending = _Pending()
        self._private = _PRIVATE.setdefault(int(self.world.py2f()), {"dup": None, "isolated": None})
        if self._private["isolated"]:
            self.comm = self._private["dup"][0]

    @property
    def isolated(self) -> Optional[bool]:
        """True once on the private communicator, False if it could not be made in time, None before."""
        return self._private["isolated"]

    def ensure_private(self, deadline: float) -> None:
        state = self._private
        if state["isolated"] is not None or self.size == 1:
            if state["isolated"]:
                self.comm = state["dup"][0]
            return
        if state["dup"] is None:
            state["dup"] = self.world.Idup()
        newcomm, req = state["dup"]
        if wait_until(req.Test, deadline):
            self.comm = newcomm
            state["isolated"] = True
        else:
            self.pending.keep(req, newcomm)
            state["isolated"] = False
            log.warning("distmem: rank %d: MPI_Comm_idup did not complete in time; distmem stays on COMM_WORLD "
                        "with tags from %d upward (the job's ANY_TAG receives could see them)", self.rank,
                        self._tag_base)

    def _begin(self, timeout: Optional[float]) -> Tuple[float, float]:
        """Every collective's start: the timeout and its deadline; earlier abandoned requests
        tested; distmem's own communicator in place."""
        timeout = resolve_timeout(timeout)
        deadline = time.monotonic() + timeout
        self.pending.drain()
        self.ensure_private(deadline)
        return timeout, deadline

    def _next_tag(self) -> int:
        self._seq += 1
        return self._tag_base + self._seq % self._tag_span

    def gather(self, obj, root=0, timeout=None):
        timeout, deadline = self._begin(timeout)
        raw, missing = self._gather_raw(obj, root, timeout, deadline)
        if raw is None:
            return None, []
        rows, failed = decode_rows(raw, "gather")
        rows[root] = obj
        return rows, sorted(set(missing) | set(failed))

    def _gather_raw(self, obj: Any, root: int, timeout: float, deadline: float
                    ) -> Tuple[Optional[List[Optional[bytes]]], List[int]]:
        """The point-to-point gather itself: on the root every other rank's payload as received (None
        where none arrived in time; its own left None) and the ranks that did not arrive; ``(None,
        [])`` elsewhere. Decoding is the caller's, after every rank that arrived has its ack."""
        MPI, comm = self.MPI, self.comm
        tag = self._next_tag()
        ack_tag = tag + self._tag_span
        if self.rank != root:
            # Raw bytes, not mpi4py's pickled isend/recv: its recv uses matched probes
            # (MPI_Mprobe), which crash Open MPI 4.1 while Horovod's thread uses MPI too.
            payload = encode_row(obj)
            if self._completes(comm.Isend([payload, MPI.BYTE], dest=root, tag=tag), payload, deadline,
                               f"could not deliver its snapshot to rank {root} within {timeout:.1f} s"):
                # Wait for the root's acknowledgement, so that no rank runs ahead and exits (under
                # Horovod, a rank's exit shuts Horovod - and the MPI it owns - down on every rank)
                # while the root is still receiving.
                ack = bytearray(1)
                self._completes(comm.Irecv([ack, MPI.BYTE], source=root, tag=ack_tag), ack, deadline,
                                f"got no acknowledgement from rank {root} within {timeout:.1f} s")
            return None, []
        raw: List[Optional[bytes]] = [None] * self.size
        pending = set(range(self.size)) - {root}
        status = MPI.Status()

        def receive_some() -> bool:
            for r in sorted(pending):
                if comm.Iprobe(source=r, tag=tag, status=status):
                    buf = bytearray(status.Get_count(MPI.BYTE))
                    comm.Recv([buf, MPI.BYTE], source=r, tag=tag)
                    raw[r] = bytes(buf)
                    pending.discard(r)
            return not pending

        wait_until(receive_some, deadline)
        for r in range(self.size):
            if r != root and r not in pending:
                one = bytearray(b"\x01")
                req = comm.Isend([one, MPI.BYTE], dest=r, tag=ack_tag)
                if not req.Test():
                    self.pending.keep(req, one)
        return raw, sorted(pending)

    def _completes(self, req: Any, buf: Any, deadline: float, failure: str) -> bool:
        """Wait for ``req`` until ``deadline``; on a timeout keep it (and ``buf``) alive and log ``failure``."""
        if wait_until(req.Test, deadline):
            return True
        self.pending.keep(req, buf)
        log.warning("distmem: rank %d %s", self.rank, failure)
        return False

    def _iallreduce(self, send: Any, recv: Any, mpi_op: Any, deadline: float, what: str, timeout: float) -> None:
        req = self.comm.Iallreduce(send, recv, op=mpi_op)
        if not wait_until(req.Test, deadline):
            self.pending.keep(req, send, recv)
            raise GatherTimeoutError(
                f"{what} did not complete within {timeout:.1f} s on rank {self.rank} of {self.size}: at least one "
                "rank never entered it (crashed, hung, or took another code path); check the other ranks' logs, "
                "or raise timeout= / DISTMEM_TIMEOUT")

    def allreduce(self, values, op="sum", timeout=None):
        import numpy as np

        check_op(op)
        timeout, deadline = self._begin(timeout)
        send = np.asarray(values, dtype=np.float64)
        recv = np.empty_like(send)
        mpi_op = {"sum": self.MPI.SUM, "min": self.MPI.MIN, "max": self.MPI.MAX}[op]
        self._iallreduce(send, recv, mpi_op, deadline, f"all-reduce of {len(send)} value(s)", timeout)
        return recv.tolist()

    def allreduce_sum_maxloc(self, sums, maxima, timeout=None):
        """One round: ``Iallreduce`` SUM and ``Iallreduce`` MAXLOC (value, rank) posted together and
        polled against one deadline. MAXLOC keeps the lowest rank on a tie, the full report's rule.
        (A single Iallreduce under a user-defined operation doing both was measured slower: Open MPI
        runs user operations through Python and a slower schedule.)"""
        import numpy as np

        MPI = self.MPI
        pair = np.dtype([("v", np.float64), ("i", np.int32)], align=True)
        if MPI.DOUBLE_INT.Get_extent()[1] != pair.itemsize:  # an MPI whose DOUBLE_INT is laid out otherwise
            return super().allreduce_sum_maxloc(sums, maxima, timeout)
        timeout, deadline = self._begin(timeout)
        send_s = np.asarray(sums, dtype=np.float64)
        recv_s = np.empty_like(send_s)
        send_m = np.empty(len(maxima), dtype=pair)
        send_m["v"] = np.asarray(maxima, dtype=np.float64)
        send_m["i"] = self.rank
        recv_m = np.empty_like(send_m)
        reqs = [self.comm.Iallreduce(send_s, recv_s, op=MPI.SUM),
                self.comm.Iallreduce([send_m, MPI.DOUBLE_INT], [recv_m, MPI.DOUBLE_INT], op=MPI.MAXLOC)]
        if not wait_until(lambda: MPI.Request.Testall(reqs), deadline):
            for req in reqs:
                self.pending.keep(req, send_s, recv_s, send_m, recv_m)
            raise GatherTimeoutError(
                f"summary all-reduce of {len(send_s) + len(send_m)} value(s) did not complete within {timeout:.1f} s "
                f"on rank {self.rank} of {self.size}: at least one rank never entered it (crashed, hung, or took "
                "another code path); check the other ranks' logs, or raise timeout= / DISTMEM_TIMEOUT")
        values = recv_m["v"].tolist()
        return recv_s.tolist(), values, [None if v == float("-inf") else int(r)
                                         for v, r in zip(values, recv_m["i"].tolist())]

    def allgather(self, obj, timeout=None):
        import numpy as np

        timeout, deadline = self._begin(timeout)
        raw, missing = self._gather_raw(obj, 0, timeout, deadline)
        if self.rank == 0:
            raw[0] = encode_row(obj)  # type: ignore[index]
        # The root forwards the rows as they came (bytes): each rank decodes each row itself, so a
        # row one rank cannot decode costs that row, never the whole broadcast.
        payload = pickle.dumps((raw, missing)) if self.rank == 0 else b""
        left = max(deadline - time.monotonic(), 0.001)
        size = self.allreduce([len(payload)], "max", left)[0]
        buf = np.zeros(int(size), dtype=np.uint8)
        if self.rank == 0:
            buf[:] = np.frombuffer(payload, dtype=np.uint8)
        req = self.comm.Ibcast(buf, root=0)
        if not wait_until(req.Test, deadline):
            self.pending.keep(req, buf)
            raise GatherTimeoutError(f"allgather broadcast did not complete within {timeout:.1f} s on rank "
                                     f"{self.rank} of {self.size}; raise timeout= / DISTMEM_TIMEOUT")
        raw, missing = pickle.loads(buf.tobytes())
        if missing:
            raise GatherTimeoutError(f"allgather: ranks {missing} did not arrive within {timeout:.1f} s",
                                     missing)
        raw[self.rank] = None
        rows, failed = decode_rows(raw, "allgather")
        if failed:
            raise undecodable_error("allgather", failed, self.rank, self.size)
        rows[self.rank] = obj
        return rows

    def flag_reducer(self) -> FlagReducer:
        return MPIFlags(self)


class MPIFlags(FlagReducer):
    """The guard's flags by ``Iallreduce`` on distmem's communicator, polled with back-off."""

    name = "mpi"

    def __init__(self, comm: MPIComm):
        self.mpi = comm
        super().__init__(comm.rank, comm.size)

    overlaps = True

    def reduce(self, vec, timeout):
        return self.post(vec, timeout).wait(timeout)

    def post(self, vec, timeout: Optional[float] = None) -> "_PostedMPI":
        import numpy as np

        mpi = self.mpi
        if mpi.pending.items:
            mpi.pending.drain()
        if mpi._private["isolated"] is None:
            mpi.ensure_private(time.monotonic() + (timeout if timeout is not None else resolve_timeout(None)))
        send = np.asarray(vec, dtype=np.float64)
        recv = np.empty_like(send)
        return _PostedMPI(self, self.mpi.comm.Iallreduce(send, recv, op=self.mpi.MPI.SUM), send, recv)


class _PostedMPI:
    """An ``Iallreduce`` of the flags in flight (MPI progresses it inside the job's other MPI calls,
    the gradient all-reduce included)."""

    def __init__(self, flags: MPIFlags, req: Any, send: Any, recv: Any):
        self.flags, self.req, self.send, self.recv = flags, req, send, recv

    def wait(self, timeout: float) -> List[float]:
        if not wait_until(self.req.Test, time.monotonic() + timeout):
            self.flags.mpi.pending.keep(self.req, self.send, self.recv)
            raise flag_timeout_error("the guard's flag all-reduce (MPI)", timeout, self.flags.rank, self.flags.size)
        return self.recv.tolist()
