"""The OOM guard with horovod.torch, 4 ranks under horovodrun (--gloo: Horovod flag all-reduce,
allreduce_async_ + poll; --mpi: mpi4py flag all-reduce). Gradients: hvd.grouped_allreduce."""
import os

import pytest
import torch

import horovod.torch as hvd

import distmem.guard as guard
from distmem import comm as dcomm
from guardlib import (checksum, fallback_view, leave_and_time_out, random_injections, same_everywhere, torch_oom,
                      torch_train)

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
FAIL_RANK = SIZE - 1
MODE = os.environ.get("DISTMEM_HVD_MODE", "gloo")


def test_transport():
    c = dcomm.get_comm()
    assert (c.rank, c.size) == (RANK, SIZE)
    expect = {"gloo": "horovod.torch", "mpi": "mpi"}[MODE] if SIZE > 1 else "single"
    assert guard.flag_reducer(c).name == expect


def test_one_rank_oom_everyone_falls_back_and_ends_identical():
    c = dcomm.get_comm()
    fault = (lambda call, n: torch_oom() if (RANK, call) == (FAIL_RANK, 6) else None)  # step 2, second micro
    weights, step = torch_train(c, steps=5, micro=8, local=16, fault=fault)
    assert fallback_view(step) == [(2, (FAIL_RANK,), 8, 4, 4, 16 * SIZE)]
    assert step.fallbacks[0].errors[FAIL_RANK].startswith("OutOfMemoryError: CUDA out of memory")
    same_everywhere(c, (step.micro_batch_size, tuple(fallback_view(step))), "micro-batch and fallbacks")
    same_everywhere(c, checksum(weights), "final weights checksum")
    ref, _ = torch_train(c, steps=5, micro=8, local=16)
    for a, b in zip(weights, ref):
        assert torch.allclose(torch.from_numpy(a), torch.from_numpy(b), rtol=2e-5, atol=2e-6)


def test_non_oom_error_everywhere():
    c = dcomm.get_comm()
    boom = IndexError("index 17 is out of bounds")
    fault = (lambda call, n: boom if (RANK, call) == (FAIL_RANK, 2) else None)
    with pytest.raises(IndexError if RANK == FAIL_RANK else guard.PeerError) as info:
        torch_train(c, fault=fault)
    if RANK == FAIL_RANK:
        assert info.value is boom
    else:
        assert info.value.ranks == [FAIL_RANK] and "IndexError" in str(info.value)


def test_find_batch_size_agrees():
    c = dcomm.get_comm()
    capacity = 200 - 30 * RANK

    def trial(b):
        if b > capacity:
            raise torch_oom(f"CUDA out of memory. Tried to allocate {b} samples")

    got = guard.find_batch_size(trial, start=256, comm=c, timeout=60)
    assert got == 200 - 30 * (SIZE - 1)
    same_everywhere(c, got, "agreed batch size")


def test_100_random_injections_never_hang():
    counts = random_injections(dcomm.get_comm(), n=100, seed=99)
    assert sum(counts.values()) == 100


def test_zz_a_rank_that_leaves_makes_the_others_time_out_not_hang():
    if SIZE == 1:
        pytest.skip("needs 2+ ranks")
    c = dcomm.get_comm()
    p = torch.nn.Parameter(torch.zeros(3))
    leave_and_time_out(c, FAIL_RANK, lambda flags: guard.step(lambda x: (p * x).sum(), params=[p], micro_batch_size=2,
                                                               comm=c, timeout=1.0, flags=flags), [torch.ones(4, 3)])
