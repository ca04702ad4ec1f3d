"""The guarded step's gradient all-reduce: average a list of gradients over all ranks.

Chosen by the gradients' type and what the job runs on: Horovod of the gradients' framework
(``grouped_allreduce``, op Average), torch.distributed (one flat buffer per dtype and device), mpi4py
(one host buffer per dtype, ``Allreduce`` in place), or the identity for one process. These are the
frameworks' ordinary blocking collectives. The blocking step enters them only after a clean verdict;
the overlapped step enters them on every rank (zeros where a rank has no gradients) with the
verdict riding in the same buffer (:class:`CarryingReducer`), so a clean step costs one element more
than the unguarded all-reduce and no collective of its own.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..comm import Comm, MPIComm, SingleComm, get_comm
from ..discover import runtime
from ..errors import ConfigError

__all__ = ["gradient_reducer", "Reducer", "CarryingReducer", "kind_of", "dense"]

Reducer = Callable[[List[Any]], List[Any]]


def kind_of(value: Any) -> str:
    """``"torch"``, ``"tensorflow"`` or ``"numpy"`` for a tensor / array (by module, imports nothing)."""
    mod = type(value).__module__
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("tensorflow") or mod.startswith("keras"):
        return "tensorflow"
    return "numpy"


def dense(g: Any) -> Any:
    """A TensorFlow ``IndexedSlices`` as a dense tensor; anything else as it is."""
    return _dense(g)


def _dense(g: Any) -> Any:
    if type(g).__name__ == "IndexedSlices":
        import tensorflow as tf

        return tf.convert_to_tensor(g)
    return g


class CarryingReducer:
    """A gradient all-reduce that can carry the guard's verdict in its own buffer: ``reducer(grads)``
    averages the gradients; ``reducer.with_flag(grads, flag)`` does the same in the same collective
    with one more element, ``flag`` (0.0 on a rank whose step was clean, 1.0 otherwise), and
    returns ``(averaged grads, reduced flag)``. The reduced flag is 0 on every rank exactly when
    every rank was clean (a sum or an average of zeros and ones), so the overlapped step needs no
    collective of its own; who failed, and why, is gathered only when it is not 0."""

    carries_flag = True

    def __init__(self, flat: Callable[[List[Any], Optional[float]], Tuple[List[Any], float]]):
        self._flat = flat

    def __call__(self, grads: List[Any]) -> List[Any]:
        return self.with_flag(grads, None)[0]

    def with_flag(self, grads: List[Any], flag: Optional[float]) -> Tuple[List[Any], float]:
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx and flag is None:
            return list(grads), 0.0
        out, reduced = self._flat([_dense(grads[i]) for i in idx], flag)
        res = list(grads)
        for i, g in zip(idx, out):
            res[i] = g
        return res, reduced


def _hvd_reducer(hvd: Any, kind: str) -> CarryingReducer:
    def run(grads: List[Any], flag: Optional[float]) -> Tuple[List[Any], float]:
        if flag is None:
            return list(hvd.grouped_allreduce(grads, op=hvd.Average)), 0.0
        # the flag in the gradients' own dtype and device (one group of one kind): any float type
        # holds 0 exactly and an average of zeros and ones that is not all zeros is not 0
        if kind == "torch":
            import torch

            like = grads[0] if grads else None
            extra = torch.full((1,), flag, dtype=like.dtype if like is not None else torch.float32,
                               device=like.device if like is not None else "cpu")
        else:
            import tensorflow as tf

            extra = tf.constant([flag], dtype=grads[0].dtype if grads else tf.float32)
        out = list(hvd.grouped_allreduce(list(grads) + [extra], op=hvd.Average))
        return out[:-1], float(out[-1][0])  # an average of zeros and ones: 0 exactly when all are 0

    return CarryingReducer(run)


def _torch_dist_reducer(dist: Any) -> CarryingReducer:
    def run(grads: List[Any], flag: Optional[float]) -> Tuple[List[Any], float]:
        import torch

        n = dist.get_world_size()
        out: List[Any] = [None] * len(grads)
        groups: dict = {}
        for i, g in enumerate(grads):
            groups.setdefault((g.dtype, g.device), []).append(i)
        reduced = 0.0
        first = True
        for idx in groups.values():
            parts = [grads[i].detach().reshape(-1) for i in idx]
            carry = flag is not None and first
            if carry:  # the verdict rides in the first buffer (any float dtype holds 0 and n exactly)
                parts.append(torch.full((1,), flag, dtype=parts[0].dtype, device=parts[0].device))
            flat = torch.cat(parts)
            dist.all_reduce(flat)
            if carry:
                reduced, flat = float(flat[-1]), flat[:-1]
            first = False
            flat /= n
            pos = 0
            for i in idx:
                k = grads[i].numel()
                out[i] = flat[pos:pos + k].view_as(grads[i])
                pos += k
        if flag is not None and not groups:
            t = torch.full((1,), flag, dtype=torch.float32)
            dist.all_reduce(t)
            reduced = float(t[0])
        return out, reduced

    return CarryingReducer(run)


def _to_numpy(g: Any, kind: str) -> Any:
    import numpy as np

    if kind == "torch":
        return g.detach().cpu().numpy()
    if kind == "tensorflow":
        return g.numpy()
    return np.asarray(g)


def _from_numpy(a: Any, like: Any, kind: str) -> Any:
    if kind == "torch":
        import torch

        return torch.from_numpy(a).to(device=like.device, dtype=like.dtype).view(like.shape)
    if kind == "tensorflow":
        import tensorflow as tf

        return tf.convert_to_tensor(a.reshape(tuple(like.shape)), dtype=like.dtype)
    return a.reshape(like.shape)


def _mpi_reducer(comm: MPIComm) -> CarryingReducer:
    def run(grads: List[Any], flag: Optional[float]) -> Tuple[List[Any], float]:
        import numpy as np
        from mpi4py import MPI

        kind = kind_of(grads[0]) if grads else "numpy"
        arrays = [_to_numpy(g, kind) for g in grads]
        out: List[Any] = [None] * len(grads)
        groups: dict = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.dtype.str, []).append(i)
        if flag is not None and not groups:
            groups[np.dtype("float64").str] = []
        reduced = 0.0
        first = True
        for dt, idx in groups.items():
            parts = [arrays[i].reshape(-1) for i in idx]
            carry = flag is not None and first
            if carry:  # the verdict rides in the first buffer
                parts.append(np.array((flag,), dtype=dt))
            flat = np.concatenate(parts)
            comm.comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
            if carry:
                reduced, flat = float(flat[-1]), flat[:-1]
            first = False
            flat /= comm.size
            pos = 0
            for i in idx:
                k = arrays[i].size
                out[i] = _from_numpy(flat[pos:pos + k], grads[i], kind)
                pos += k
        return out, reduced

    return CarryingReducer(run)


def gradient_reducer(comm: Optional[Comm] = None, sample: Optional[Sequence[Any]] = None) -> Reducer:
    """A function that averages a list of gradients (tensors, arrays or None) over all ranks.

    ``sample``: gradients of the kind that will be reduced (decides torch / TensorFlow / NumPy).
    """
    c = comm if comm is not None else get_comm()
    present = [g for g in (sample or []) if g is not None]
    kind = kind_of(present[0]) if present else "numpy"
    if c.size == 1:
        return lambda grads: list(grads)
    hvd = runtime.horovod(kind) if kind in ("torch", "tensorflow") else None
    if hvd is not None:
        return _hvd_reducer(hvd, kind)
    dist = runtime.torch_distributed() if kind == "torch" else None
    if dist is not None:
        return _torch_dist_reducer(dist)
    if isinstance(c, MPIComm):
        return _mpi_reducer(c)
    if isinstance(c, SingleComm):
        return lambda grads: list(grads)
    raise ConfigError(
        f"no way to all-reduce {kind} gradients over {c.size} ranks on transport {c.name!r}: initialise Horovod "
        "for this framework (hvd.init()), torch.distributed, or launch with mpirun and mpi4py; or pass "
        "reduce_gradients=<callable taking and returning a list of gradients>, or reduce_gradients=None when "
        "apply() all-reduces itself")
