"""Training bodies for the multi-rank guard tests, shared by tests/mpi/ranked/test_ranked_guard*.py
(mpirun) and tests/horovod_guard/ranked/ (horovodrun --gloo / --mpi).

Every body runs on every rank with the same arguments. The only injected part is the fault: one
chosen rank raises its framework's real out-of-memory exception (``torch.cuda.OutOfMemoryError``,
``tf.errors.ResourceExhaustedError``; in Keras a ``MemoryError`` inside ``tf.py_function`` that TF's
runtime turns into ``ResourceExhaustedError``) at a chosen micro-batch call, because a real OOM
cannot be produced on a CPU on demand. Everything after the raise is the real protocol.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import distmem.guard as guard
from distmem.comm import Comm

Fault = Optional[Callable[[int, int], Optional[BaseException]]]  # (call index from 1, micro size) -> exception


def checksum(arrays: Sequence[Any]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a, dtype=np.float64)).tobytes())
    return h.hexdigest()[:16]


def same_everywhere(comm: Comm, value: Any, what: str) -> List[Any]:
    """All-gather ``value``; assert every rank holds the same one (message lists each rank's)."""
    rows = comm.allgather(value, 60.0)
    assert all(r == rows[0] for r in rows), f"{what} differs between ranks: " + \
        ", ".join(f"rank {i}: {r}" for i, r in enumerate(rows))
    return rows


def fallback_view(step: guard.StepGuard) -> List[Tuple]:
    """The part of each fallback that must be identical on every rank."""
    return [(f.step, tuple(f.ranks), f.old_micro_batch, f.new_micro_batch, f.new_accumulation, f.global_batch)
            for f in step.fallbacks]


# ------------------------------------------------------------------------------------------ torch

def torch_train(comm: Comm, *, steps: int = 5, micro: int = 8, local: int = 16, fault: Fault = None,
                seed: int = 0, timeout: float = 60.0, samples: Optional[List[int]] = None) -> Tuple[List[Any], guard.StepGuard]:
    """A small MLP, params mode (guard runs backward), gradients averaged by the job's transport."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + comm.rank)  # each rank its own data
    x, y = torch.randn(steps * local, 10, generator=g), torch.randint(0, 4, (steps * local,), generator=g)
    calls = {"n": 0}

    def loss_of(xb, yb):
        calls["n"] += 1
        if samples is not None:
            samples.append(len(xb))
        out = model(xb)
        if fault is not None:
            exc = fault(calls["n"], len(xb))
            if exc is not None:
                raise exc
        return F.cross_entropy(out, yb)

    step = guard.step(loss_of, params=list(model.parameters()), apply=lambda _: opt.step(), micro_batch_size=micro,
                      global_batch_size=local * comm.size, comm=comm, timeout=timeout)
    for i in range(steps):
        step(x[i * local:(i + 1) * local], y[i * local:(i + 1) * local])
    return [p.detach().numpy().copy() for p in model.parameters()], step


def torch_oom(msg: str = "CUDA out of memory. Tried to allocate 512.00 MiB (injected)") -> BaseException:
    import torch

    return torch.cuda.OutOfMemoryError(msg)


# ------------------------------------------------------------------------------------------ tensorflow

def tf_train(comm: Comm, *, steps: int = 5, micro: int = 8, local: int = 16, fault: Fault = None, seed: int = 0,
             timeout: float = 60.0, reduce_gradients: Any = "auto") -> Tuple[List[Any], guard.StepGuard]:
    """A small Keras model trained by a hand-written loop (gradients mode)."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.layers.Input((10,)), tf.keras.layers.Dense(32, activation="relu"),
                                 tf.keras.layers.Dense(4)])
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    rng = np.random.default_rng(1000 + comm.rank)
    x = rng.normal(size=(steps * local, 10)).astype("float32")
    y = rng.integers(0, 4, size=(steps * local,))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(reduce_retracing=True)
    def grads_of(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return tape.gradient(loss, model.trainable_variables), loss

    calls = {"n": 0}

    def fn(xb, yb):
        calls["n"] += 1
        if fault is not None:
            exc = fault(calls["n"], len(xb))
            if exc is not None:
                raise exc
        return grads_of(xb, yb)

    apply = tf.function(lambda grads: opt.apply_gradients(zip(grads, model.trainable_variables)))
    step = guard.step(fn, apply=lambda g: apply(list(g)), micro_batch_size=micro, global_batch_size=local * comm.size,
                      comm=comm, timeout=timeout, reduce_gradients=reduce_gradients)
    for i in range(steps):
        step(x[i * local:(i + 1) * local], y[i * local:(i + 1) * local])
    return [w for w in model.get_weights()], step


class TFRig:
    """One Keras model and its compiled gradient function, reset to the same weights for every trial:
    the 100-trial loop then traces once per micro-batch size instead of once per trial."""

    def __init__(self, seed: int = 0):
        import tensorflow as tf

        tf.keras.utils.set_random_seed(seed)
        self.model = tf.keras.Sequential([tf.keras.layers.Input((10,)), tf.keras.layers.Dense(16, activation="relu"),
                                          tf.keras.layers.Dense(4)])
        self.initial = self.model.get_weights()
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model = self.model

        @tf.function(reduce_retracing=True)
        def grads_of(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            return tape.gradient(loss, model.trainable_variables), loss

        @tf.function
        def apply(grads):
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(0.05 * g)

        self.grads_of, self.apply = grads_of, apply

    def train(self, comm: Comm, *, steps: int, micro: int, local: int, fault: Fault = None, seed: int = 0,
              timeout: float = 60.0) -> Tuple[List[Any], guard.StepGuard]:
        self.model.set_weights(self.initial)
        rng = np.random.default_rng(seed * 100 + comm.rank)
        x = rng.normal(size=(steps * local, 10)).astype("float32")
        y = rng.integers(0, 4, size=(steps * local,))
        calls = {"n": 0}

        def fn(xb, yb):
            calls["n"] += 1
            if fault is not None:
                exc = fault(calls["n"], len(xb))
                if exc is not None:
                    raise exc
            return self.grads_of(xb, yb)

        step = guard.step(fn, apply=lambda g: self.apply(list(g)), micro_batch_size=micro,
                          global_batch_size=local * comm.size, comm=comm, timeout=timeout)
        for i in range(steps):
            step(x[i * local:(i + 1) * local], y[i * local:(i + 1) * local])
        return self.model.get_weights(), step


def tf_oom() -> BaseException:
    import tensorflow as tf

    return tf.errors.ResourceExhaustedError(
        None, None, "OOM when allocating tensor with shape[8,4096,4096] and type float on /job:localhost/"
                    "replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc (injected)")


def keras_fit(comm: Comm, *, fail_rank: Optional[int], fail_call: int, epochs: int = 2, steps: int = 4,
              micro: int = 8, local: int = 16, optimizer: Any = None, seed: int = 0) -> Tuple[List[Any], Any, Any]:
    """model.fit with KerasGuard; the chosen rank's model raises MemoryError inside TF (-> ResourceExhaustedError)."""
    import tensorflow as tf

    from distmem.guard.keras import KerasGuard

    state = {"calls": 0}

    def maybe_fail(t):
        state["calls"] += 1
        if comm.rank == fail_rank and state["calls"] == fail_call:
            raise MemoryError("injected host allocation failure")
        return t

    class Fault(tf.keras.layers.Layer):
        def call(self, t):
            out = tf.py_function(maybe_fail, [t], t.dtype)
            out.set_shape(t.shape)
            return out

    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.layers.Input((10,)), tf.keras.layers.Dense(32, activation="relu"), Fault(),
                                 tf.keras.layers.Dense(4)])
    model.compile(optimizer=optimizer or tf.keras.optimizers.SGD(0.05),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    rng = np.random.default_rng(2000 + comm.rank)
    x = rng.normal(size=(steps * local, 10)).astype("float32")
    y = rng.integers(0, 4, size=(steps * local,))
    cb = KerasGuard(micro_batch_size=micro, global_batch_size=local * comm.size, comm=comm, timeout=60)
    hist = model.fit(x, y, batch_size=local, epochs=epochs, shuffle=False, verbose=0, callbacks=[cb])
    return model.get_weights(), cb, hist


# ------------------------------------------------------------------------------------------ random faults

def random_injections(comm: Comm, n: int = 100, seed: int = 7, make_oom: Callable[[], BaseException] = None,
                      train: Callable[..., Tuple[List[Any], guard.StepGuard]] = None, steps: int = 2, micro: int = 4,
                      local: int = 8) -> Dict[str, int]:
    """``n`` trials, each a fresh guard and one injected step whose rank(s), micro-batch call and kind
    come from a seeded RNG (the same on every rank). Kinds: OOM on 1 or 2 ranks (fallback), OOM at the
    floor (BatchSizeFloorError everywhere), a non-OOM error (own exception there, PeerError elsewhere).
    After each trial all ranks compare outcome, micro-batch, fallbacks and weight checksums."""
    rng = random.Random(seed)
    make_oom = make_oom or torch_oom
    train = train or torch_train
    counts: Dict[str, int] = {}
    calls_per_step = local // micro
    for trial in range(n):
        kind = rng.choices(["oom", "oom2", "floor", "error"], weights=[60, 20, 10, 10])[0]
        ranks = set(rng.sample(range(comm.size), min(comm.size, 2 if kind == "oom2" else 1)))
        call = rng.randrange(1, steps * calls_per_step + 1)
        boom = ValueError(f"trial {trial}: a real bug")

        def fault(c: int, size: int, ranks=ranks, call=call, kind=kind, boom=boom) -> Optional[BaseException]:
            if comm.rank not in ranks:
                return None
            if kind == "floor" and c >= call:
                return make_oom()            # keeps failing at every size: the floor is reached
            if c == call:
                return boom if kind == "error" else make_oom()
            return None

        try:
            weights, step = train(comm, steps=steps, micro=micro, local=local, fault=fault, seed=trial)
            outcome = ("ok", step.micro_batch_size, tuple(fallback_view(step)), checksum(weights))
        except guard.BatchSizeFloorError as exc:
            outcome = ("floor", tuple(exc.ranks))
        except guard.PeerError as exc:
            outcome = ("error", tuple(exc.ranks))
        except ValueError as exc:
            assert exc is boom, exc
            outcome = ("error", (comm.rank,))
        expected = {"oom": "ok", "oom2": "ok", "floor": "floor", "error": "error"}[kind]
        assert outcome[0] == expected, (trial, kind, ranks, call, outcome)
        same_everywhere(comm, outcome, f"trial {trial} ({kind} on ranks {sorted(ranks)} at call {call}) outcome")
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# ------------------------------------------------------------------------------------------ timeouts

_GAVE_UP_TAG = 7999


def leave_and_time_out(comm: Comm, late: int, make_step: Callable[[Any], guard.StepGuard], batch: Sequence[Any]) -> None:
    """Rank ``late`` skips the step; every other rank must raise GatherTimeoutError instead of hanging.
    Afterwards the late rank enters the abandoned flag all-reduce so the transport is clean again:
    over MPI, where collectives match by order, the others tell it by point-to-point messages that
    they gave up; Horovod matches by name, so a barrier does."""
    import pytest

    from distmem.comm import MPIComm
    from distmem.errors import GatherTimeoutError

    flags = guard.flag_reducer(comm)
    mpi = isinstance(comm, MPIComm)
    if comm.rank == late:
        if mpi:
            for r in range(comm.size):
                if r != late:
                    comm.comm.recv(source=r, tag=_GAVE_UP_TAG)
        else:
            comm.barrier(timeout=120)
        flags.reduce([0.0] * 3, timeout=60)
    else:
        step = make_step(flags)
        with pytest.raises(GatherTimeoutError, match="never reached the guard's flag all-reduce"):
            step(*batch)
        if mpi:
            comm.comm.send("gave up", dest=late, tag=_GAVE_UP_TAG)
        else:
            comm.barrier(timeout=120)
    comm.barrier(timeout=120)
