"""torch.distributed (torchrun): object gathers bounded on a helper thread, all-reduces as real
``all_reduce`` calls polled against a deadline (constant message size), on the rank's own GPU.

Under NCCL every tensor of a collective must sit on the rank's own device. The helper thread
that runs an object gather starts with CUDA's current device 0, so it sets the rank's device (the
one distmem's plan pinned, else the caller's current device when the transport was made) before
each call: no stray context on GPU 0, no duplicate-GPU error.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence, Tuple

from .. import session
from ..bounded import Stuck, call_with_timeout
from ..errors import GatherTimeoutError
from .base import (Comm, FlagReducer, check_op, decode_rows, encode_row, flag_timeout_error, resolve_timeout,
                   undecodable_error, wait_until)

__all__ = ["TorchDistComm", "TorchDistFlags", "rank_device", "peer_lost"]


def peer_lost(what: str, rank: int, size: int, exc: BaseException) -> str:
    """The message when the transport itself reports a peer gone (Gloo's "connection closed")."""
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return (f"torch.distributed {what} failed on rank {rank} of {size}: {first}; a peer rank is gone (crashed, "
            "killed or out of memory) - check the other ranks' logs")


def rank_device(dist: Any) -> Optional[int]:
    """The CUDA ordinal this rank's collectives must use under NCCL (None for CPU backends)."""
    if dist.get_backend() != "nccl":
        return None
    plan = session.current_plan()
    if plan is not None and plan.mine.devices:
        return plan.mine.devices[0].index
    import torch

    return torch.cuda.current_device()


class TorchDistComm(Comm):
    """torch.distributed object collectives on the default group."""

    name = "torch.distributed"

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.device = rank_device(dist)
        self._abandoned: List[Any] = []

    def _on_device(self) -> None:
        if self.device is not None:
            import torch

            torch.cuda.set_device(self.device)

    def _allgather_rows(self, obj: Any, timeout: Optional[float], decode: bool = True
                        ) -> Tuple[List[Any], List[int]]:
        """``(rows, failed)``. The rows travel as pickled bytes (which ``all_gather_object`` always
        decodes) and are decoded here one by one when ``decode``: a row that fails is None and
        listed in ``failed``, instead of an exception inside torch that loses every row."""
        timeout = resolve_timeout(timeout)
        payload = encode_row(obj)

        def run():
            self._on_device()
            out: List[Any] = [None] * self.size
            self.dist.all_gather_object(out, payload)
            return out

        try:
            raw = call_with_timeout(run, timeout, "distmem-torch-dist")
        except Stuck:
            raise GatherTimeoutError(
                f"torch.distributed all_gather_object did not complete within {timeout:.1f} s on rank {self.rank} of "
                f"{self.size}: at least one rank never entered it (crashed, hung, or took another code path); check "
                "the other ranks' logs, or raise timeout= / DISTMEM_TIMEOUT") from None
        except RuntimeError as exc:  # Gloo/NCCL: "Connection closed by peer" when a rank is gone
            raise GatherTimeoutError(peer_lost("all_gather_object", self.rank, self.size, exc)) from None
        payloads = [p if decode and r != self.rank else None for r, p in enumerate(raw)]
        rows, failed = decode_rows(payloads, "torch.distributed all_gather_object")
        rows[self.rank] = obj
        return rows, failed

    def allgather(self, obj, timeout=None):
        rows, failed = self._allgather_rows(obj, timeout)
        if failed:
            raise undecodable_error("torch.distributed all_gather_object", failed, self.rank, self.size)
        return rows

    def gather(self, obj, root=0, timeout=None):
        try:
            rows, failed = self._allgather_rows(obj, timeout, decode=self.rank == root)
        except GatherTimeoutError:
            if self.rank != root:
                return None, []
            return [obj if r == root else None for r in range(self.size)], [r for r in range(self.size) if r != root]
        return (rows, failed) if self.rank == root else (None, [])

    def _post(self, values: Sequence[float], op: str) -> Tuple[Any, Any]:
        import torch

        check_op(op)
        device = "cpu" if self.device is None else f"cuda:{self.device}"
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        red = {"sum": self.dist.ReduceOp.SUM, "min": self.dist.ReduceOp.MIN, "max": self.dist.ReduceOp.MAX}[op]
        return self.dist.all_reduce(t, op=red, async_op=True), t

    def _reduce(self, vectors: Sequence[Tuple[Sequence[float], str]], timeout: Optional[float]) -> List[List[float]]:
        """All-reduce each (values, op) pair; every pair is posted before the first is waited for, so
        the reductions are one round's latency. Bounded by ``timeout`` in total."""
        timeout = resolve_timeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            posted = [self._post(values, op) for values, op in vectors]
            if not wait_until(lambda: all(w.is_completed() for w, _ in posted), deadline):
                self._abandoned.extend(posted)
                n = sum(len(t) for _, t in posted)
                raise GatherTimeoutError(
                    f"torch.distributed all-reduce of {n} value(s) did not complete within {timeout:.1f} s on "
                    f"rank {self.rank} of {self.size}: at least one rank never entered it; check the other ranks' "
                    "logs, or raise timeout= / DISTMEM_TIMEOUT")
            for w, _ in posted:
                w.wait()
        except RuntimeError as exc:
            raise GatherTimeoutError(peer_lost("all-reduce", self.rank, self.size, exc)) from None
        return [t.cpu().tolist() for _, t in posted]

    def allreduce(self, values, op="sum", timeout=None):
        return self._reduce([(values, op)], timeout)[0]

    def allreduce_sum_maxloc(self, sums, maxima, timeout=None):
        """Sum and max posted together (one round), then the lowest holders (a second)."""
        timeout = resolve_timeout(timeout)
        t0 = time.monotonic()
        rs, rm = self._reduce([(sums, "sum"), (maxima, "max")], timeout)
        return rs, rm, self._lowest_holders(maxima, rm, max(timeout - (time.monotonic() - t0), 0.001))

    def flag_reducer(self) -> FlagReducer:
        return TorchDistFlags(self.dist, self.device)


class TorchDistFlags(FlagReducer):
    """torch.distributed: ``all_reduce(async_op=True)`` polled (on the rank's GPU for NCCL)."""

    name = "torch.distributed"

    def __init__(self, dist: Any, device: Optional[int] = None):
        self.dist = dist
        self.device = device if device is not None else rank_device(dist)
        self._abandoned: list = []
        super().__init__(dist.get_rank(), dist.get_world_size())

    overlaps = True

    def reduce(self, vec, timeout):
        return self.post(vec).wait(timeout)

    def post(self, vec) -> "_PostedTorch":
        import torch

        device = "cpu" if self.device is None else f"cuda:{self.device}"
        t = torch.tensor(vec, dtype=torch.float64, device=device)
        try:
            work = self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, async_op=True)
        except RuntimeError as exc:
            raise GatherTimeoutError(peer_lost("the guard's flag all-reduce", self.rank, self.size, exc)) from None
        return _PostedTorch(self, work, t)


class _PostedTorch:
    """``all_reduce(async_op=True)`` of the flags in flight on the process group's own threads."""

    def __init__(self, flags: TorchDistFlags, work: Any, t: Any):
        self.flags, self.work, self.t = flags, work, t

    def wait(self, timeout: float) -> List[float]:
        f = self.flags
        try:
            if not wait_until(self.work.is_completed, time.monotonic() + timeout):
                f._abandoned.append((self.work, self.t))
                raise flag_timeout_error("the guard's flag all-reduce (torch.distributed)", timeout, f.rank, f.size)
            self.work.wait()
        except RuntimeError as exc:
            raise GatherTimeoutError(peer_lost("the guard's flag all-reduce", f.rank, f.size, exc)) from None
        return self.t.cpu().tolist()
