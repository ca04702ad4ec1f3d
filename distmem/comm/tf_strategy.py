"""Gather over a tf.distribute strategy: the transport of a ``MultiWorkerMirroredStrategy`` job.

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    distmem.use_strategy(strategy)   # distmem.report() now gathers through the strategy
    ...
    distmem.report()

Every exchange is an all-gather of a small, fixed-size tensor through the strategy's own collective
ops (``ReplicaContext.all_gather`` inside ``strategy.run``): first each worker's payload length,
then the pickled payloads padded to the longest. The collectives take no uint8, and float32 is the
one type every implementation (CPU ring, NCCL) carries, so bytes travel three to a float32 element
(a whole number below 2**24, which float32 holds exactly). All-reduce gathers the values the same
way and reduces them in Python, so byte counts stay exact.

Timeouts. MultiWorkerMirroredStrategy's collectives wait forever by default: a worker that crashed
or took another code path leaves the others blocked. Every call here is bounded twice: TensorFlow's
own ``CommunicationOptions(timeout_seconds=...)`` (which aborts the collective inside the runtime)
and a helper thread joined with the same deadline (which returns control to Python even where the
runtime does not honour it). A timed-out all-gather cannot tell which worker is missing; it names
all the others. After a timeout the strategy's collectives are aborted for the rest of the process:
end the job (every worker should, since one of them is gone).

Under ``mpirun`` (TF_CONFIG built from the MPI ranks) ``use_strategy`` prefers MPI, whose
point-to-point gather has a real per-rank timeout and names exactly the ranks that did not arrive.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..bounded import Stuck, call_with_timeout
from .base import (Comm, check_op, decode_rows, encode_row, mpi_launched, reduce_rows, resolve_timeout,
                   undecodable_error)
from ..errors import ConfigError, GatherTimeoutError

__all__ = ["StrategyComm", "use_strategy", "worker_position", "pack", "unpack", "MAX_PAYLOAD_BYTES"]

log = logging.getLogger("distmem")

#: Seconds TensorFlow's own collective timeout runs past distmem's, so that distmem's bound (which
#: can name the call and the remedy) normally fires first and TensorFlow's is the backstop.
_TF_GRACE = 2.0
#: Largest payload one worker may send: lengths travel as float32, exact below 2**24.
MAX_PAYLOAD_BYTES = 2**24 - 1


def pack(payload: bytes, width: int) -> Any:
    """Bytes -> float32 row of ``width`` elements, three bytes per element (exact in float32)."""
    import numpy as np

    buf = np.zeros(width * 3, dtype=np.uint32)
    buf[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    trios = buf.reshape(-1, 3)
    return (trios[:, 0] | (trios[:, 1] << 8) | (trios[:, 2] << 16)).astype(np.float32)


def unpack(row: Any, length: int) -> bytes:
    import numpy as np

    ints = np.asarray(row).astype(np.uint32)
    trios = np.stack([ints & 0xFF, (ints >> 8) & 0xFF, (ints >> 16) & 0xFF], axis=1).astype(np.uint8)
    return trios.reshape(-1).tobytes()[:length]


def worker_position(strategy: Any) -> Tuple[int, int]:
    """``(rank, size)`` of this process among the strategy's workers (1 process: ``(0, 1)``).

    Ranks follow TF_CONFIG's order as :mod:`distmem.discover.identity` reads it: a ``chief`` first, then the
    workers by index; evaluators and parameter servers hold no rank.
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 0, 1
    spec = resolver.cluster_spec().as_dict()
    order: List[Tuple[str, int]] = []
    for kind in ("chief", "worker"):
        tasks = spec.get(kind) or []
        ids = sorted(tasks) if isinstance(tasks, dict) else range(len(tasks))
        order += [(kind, int(i)) for i in ids]
    if not order:
        return 0, 1
    me = (resolver.task_type, int(resolver.task_id or 0))
    if me not in order:
        raise ConfigError(f"this task ({me[0]} {me[1]}) is not a chief or worker of the strategy's cluster "
                          f"{spec}; only chief and worker tasks take part in distmem's gather")
    return order.index(me), len(order)


