"""The gradient all-reduce after a clean verdict: average a list of gradients over all ranks.

Chosen by the gradients' type and what the job runs on: Horovod of the gradients' framework
(``grouped_allreduce``, op Average), torch.distributed (one flat buffer per dtype and device), mpi4py
(one host buffer per dtype, ``Allreduce`` in place), or the identity for one process. Only entered
after every rank reported OK, so these are the frameworks' ordinary blocking collectives.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from ..comm import Comm, MPIComm, SingleComm, get_comm
from ..discover import runtime
from ..errors import ConfigError

__all__ = ["gradient_reducer", "Reducer", "kind_of", "dense"]

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


def _by_present(fn: Reducer) -> Reducer:
    """Reduce only the non-None entries, put the results back in place."""

    def run(grads: List[Any]) -> List[Any]:
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            return list(grads)
        out = fn([_dense(grads[i]) for i in idx])
        res = list(grads)
        for i, g in zip(idx, out):
            res[i] = g
        return res

    return run


def _hvd_reducer(hvd: Any) -> Reducer:
    def run(grads: List[Any]) -> List[Any]:
        return list(hvd.grouped_allreduce(grads, op=hvd.Average))

    return _by_present(run)


def _torch_dist_reducer(dist: Any) -> Reducer:
    def run(grads: List[Any]) -> List[Any]:
        import torch

        n = dist.get_world_size()
        out: List[Any] = [None] * len(grads)
        groups: dict = {}
        for i, g in enumerate(grads):
            groups.setdefault((g.dtype, g.device), []).append(i)
        for idx in groups.values():
            flat = torch.cat([grads[i].detach().reshape(-1) for i in idx])
            dist.all_reduce(flat)
            flat /= n
            pos = 0
            for i in idx:
                k = grads[i].numel()
                out[i] = flat[pos:pos + k].view_as(grads[i])
                pos += k
        return out

    return _by_present(run)


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


def _mpi_reducer(comm: MPIComm) -> Reducer:
    def run(grads: List[Any]) -> List[Any]:
        import numpy as np
        from mpi4py import MPI

        kind = kind_of(grads[0])
        arrays = [_to_numpy(g, kind) for g in grads]
        out: List[Any] = [None] * len(grads)
        groups: dict = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.dtype.str, []).append(i)
        for idx in groups.values():
            flat = np.concatenate([arrays[i].reshape(-1) for i in idx])
            comm.comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
            flat /= comm.size
            pos = 0
            for i in idx:
                k = arrays[i].size
                out[i] = _from_numpy(flat[pos:pos + k], grads[i], kind)
                pos += k
        return out

    return _by_present(run)


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
        return _hvd_reducer(hvd)
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
