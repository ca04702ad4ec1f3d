"""The one transport interface, the one-process transport and the pieces every transport shares.

A :class:`Comm` gathers to a root, all-gathers and all-reduces short float vectors, each call
bounded by a timeout; :meth:`Comm.flag_reducer` hands the OOM guard the fastest per-step flag
all-reduce the transport has. Every collective is entered by all ranks in the same order; a call
that cannot complete returns (gather) or raises :class:`~distmem.errors.GatherTimeoutError`
within ``timeout`` seconds.

Rows travel pickled and are decoded one by one (:func:`decode_rows`): a row this process cannot
decode (a class it cannot import, a truncated payload) is reported like a rank that did not arrive,
and every other row is kept.
"""
from __future__ import annotations

import logging
import os
import pickle
import time
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from .. import settings
from ..errors import ConfigError, GatherTimeoutError

__all__ = ["Comm", "SingleComm", "FlagReducer", "PostedFlags", "SingleFlags", "CommFlags", "REDUCE_OPS", "check_op",
           "reduce_rows", "reduce_sum_maxloc", "resolve_timeout", "mpi_launched", "wait_until", "SPIN_SECONDS", "flag_timeout_error",
           "encode_row", "decode_rows", "undecodable_error"]

log = logging.getLogger("distmem")

REDUCE_OPS = ("sum", "min", "max")
_NEG_INF = float("-inf")


def resolve_timeout(timeout: Optional[float]) -> float:
    """``timeout`` in seconds (validated), or ``DISTMEM_TIMEOUT`` (default 60) when None."""
    if timeout is None:
        return settings.timeout()
    return settings.positive_seconds(timeout, "timeout", "pass seconds, e.g. timeout=60")


def encode_row(obj: Any) -> bytes:
    """One rank's row as it travels (pickle, highest protocol)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode_rows(payloads: Sequence[Optional[bytes]], what: str) -> Tuple[List[Any], List[int]]:
    """``(rows, failed)``: each rank's payload decoded on its own. A payload that fails to decode
    becomes None and its rank is listed in ``failed`` (a warning names it and why), so the caller
    reports it like a missing rank and keeps the other rows. A None payload (not received, or not
    to be decoded here) stays None and is not a failure."""
    rows: List[Any] = []
    failed: List[int] = []
    for rank, payload in enumerate(payloads):
        if payload is None:
            rows.append(None)
            continue
        try:
            rows.append(pickle.loads(payload))
        except Exception as exc:  # noqa: BLE001 - unpickling can raise anything: the row is lost, not the call
            rows.append(None)
            failed.append(rank)
            log.warning("distmem: %s: the row of rank %d (%d bytes) cannot be decoded here (%s: %s); rank %d is "
                        "reported as missing and the other rows are kept", what, rank, len(payload),
                        type(exc).__name__, str(exc)[:200], rank)
    return rows, failed


def undecodable_error(what: str, failed: Sequence[int], rank: int, size: int) -> GatherTimeoutError:
    """An all-gather whose rows of ``failed`` ranks could not be decoded on ``rank``: the error of a
    missing rank (``missing`` lists them), since the call cannot return a row for each rank."""
    return GatherTimeoutError(
        f"{what} on rank {rank} of {size}: the row(s) of rank(s) {list(failed)} arrived but cannot be decoded here "
        "(the warning above says why: often a class that rank sent which this process cannot import, or "
        "different package versions across ranks); run every rank with the same code and environment", failed)


def mpi_launched(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when an MPI launcher (mpirun, horovodrun --mpi, srun with PMI) started this process."""
    env = os.environ if env is None else env
    return any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"))


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ConfigError(f"reduce op {op!r} is not one of {', '.join(REDUCE_OPS)}")


def reduce_rows(rows: Sequence[Sequence[float]], op: str) -> List[float]:
    """Element-wise ``op`` over equal-length rows (the reduction of an all-gather)."""
    fn: Callable = {"sum": sum, "min": min, "max": max}[op]
    return [float(fn(col)) for col in zip(*rows)]


def reduce_sum_maxloc(rows: Sequence[Tuple[Sequence[float], Sequence[float]]], ranks: Sequence[int]
                      ) -> Tuple[List[float], List[float], List[Optional[int]]]:
    """:meth:`Comm.allreduce_sum_maxloc` over rows held in one place: ``rows[k]`` = (sums, maxima)
    of rank ``ranks[k]``. Sums add; each maximum comes with the lowest rank holding it (None where
    every rank gave -inf)."""
    rs = reduce_rows([r[0] for r in rows], "sum")
    rm: List[float] = []
    holders: List[Optional[int]] = []
    for i in range(len(rows[0][1]) if rows else 0):
        best, who = _NEG_INF, None
        for rank, (_, mx) in zip(ranks, rows):
            if mx[i] > best or (mx[i] == best and who is not None and rank < who):
                best, who = mx[i], rank
        rm.append(best)
        holders.append(who)
    return rs, rm, holders


#: How long :func:`wait_until` polls without sleeping before it backs off (seconds).
SPIN_SECONDS = 0.002


def wait_until(test: Callable[[], bool], deadline: float) -> bool:
    """Poll ``test`` until it is true or ``time.monotonic()`` passes ``deadline``.

    First ``SPIN_SECONDS`` (2 ms) of polling that yields the core between tests
    (``os.sched_yield``) - ranks of one collective usually arrive within that, and a sleep of even
    20 us costs 60-100 us of wake-up latency on Linux, more than a whole small gather - then sleeps
    of 50 us doubling to 1 ms, so a rank that waits long for a late one does not hold a core."""
    if test():
        return True
    spin_until = time.perf_counter() + SPIN_SECONDS
    yield_ = getattr(os, "sched_yield", None)
    while time.perf_counter() < spin_until:
        if test():
            return True
        if yield_ is not None:
            yield_()
    delay = 0.00005
    while not test():
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(0.001, delay * 2)
    return True