class _QuietEagerWarning(logging.Filter):
    """Drop TensorFlow's "using ... eagerly has significant overhead" and "triggered tf.function
    retracing" warnings for distmem's own tiny collectives (logged from distmem's helper threads, whose
    names start with ``distmem-``), and only for those: the user's own warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (record.threadName.startswith("distmem-")
                    and ("eagerly has significant" in msg or "triggered tf.function retracing" in msg))


_QUIET = _QuietEagerWarning()


class StrategyComm(Comm):
    """All-gather through a tf.distribute strategy's collectives, each call bounded by ``timeout``.

    ``rank``/``size`` count workers (processes), not replicas: a worker with several local
    replicas contributes one row.
    """

    name = "tf.distribute"

    def __init__(self, strategy: Any):
        import tensorflow as tf

        self._tf = tf
        self.strategy = strategy
        self.rank, self.size = worker_position(strategy)
        replicas = int(strategy.num_replicas_in_sync)
        if replicas % self.size:
            raise ConfigError(f"{replicas} replicas in sync do not divide over {self.size} workers; every worker "
                              "must run the same number of local replicas (devices)")
        self._per_worker = replicas // self.size
        self._fns: Dict[int, Any] = {}
        self._aborted: Optional[str] = None
        tf_log = logging.getLogger("tensorflow")
        if _QUIET not in tf_log.filters:
            tf_log.addFilter(_QUIET)

    def _gather_fn(self, tf_timeout: int) -> Any:
        """The all-gather, run eagerly: traced, the input tensor has no device and the strategy's
        gather refuses it. ``tf_timeout`` (whole seconds) keys the cache with its options."""
        if tf_timeout not in self._fns:
            tf, strategy = self._tf, self.strategy
            options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=float(tf_timeout))

            def replica_fn(x: Any) -> Any:
                return tf.distribute.get_replica_context().all_gather(x, axis=0, options=options)

            self._fns[tf_timeout] = lambda x: strategy.run(replica_fn, args=(x,))
        return self._fns[tf_timeout]

    def _rows(self, row: Any, timeout: float, what: str, tf_timeout: Optional[float] = None) -> Any:
        """All-gather one 1-D numpy row per worker within ``timeout`` s; returns a ``[size, len]`` array.

        ``tf_timeout`` (default ``timeout``) sets TensorFlow's own backstop, a little later than ours."""
        import numpy as np

        if self._aborted:
            raise GatherTimeoutError(f"{what} cannot run: an earlier tf.distribute collective timed out "
                                     f"({self._aborted}); the strategy's collectives stay aborted - end the job")
        tf = self._tf
        fn = self._gather_fn(math.ceil((tf_timeout or timeout) + _TF_GRACE))

        def run() -> Any:
            out = fn(tf.constant(row[None, :]))
            return self.strategy.experimental_local_results(out)[0].numpy()

        try:
            full = call_with_timeout(run, timeout, "distmem-tf-distribute")
        except Stuck:
            self._aborted = f"{what} after {timeout:.1f} s"
            raise GatherTimeoutError(
                f"tf.distribute {what} did not complete within {timeout:.1f} s on worker {self.rank} of {self.size}: "
                "at least one worker never entered it (crashed, hung, or took another code path); "
                "MultiWorkerMirroredStrategy collectives have no timeout of their own, distmem bounds them - check "
                "the other workers' output, or raise timeout= / DISTMEM_TIMEOUT",
                [r for r in range(self.size) if r != self.rank]) from None
        except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError, tf.errors.CancelledError) as exc:
            self._aborted = f"{what}: {type(exc).__name__}"
            raise GatherTimeoutError(
                f"tf.distribute {what} failed on worker {self.rank} of {self.size} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]}); a peer worker is gone or late - check its output",
                [r for r in range(self.size) if r != self.rank]) from None
        return np.asarray(full)[:: self._per_worker]

    def _allgather_rows(self, obj: Any, timeout: Optional[float], decode: bool = True
                        ) -> Tuple[List[Any], List[int]]:
        """``(rows, failed)``: every worker's object (this one's as given), each row decoded on its
        own when ``decode``; rows that fail to decode are None and listed in ``failed``."""
        import numpy as np

        timeout = resolve_timeout(timeout)
        if self.size == 1:
            return [obj], []
        deadline = time.monotonic() + timeout
        payload = encode_row(obj)
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ConfigError(f"a tf.distribute gather carries at most {MAX_PAYLOAD_BYTES} bytes per worker, this "
                              f"worker has {len(payload)}; gather a summary (distmem.report(detail='summary'))")
        lengths = self._rows(np.array([len(payload)], dtype=np.float32), timeout, "length all-gather")[:, 0]
        lengths = [int(n) for n in lengths]
        width = max(1, math.ceil(max(lengths) / 3))
        left = max(deadline - time.monotonic(), 0.001)
        rows = self._rows(pack(payload, width), left, "all-gather", tf_timeout=timeout)
        payloads = [unpack(rows[r], lengths[r]) if decode and r != self.rank else None for r in range(self.size)]
        out, failed = decode_rows(payloads, "tf.distribute all-gather")
        out[self.rank] = obj
        return out, failed

    def allgather(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        rows, failed = self._allgather_rows(obj, timeout)
        if failed:
            raise undecodable_error("tf.distribute all-gather", failed, self.rank, self.size)
        return rows

    def gather(self, obj: Any, root: int = 0, timeout: Optional[float] = None
               ) -> Tuple[Optional[List[Any]], List[int]]:
        try:
            rows, failed = self._allgather_rows(obj, timeout, decode=self.rank == root)
        except GatherTimeoutError as exc:
            if self.rank != root:
                log.warning("distmem: %s", exc)
                return None, []
            log.warning("distmem: %s", exc)
            return [obj if r == root else None for r in range(self.size)], [r for r in range(self.size) if r != root]
        return (rows, failed) if self.rank == root else (None, [])

    def allreduce_sum_maxloc(self, sums, maxima, timeout=None):
        return self.sum_maxloc_by_allgather(sums, maxima, timeout)

    def allreduce(self, values: Sequence[float], op: str = "sum", timeout: Optional[float] = None) -> List[float]:
        check_op(op)
        if self.size == 1:
            return [float(v) for v in values]
        rows = self.allgather([float(v) for v in values], timeout)
        return reduce_rows(rows, op)


def use_strategy(strategy: Any, *, prefer_mpi: bool = True) -> Comm:
    """Make distmem gather through ``strategy`` from now on; returns the transport in use.

    Call it once after creating the strategy (and after ``distmem.init()``, which must come before
    it). Under an MPI launcher with mpi4py installed, MPI is used instead (``prefer_mpi=False`` forces
    the strategy): its gather names exactly the ranks that did not arrive.
    """
    comm: Comm
    if prefer_mpi and mpi_launched():
        try:
            from .mpi import MPIComm

            comm = MPIComm()
        except ImportError:
            comm = StrategyComm(strategy)
    else:
        comm = StrategyComm(strategy)
    from ..discover.identity import from_env

    topo = from_env()
    if topo is not None and (topo.rank, topo.size) != (comm.rank, comm.size):
        raise ConfigError(f"the launcher says rank {topo.rank} of {topo.size} ({topo.source}) but the strategy says "
                          f"worker {comm.rank} of {comm.size}; build TF_CONFIG from the same ranks the launcher uses")
    from . import set_comm  # the package selects; this module only builds a transport

    set_comm(comm)
    return comm
