"""The OOM guard with horovod.tensorflow, 4 ranks under horovodrun (--gloo: Horovod flag all-reduce
on the guard's helper thread; --mpi: mpi4py flag all-reduce). Gradients: hvd.grouped_allreduce, or the
Horovod DistributedOptimizer's own all-reduce under Keras fit."""
import os

import numpy as np
import pytest
import tensorflow as tf

import horovod.tensorflow.keras as hvd_keras
import horovod.tensorflow as hvd

import distmem.guard as guard
from distmem import comm as dcomm
from guardlib import (TFRig, checksum, fallback_view, keras_fit, leave_and_time_out, random_injections,
                      same_everywhere, tf_oom, tf_train)

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
FAIL_RANK = SIZE - 1
MODE = os.environ.get("DISTMEM_HVD_MODE", "gloo")


def test_transport():
    c = dcomm.get_comm()
    expect = {"gloo": "horovod.tensorflow", "mpi": "mpi"}[MODE] if SIZE > 1 else "single"
    assert guard.flag_reducer(c).name == expect


def test_hand_written_loop_one_rank_oom():
    c = dcomm.get_comm()
    fault = (lambda call, n: tf_oom() if (RANK, call) == (FAIL_RANK, 3) else None)  # step 1, first micro-batch
    weights, step = tf_train(c, steps=4, micro=8, local=16, fault=fault)
    assert fallback_view(step) == [(1, (FAIL_RANK,), 8, 4, 4, 16 * SIZE)]
    assert "ResourceExhaustedError: OOM when allocating" in step.fallbacks[0].errors[FAIL_RANK]
    same_everywhere(c, (step.micro_batch_size, tuple(fallback_view(step))), "micro-batch and fallbacks")
    same_everywhere(c, checksum(weights), "final weights checksum")
    ref, _ = tf_train(c, steps=4, micro=8, local=16)
    for a, b in zip(weights, ref):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("optimizer", ["horovod", "plain"])
def test_keras_fit_one_rank_oom(optimizer):
    c = dcomm.get_comm()
    opt = tf.keras.optimizers.SGD(0.05)
    if optimizer == "horovod":
        opt = hvd_keras.DistributedOptimizer(opt)  # the guard calls its all-reduce after the verdict
    weights, cb, hist = keras_fit(c, fail_rank=FAIL_RANK, fail_call=5, epochs=2, steps=4, optimizer=opt)
    assert cb.guard.micro_batch_size == 4
    assert fallback_view(cb.guard) == [(2, (FAIL_RANK,), 8, 4, 4, 16 * SIZE)]
    assert cb.guard._reduce_spec == (None if optimizer == "horovod" else "auto")
    same_everywhere(c, checksum(weights), "final Keras weights checksum")


def test_non_oom_error_everywhere():
    c = dcomm.get_comm()
    boom = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [8,4] vs. [8,5]")
    fault = (lambda call, n: boom if (RANK, call) == (FAIL_RANK, 2) else None)
    with pytest.raises(tf.errors.InvalidArgumentError if RANK == FAIL_RANK else guard.PeerError) as info:
        tf_train(c, fault=fault)
    if RANK == FAIL_RANK:
        assert info.value is boom
    else:
        assert info.value.ranks == [FAIL_RANK] and "Incompatible shapes" in str(info.value)


def test_find_batch_size_agrees():
    c = dcomm.get_comm()
    capacity = 64 + 16 * ((RANK + 1) % SIZE)

    def trial(b):
        if b > capacity:
            raise tf_oom()

    got = guard.find_batch_size(trial, start=256, comm=c, timeout=60)
    assert got == 64
    same_everywhere(c, got, "agreed batch size")


def test_100_random_injections_never_hang():
    rig = TFRig()
    counts = random_injections(dcomm.get_comm(), n=100, seed=5, make_oom=tf_oom, train=rig.train)
    assert sum(counts.values()) == 100


def test_zz_a_rank_that_leaves_makes_the_others_time_out_not_hang():
    if SIZE == 1:
        pytest.skip("needs 2+ ranks")
    c = dcomm.get_comm()
    rig = TFRig()
    leave_and_time_out(c, FAIL_RANK, lambda flags: guard.step(rig.grads_of, apply=lambda g: rig.apply(list(g)),
                                                               micro_batch_size=2, comm=c, timeout=1.0, flags=flags),
                       [np.zeros((4, 10), "float32"), np.zeros(4, "int64")])