def flag_timeout_error(what: str, timeout: float, rank: int, size: int) -> GatherTimeoutError:
    return GatherTimeoutError(
        f"{what} did not complete within {timeout:.1f} s on rank {rank} of {size}: at least one rank never "
        "reached the guard's flag all-reduce (it crashed, hung, raised outside the guarded step, or ran a "
        "different number of steps). Every rank that waits raises this instead of hanging; check the other "
        "ranks' logs, and raise timeout= (or DISTMEM_TIMEOUT) if one step can take longer")


class PostedFlags:
    """A flag all-reduce posted by :meth:`FlagReducer.post`; :meth:`wait` returns the reduced vector
    (GatherTimeoutError after ``timeout`` seconds from the wait). This default one reduces at the
    wait (transports without a non-blocking all-reduce): correct, only not overlapped."""

    def __init__(self, reducer: "FlagReducer", vec: List[float]):
        self.reducer, self.vec = reducer, vec

    def wait(self, timeout: float) -> List[float]:
        return self.reducer.reduce(self.vec, timeout)


class FlagReducer:
    """Sum-all-reduce of a short float vector with a timeout (the OOM guard's per-step verdict).
    ``reduce`` raises GatherTimeoutError. ``post`` starts it without waiting (the overlapped guard:
    posted before the gradient all-reduce, waited after it); ``overlaps`` says whether this
    transport really runs it in the background."""

    name = "base"
    overlaps = False

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def reduce(self, vec: List[float], timeout: float) -> List[float]:
        raise NotImplementedError

    def post(self, vec: List[float]) -> PostedFlags:
        return PostedFlags(self, vec)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"


class SingleFlags(FlagReducer):
    name = "single"

    def reduce(self, vec: List[float], timeout: float) -> List[float]:
        return list(vec)


class Comm:
    """A transport. ``gather`` returns ``(objects, missing)`` on the root, ``(None, [])`` elsewhere.
    ``timeout=None`` means ``DISTMEM_TIMEOUT`` (default 60 s)."""

    name = "base"
    rank = 0
    size = 1

    def gather(self, obj: Any, root: int = 0, timeout: Optional[float] = None
               ) -> Tuple[Optional[List[Any]], List[int]]:
        raise NotImplementedError

    def allreduce(self, values: Sequence[float], op: str = "sum", timeout: Optional[float] = None) -> List[float]:
        raise NotImplementedError

    def allgather(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        raise NotImplementedError

    def allreduce_sum_maxloc(self, sums: Sequence[float], maxima: Sequence[float], timeout: Optional[float] = None
                             ) -> Tuple[List[float], List[float], List[Optional[int]]]:
        """The summary report's reduction: element-wise sum of ``sums``; element-wise max of
        ``maxima`` and, for each, the lowest rank whose own value equals it (None where every rank
        gave -inf). Bounded by ``timeout`` in total. Default: three all-reduces (sum, max, then the
        max of ``-rank`` over the holders); transports with a max-with-location override it."""
        timeout = resolve_timeout(timeout)
        deadline = time.monotonic() + timeout
        left = lambda: max(deadline - time.monotonic(), 0.001)  # noqa: E731
        rs = self.allreduce(sums, "sum", left())
        rm = self.allreduce(maxima, "max", left())
        return rs, rm, self._lowest_holders(maxima, rm, left())

    def sum_maxloc_by_allgather(self, sums: Sequence[float], maxima: Sequence[float],
                                timeout: Optional[float] = None
                                ) -> Tuple[List[float], List[float], List[Optional[int]]]:
        """:meth:`allreduce_sum_maxloc` in one all-gather of every rank's two vectors, reduced here:
        for transports whose all-reduce is an all-gather anyway (Horovod's object collectives,
        tf.distribute), one round instead of three; the message grows with the ranks."""
        rows = self.allgather(([float(v) for v in sums], [float(v) for v in maxima]), timeout)
        return reduce_sum_maxloc(rows, range(len(rows)))

    def _lowest_holders(self, maxima: Sequence[float], reduced: Sequence[float], timeout: float
                        ) -> List[Optional[int]]:
        mine = [-float(self.rank) if (v != _NEG_INF and v == m) else _NEG_INF for v, m in zip(maxima, reduced)]
        return [None if v == _NEG_INF else int(-v) for v in self.allreduce(mine, "max", timeout)]

    def barrier(self, timeout: Optional[float] = None) -> None:
        self.allreduce([0.0], "sum", timeout)

    def flag_reducer(self) -> FlagReducer:
        """The guard's per-step flag all-reduce on this transport (default: through :meth:`allreduce`)."""
        return CommFlags(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"


class CommFlags(FlagReducer):
    """Flags through a transport's own all-reduce (which carries its own timeout)."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.name = comm.name
        super().__init__(comm.rank, comm.size)

    def reduce(self, vec: List[float], timeout: float) -> List[float]:
        return self.comm.allreduce(vec, "sum", timeout)


class SingleComm(Comm):
    """One process: every collective is the identity."""

    name = "single"

    def gather(self, obj, root=0, timeout=None):
        resolve_timeout(timeout)
        return [obj], []

    def allreduce(self, values, op="sum", timeout=None):
        check_op(op)
        resolve_timeout(timeout)
        return [float(v) for v in values]

    def allgather(self, obj, timeout=None):
        resolve_timeout(timeout)
        return [obj]

    def flag_reducer(self) -> FlagReducer:
        return SingleFlags(0, 1)
