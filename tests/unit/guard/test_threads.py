"""In-process "ranks" for guard tests (helpers, plus a test of the helpers): N threads with a barrier-based
transport, so the protocol's consistency (same verdict, same fallback, same weights) is checked without launching MPI."""
from __future__ import annotations

import threading
from typing import Any, Callable, List

from distmem.comm import Comm, reduce_rows
from distmem.errors import GatherTimeoutError


class ThreadWorld:
    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots: List[Any] = [None] * n

    def exchange(self, rank: int, obj: Any, timeout: float) -> List[Any]:
        self.slots[rank] = obj
        try:
            self.barrier.wait(timeout)
            rows = list(self.slots)
            self.barrier.wait(timeout)
        except threading.BrokenBarrierError:
            raise GatherTimeoutError(f"thread rank {rank}: a peer never arrived within {timeout} s") from None
        return rows


class ThreadComm(Comm):
    name = "threads"

    def __init__(self, world: ThreadWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.n

    def allreduce(self, values, op="sum", timeout=30.0):
        return reduce_rows(self.world.exchange(self.rank, [float(v) for v in values], timeout), op)

    def allgather(self, obj, timeout=30.0):
        return self.world.exchange(self.rank, obj, timeout)

    def gather(self, obj, root=0, timeout=30.0):
        rows = self.allgather(obj, timeout)
        return (rows, []) if self.rank == root else (None, [])


def run_ranks(n: int, body: Callable[[ThreadComm], Any], timeout: float = 60.0) -> List[Any]:
    """Run ``body(comm)`` on n threads; returns each rank's result or the exception it raised."""
    world = ThreadWorld(n)
    out: List[Any] = [None] * n

    def target(r: int) -> None:
        try:
            out[r] = body(ThreadComm(world, r))
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[r] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread rank hung: the protocol let ranks diverge"
    return out


def mean_reducer(comm: ThreadComm) -> Callable[[List[Any]], List[Any]]:
    """Average numpy gradients over the thread ranks (what Horovod/MPI do in real jobs)."""

    def reduce(grads: List[Any]) -> List[Any]:
        rows = comm.allgather([None if g is None else g.copy() for g in grads], 30.0)
        return [None if g is None else sum(r[i] for r in rows) / len(rows) for i, g in enumerate(grads)]

    return reduce


def test_thread_comm_reduces_and_times_out():
    assert run_ranks(3, lambda c: c.allreduce([c.rank, 1], "sum")) == [[3.0, 3.0]] * 3
    out = run_ranks(2, lambda c: c.allreduce([1], "sum", timeout=0.5) if c.rank == 0 else "absent")
    assert isinstance(out[0], GatherTimeoutError) and out[1] == "absent"
