"""The per-step verdict: one tiny all-reduce that tells every rank which ranks ran out of memory,
failed otherwise, or ran out of data.

Encoding: three bitmaps (OOM, ERROR, STOP), 52 ranks per float64 word. A rank sets only its own bit,
so the element-wise *sum* over ranks equals the bitwise OR, exactly (every sum stays below 2**52). The
vector is ``3 * ceil(size / 52)`` doubles: 24 bytes up to 52 ranks, 1.9 KB for 4,096 ranks.

Transports, each with a real timeout: mpi4py ``Iallreduce`` polled with back-off; Horovod
(``horovod.torch``: ``allreduce_async_`` + ``poll``; ``horovod.tensorflow``: the eager op on one
persistent helper thread); torch.distributed ``all_reduce(async_op=True)`` polled; anything else
through ``Comm.allreduce``.
"""
from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

from ..comm import Comm, HorovodComm, MPIComm, SingleComm, TorchDistComm, get_comm
from ..errors import GatherTimeoutError

__all__ = ["Status", "Verdict", "encode", "decode", "FlagReducer", "flag_reducer", "WORD_BITS", "FLAG_NAME"]

WORD_BITS = 52
FLAG_NAME = "distmem.guard.flag"  # one fixed name: Horovod's response cache then serves every step


class Status(enum.IntEnum):
    """What one rank reports after computing its share of a step."""
    OK = 0
    OOM = 1     # out of memory: every rank drops the step and retries smaller
    ERROR = 2   # any other exception: every rank raises
    STOP = 3    # the data ran out on this rank: every rank stops


def words(size: int) -> int:
    return (size + WORD_BITS - 1) // WORD_BITS


