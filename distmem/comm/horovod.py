"""Horovod (Gloo or MPI controller): object collectives bounded by a timeout on a helper thread,
and the guard's flags by Horovod's own tensor all-reduce.

``allreduce`` goes through the object all-gather on purpose: Horovod matches collectives by name,
and a tensor all-reduce whose name two diverged ranks reuse with different lengths fails with a
shape mismatch instead of the timeout that names the problem. Its message therefore grows with
the number of ranks (8 bytes x values x ranks): the README says so beside ``detail="summary"``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, List, Optional, Tuple

from ..bounded import Stuck, call_with_timeout
from ..errors import GatherTimeoutError
from .base import (Comm, FlagReducer, check_op, decode_rows, encode_row, flag_timeout_error, reduce_rows,
                   resolve_timeout, undecodable_error, wait_until)

__all__ = ["HorovodComm", "HorovodTorchFlags", "HorovodTFFlags", "FLAG_NAME"]

log = logging.getLogger("distmem")

FLAG_NAME = "distmem.guard.flag"  # one fixed name: Horovod's response cache then serves every step


def _lost(what: str, rank: int, size: int, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return (f"Horovod {what} failed on rank {rank} of {size} ({type(exc).__name__}: {first}): a peer rank is gone "
            "(crashed, killed or out of memory) and Horovod shut down; check the other ranks' logs")


def _encode(obj: Any) -> bytes:
    """A row as Horovod's object collectives always pickled it: with cloudpickle (classes and
    functions of ``__main__`` by value), which Horovod requires; plain pickle where it is missing."""
    try:
        import cloudpickle
    except ImportError:
        return encode_row(obj)
    return cloudpickle.dumps(obj)


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

    def _allgather_rows(self, obj: Any, timeout: Optional[float], decode: bool = True
                        ) -> Tuple[List[Any], List[int]]:
        """``(rows, failed)``. The rows travel as pickled bytes (which Horovod's own pickling always
        decodes) and are decoded here one by one when ``decode``: a row that fails is None and listed
        in ``failed``, instead of an exception inside Horovod that loses every row."""
        timeout = resolve_timeout(timeout)
        name = self._name("allgather")
        payload = _encode(obj)
        try:
            raw = call_with_timeout(lambda: self.hvd.allgather_object(payload, name=name), timeout, "distmem-horovod")
        except Stuck:
            raise GatherTimeoutError(
                f"Horovod allgather did not complete within {timeout:.1f} s on rank {self.rank} of {self.size}: at "
                "least one rank never entered it; Horovod's stall warnings in the log name the missing ranks "
                "(HOROVOD_STALL_CHECK_TIME_SECONDS)") from None
        except Exception as exc:  # noqa: BLE001 - "Horovod has been shut down" when a peer left
            raise GatherTimeoutError(_lost("allgather", self.rank, self.size, exc)) from None
        payloads = [p if decode and r != self.rank else None for r, p in enumerate(raw)]
        rows, failed = decode_rows(payloads, "Horovod allgather")
        rows[self.rank] = obj
        return rows, failed

    def allgather(self, obj, timeout=None):
        rows, failed = self._allgather_rows(obj, timeout)
        if failed:
            raise undecodable_error("Horovod allgather", failed, self.rank, self.size)
        return rows

    def gather(self, obj, root=0, timeout=None):
        try:
            rows, failed = self._allgather_rows(obj, timeout, decode=self.rank == root)
        except Exception as exc:  # noqa: BLE001 - a timeout, or "Horovod has been shut down" when a peer left
            if self.rank != root:
                return None, []
            log.warning("distmem: %s", exc)
            return [obj if r == root else None for r in range(self.size)], \
                [r for r in range(self.size) if r != root]
        return (rows, failed) if self.rank == root else (None, [])

    def allreduce_sum_maxloc(self, sums, maxima, timeout=None):
        return self.sum_maxloc_by_allgather(sums, maxima, timeout)

    def allreduce(self, values, op="sum", timeout=None):
        check_op(op)
        rows = self.allgather([float(v) for v in values], timeout)
        return reduce_rows(rows, op)

    def flag_reducer(self) -> FlagReducer:
        mod = getattr(self.hvd, "__name__", "")
        if mod.startswith("horovod.torch"):
            return HorovodTorchFlags(self.hvd)
        if mod.startswith("horovod.tensorflow"):
            return HorovodTFFlags(self.hvd)
        return super().flag_reducer()


class HorovodTorchFlags(FlagReducer):
    """horovod.torch: asynchronous all-reduce polled until done: a timeout without a thread."""

    name = "horovod.torch"

    def __init__(self, hvd: Any):
        self.hvd = hvd
        self._abandoned: list = []
        super().__init__(hvd.rank(), hvd.size())

    overlaps = True

    def reduce(self, vec, timeout):
        return self.post(vec).wait(timeout)

    def post(self, vec) -> "_PostedHorovodTorch":
        import torch

        t = torch.tensor(vec, dtype=torch.float64)
        try:
            handle = self.hvd.allreduce_async_(t, op=self.hvd.Sum, name=FLAG_NAME)
        except Exception as exc:  # noqa: BLE001 - Horovod shut down under a lost peer
            raise GatherTimeoutError(_lost("the guard's flag all-reduce", self.rank, self.size, exc)) from None
        return _PostedHorovodTorch(self, handle, t)


class _PostedHorovodTorch:
    """``allreduce_async_`` of the flags in flight on Horovod's background thread."""

    def __init__(self, flags: HorovodTorchFlags, handle: Any, t: Any):
        self.flags, self.handle, self.t = flags, handle, t

    def wait(self, timeout: float) -> List[float]:
        f, hvd = self.flags, self.flags.hvd
        try:
            if not wait_until(lambda: hvd.poll(self.handle), time.monotonic() + timeout):
                f._abandoned.append((self.handle, self.t))
                raise flag_timeout_error("the guard's flag all-reduce (horovod.torch)", timeout, f.rank, f.size)
            return hvd.synchronize(self.handle).tolist()
        except GatherTimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - Horovod shut down under a lost peer
            raise GatherTimeoutError(_lost("the guard's flag all-reduce", f.rank, f.size, exc)) from None


class HorovodTFFlags(FlagReducer):
    """horovod.tensorflow: the eager all-reduce on a persistent helper thread, bounded by the timeout."""

    name = "horovod.tensorflow"

    def __init__(self, hvd: Any):
        self.hvd = hvd
        super().__init__(hvd.rank(), hvd.size())

    def reduce(self, vec, timeout):
        import tensorflow as tf

        hvd = self.hvd

        def run():
            return hvd.allreduce(tf.constant(vec, dtype=tf.float64), op=hvd.Sum, name=FLAG_NAME).numpy().tolist()

        try:
            return call_with_timeout(run, timeout, "distmem-guard-flags", while_stuck="fail")
        except Stuck:
            raise flag_timeout_error("the guard's flag all-reduce (horovod.tensorflow)", timeout, self.rank,
                                     self.size) from None
        except Exception as exc:  # noqa: BLE001 - Horovod shut down under a lost peer
            raise GatherTimeoutError(_lost("the guard's flag all-reduce", self.rank, self.size, exc)) from None
