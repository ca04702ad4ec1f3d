"""The OOM guard under mpirun (mpi4py transport: MPI flag all-reduce, MPI gradient all-reduce).
Run by tests/mpi/test_guard_launch.py (DISTMEM_GUARD_RANKED=1) at 1, 2 and 4 ranks; skipped when the
generic ranked suite runs the folder, so these TensorFlow-heavy bodies run once per size."""
import os
import sys

import pytest

if os.environ.get("DISTMEM_GUARD_RANKED") != "1":  # before the heavy imports: the generic ranked suite stays fast
    pytest.skip("run by tests/mpi/test_guard_launch.py", allow_module_level=True)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "horovod_guard"))

import gc  # noqa: E402

import tensorflow  # noqa: E402,F401 - imported before gc.freeze() below
import torch  # noqa: E402,F401

import distmem.guard as guard  # noqa: E402
from distmem import comm as dcomm  # noqa: E402
from guardlib import (checksum, fallback_view, keras_fit, leave_and_time_out, random_injections,  # noqa: E402
                      same_everywhere, tf_oom, tf_train, torch_oom, torch_train)

gc.freeze()  # start-up objects out of the collector's way: each fallback's full collection stays cheap
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
FAIL_RANK = SIZE - 1  # the highest rank: never the one that logs


def test_transport_is_mpi():
    c = dcomm.get_comm()  # mpi4py whenever mpirun started the job, at any size
    assert (c.name, c.size) == ("mpi", SIZE)
    assert guard.flag_reducer(c).name == "mpi"


def test_torch_one_rank_oom_everyone_falls_back_and_ends_identical():
    c = dcomm.get_comm()
    seen = []
    fault = (lambda call, n: torch_oom() if (RANK, call) == (FAIL_RANK, 5) else None)  # step 2, first micro-batch
    weights, step = torch_train(c, steps=5, micro=8, local=16, fault=fault, samples=seen)
    ref, _ = torch_train(c, steps=5, micro=8, local=16)
    assert step.micro_batch_size == 4 and step.accumulation_steps == 4
    assert fallback_view(step) == [(2, (FAIL_RANK,), 8, 4, 4, 16 * SIZE)]
    assert "OutOfMemoryError: CUDA out of memory" in step.fallbacks[0].errors[FAIL_RANK]
    same_everywhere(c, (step.micro_batch_size, tuple(fallback_view(step))), "micro-batch and fallbacks")
    same_everywhere(c, checksum(weights), "final weights checksum")
    # the global batch is unchanged: each step's successful attempt consumed all 16 samples of every rank
    dropped = [8] if RANK == FAIL_RANK else [8, 8]  # the failing rank stopped at its OOM, the others finished
    assert seen == [8, 8] * 2 + dropped + [4, 4, 4, 4] * 3
    for a, b in zip(weights, ref):  # and training is the one without a fault, up to summation order
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_tf_one_rank_oom_everyone_falls_back_and_ends_identical():
    c = dcomm.get_comm()
    fault = (lambda call, n: tf_oom() if (RANK, call) == (FAIL_RANK, 4) else None)  # step 1, second micro-batch
    weights, step = tf_train(c, steps=4, micro=8, local=16, fault=fault)
    ref, _ = tf_train(c, steps=4, micro=8, local=16)
    assert fallback_view(step) == [(1, (FAIL_RANK,), 8, 4, 4, 16 * SIZE)]
    assert "ResourceExhaustedError: OOM when allocating" in step.fallbacks[0].errors[FAIL_RANK]
    same_everywhere(c, checksum(weights), "final weights checksum")
    for a, b in zip(weights, ref):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_keras_fit_one_rank_oom():
    c = dcomm.get_comm()
    weights, cb, hist = keras_fit(c, fail_rank=FAIL_RANK, fail_call=6, epochs=2, steps=4)  # epoch 0, step 2
    assert cb.guard.micro_batch_size == 4
    assert fallback_view(cb.guard) == [(2, (FAIL_RANK,), 8, 4, 4, 16 * SIZE)]
    assert "ResourceExhaustedError" in cb.guard.fallbacks[0].errors[FAIL_RANK]
    assert cb.guard.steps == 8 and len(hist.history["loss"]) == 2
    same_everywhere(c, checksum(weights), "final Keras weights checksum")


def test_non_oom_error_on_one_rank_raises_everywhere_and_leaves_the_comm_usable():
    c = dcomm.get_comm()
    boom = KeyError("label 'cat' missing")
    fault = (lambda call, n: boom if (RANK, call) == (FAIL_RANK, 3) else None)
    if RANK == FAIL_RANK:
        with pytest.raises(KeyError) as info:
            torch_train(c, fault=fault)
        assert info.value is boom  # unchanged
    else:
        with pytest.raises(guard.PeerError) as info:
            torch_train(c, fault=fault)
        assert info.value.ranks == [FAIL_RANK] and "KeyError" in str(info.value)
    assert c.allreduce([1], "sum", timeout=30) == [SIZE]  # every rank left the step at the same point


def test_find_batch_size_agrees_on_the_smallest_rank():

    c = dcomm.get_comm()
    capacity = 96 + 40 * ((RANK + 1) % SIZE)  # the last rank fits least
    model = torch.nn.Linear(10, 4)

    def trial(b):
        model(torch.randn(b, 10)).sum().backward()
        if b > capacity:
            raise torch_oom(f"CUDA out of memory. Tried to allocate {b} samples' activations")

    got = guard.find_batch_size(trial, start=512, comm=c, timeout=60, verbose=RANK == 0)
    assert got == 96
    same_everywhere(c, got, "agreed batch size")
    with pytest.raises(guard.BatchSizeFloorError, match=r"lower bound, batch 100"):
        guard.find_batch_size(trial, start=400, lower=100, comm=c, timeout=60, verbose=False)


def test_100_random_injections_never_hang():
    c = dcomm.get_comm()
    counts = random_injections(c, n=100, seed=2024)
    assert sum(counts.values()) == 100 and counts.get("oom", 0) > 30


def test_zz_a_rank_that_leaves_makes_the_others_time_out_not_hang():
    if SIZE == 1:
        pytest.skip("needs 2+ ranks")
    c = dcomm.get_comm()
    p = torch.nn.Parameter(torch.zeros(3))
    leave_and_time_out(c, FAIL_RANK, lambda flags: guard.step(lambda x: (p * x).sum(), params=[p], micro_batch_size=2,
                                                               comm=c, timeout=1.0, flags=flags), [torch.ones(4, 3)])