def encode(rank: int, size: int, status: Status) -> List[float]:
    """This rank's contribution: zeros, plus its bit in the bitmap of its status."""
    w = words(size)
    vec = [0.0] * (3 * w)
    if status != Status.OK:
        vec[(int(status) - 1) * w + rank // WORD_BITS] = float(1 << (rank % WORD_BITS))
    return vec


@dataclass(frozen=True)
class Verdict:
    """The all-reduced flags: which ranks reported OOM, ERROR, STOP. Identical on every rank."""
    oom: List[int] = field(default_factory=list)
    error: List[int] = field(default_factory=list)
    stop: List[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.oom or self.error or self.stop)


def decode(vec: Sequence[float], size: int) -> Verdict:
    w = words(size)
    if len(vec) != 3 * w:
        raise ValueError(f"flag vector has {len(vec)} words, {3 * w} expected for {size} ranks")
    out: List[List[int]] = []
    for k in range(3):
        ranks = []
        for i in range(w):
            bits = int(round(vec[k * w + i]))
            j = 0
            while bits:
                if bits & 1:
                    ranks.append(i * WORD_BITS + j)
                bits >>= 1
                j += 1
        out.append([r for r in ranks if r < size])
    return Verdict(*out)


def _timeout_error(what: str, timeout: float, rank: int, size: int) -> GatherTimeoutError:
    return GatherTimeoutError(
        f"{what} did not complete within {timeout:.1f} s on rank {rank} of {size}: at least one rank never "
        "reached the guard's flag all-reduce (it crashed, hung, raised outside the guarded step, or ran a "
        "different number of steps). Every rank that waits raises this instead of hanging; check the other "
        "ranks' logs, and raise timeout= (or DISTMEM_TIMEOUT) if one step can take longer")


def _wait(test: Callable[[], bool], deadline: float) -> bool:
    """Poll ``test``: a few immediate retries (ranks usually arrive together), then sleeps of 20 us
    doubling to 250 us, so a late rank costs at most ~250 us of added latency and no core spins."""
    for _ in range(20):
        if test():
            return True
    delay = 0.00002
    while not test():
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(0.00025, delay * 2)
    return True


class FlagReducer:
    """Sum-all-reduce of a short float vector with a timeout. ``reduce`` raises GatherTimeoutError."""

    name = "base"

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def reduce(self, vec: List[float], timeout: float) -> List[float]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"


class SingleFlags(FlagReducer):
    name = "single"

    def reduce(self, vec, timeout):
        return list(vec)


class MPIFlags(FlagReducer):
    """mpi4py Iallreduce on the communicator. A timed-out request is kept alive (its buffers too):
    freeing an active collective request is erroneous in MPI."""

    name = "mpi"

    def __init__(self, comm: Any):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self._abandoned: list = []
        super().__init__(comm.Get_rank(), comm.Get_size())

    def reduce(self, vec, timeout):
        import numpy as np

        send = np.asarray(vec, dtype=np.float64)
        recv = np.empty_like(send)
        req = self.comm.Iallreduce(send, recv, op=self._MPI.SUM)
        if not _wait(req.Test, time.monotonic() + timeout):
            self._abandoned.append((req, send, recv))
            raise _timeout_error("the guard's flag all-reduce (MPI)", timeout, self.rank, self.size)
        return recv.tolist()


class HorovodTorchFlags(FlagReducer):
    """horovod.torch: asynchronous all-reduce polled until done: a timeout without a thread."""

    name = "horovod.torch"

    def __init__(self, hvd: Any):
        self.hvd = hvd
        self._abandoned: list = []
        super().__init__(hvd.rank(), hvd.size())

    def reduce(self, vec, timeout):
        import torch

        t = torch.tensor(vec, dtype=torch.float64)
        handle = self.hvd.allreduce_async_(t, op=self.hvd.Sum, name=FLAG_NAME)
        if not _wait(lambda: self.hvd.poll(handle), time.monotonic() + timeout):
            self._abandoned.append((handle, t))
            raise _timeout_error("the guard's flag all-reduce (horovod.torch)", timeout, self.rank, self.size)
        return self.hvd.synchronize(handle).tolist()


class _Stuck(Exception):
    """The helper thread did not finish in time (or is still blocked in an earlier call)."""


class _Worker:
    """One persistent daemon thread that runs blocking calls, so the caller can give up after a timeout
    without paying a thread start per step."""

    def __init__(self, name: str):
        self._jobs: "queue.Queue" = queue.Queue()
        self._busy = threading.Event()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc
            self._busy.clear()
            done.set()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        if self._busy.is_set():
            raise _Stuck("an earlier flag all-reduce is still blocked after its timeout")
        box: dict = {}
        done = threading.Event()
        self._busy.set()
        self._jobs.put((fn, box, done))
        if not done.wait(timeout):
            raise _Stuck("timed out")
        if "error" in box:
            raise box["error"]
        return box["value"]


class HorovodTFFlags(FlagReducer):
    """horovod.tensorflow: the eager all-reduce on a persistent helper thread, bounded by the timeout."""

    name = "horovod.tensorflow"

    def __init__(self, hvd: Any):
        self.hvd = hvd
        self._worker = _Worker("distmem-guard-flags")
        super().__init__(hvd.rank(), hvd.size())

    def reduce(self, vec, timeout):
        import tensorflow as tf

        hvd = self.hvd

        def run():
            return hvd.allreduce(tf.constant(vec, dtype=tf.float64), op=hvd.Sum, name=FLAG_NAME).numpy().tolist()

        try:
            return self._worker.call(run, timeout)
        except _Stuck:
            raise _timeout_error("the guard's flag all-reduce (horovod.tensorflow)", timeout, self.rank,
                                 self.size) from None


class TorchDistFlags(FlagReducer):
    """torch.distributed: ``all_reduce(async_op=True)`` polled (on the GPU for NCCL)."""

    name = "torch.distributed"

    def __init__(self, dist: Any):
        self.dist = dist
        self._abandoned: list = []
        super().__init__(dist.get_rank(), dist.get_world_size())

    def reduce(self, vec, timeout):
        import torch

        device = "cpu"
        if self.dist.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        t = torch.tensor(vec, dtype=torch.float64, device=device)
        work = self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, async_op=True)
        if not _wait(work.is_completed, time.monotonic() + timeout):
            self._abandoned.append((work, t))
            raise _timeout_error("the guard's flag all-reduce (torch.distributed)", timeout, self.rank, self.size)
        work.wait()
        return t.cpu().tolist()


class CommFlags(FlagReducer):
    """Any other distmem transport, through its own all-reduce (which has its own timeout)."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.name = comm.name
        super().__init__(comm.rank, comm.size)

    def reduce(self, vec, timeout):
        return self.comm.allreduce(vec, "sum", timeout)


def flag_reducer(comm: Optional[Comm] = None) -> FlagReducer:
    """The fastest flag transport for ``comm`` (default: the job's transport from ``get_comm()``)."""
    c = comm if comm is not None else get_comm()
    if isinstance(c, SingleComm):
        return SingleFlags(0, 1)
    if isinstance(c, MPIComm):
        return MPIFlags(c.comm)
    if isinstance(c, HorovodComm):
        mod = getattr(c.hvd, "__name__", "")
        if mod.startswith("horovod.torch"):
            return HorovodTorchFlags(c.hvd)
        if mod.startswith("horovod.tensorflow"):
            return HorovodTFFlags(c.hvd)
    if isinstance(c, TorchDistComm):
        return TorchDistFlags(c.dist)
    return CommFlags(c)
