"""The OOM guard's pure parts and its protocol, with in-process thread "ranks" (no MPI needed)."""
from __future__ import annotations

import gc
import random
import weakref

import numpy as np
import pytest

import distmem.guard as guard
from distmem.comm import SingleComm
from distmem.errors import ConfigError, GatherTimeoutError
from distmem.guard.flags import WORD_BITS, Status, decode, encode
from distmem.guard.step import batch_len, shrink_micro_batch, slice_batch, split_sizes
from unit.guard.test_threads import mean_reducer, run_ranks

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------------- classifier

@pytest.mark.parametrize("exc", [
    MemoryError(),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 17592186044416 bytes. Error code 12 (Cannot allocate memory)"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes."),
])
def test_is_oom_recognises_allocator_failures(exc):
    assert guard.is_oom(exc)


@pytest.mark.parametrize("exc", [
    ValueError("out of memory"),            # not an allocator's exception type: not read
    KeyError("OOM when allocating"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
    ZeroDivisionError(),
    StopIteration(),
])
def test_is_oom_rejects_everything_else(exc):
    assert not guard.is_oom(exc)


def test_is_oom_follows_an_explicit_cause_only():
    try:
        try:
            raise MemoryError("inner")
        except MemoryError as inner:
            raise RuntimeError("wrapped by a library") from inner
    except RuntimeError as exc:
        assert guard.is_oom(exc)
    try:
        try:
            raise MemoryError("inner")
        except MemoryError:
            raise KeyError("a different bug while handling it")  # implicit context: not an OOM
    except KeyError as exc:
        assert not guard.is_oom(exc)


def test_describe_picks_the_allocator_line():
    exc = RuntimeError("Graph execution error:\n\nDetected at node x\n\nOOM when allocating tensor with shape[64,4096]")
    assert guard.describe(exc) == "RuntimeError: OOM when allocating tensor with shape[64,4096]"
    assert guard.describe(ValueError("")) == "ValueError"
    assert len(guard.describe(RuntimeError("x" * 1000))) < 260


# ----------------------------------------------------------------------------------- flags

@pytest.mark.parametrize("size", [1, 2, 4, WORD_BITS, WORD_BITS + 1, 200, 4096])
def test_flags_sum_is_an_exact_bitwise_or(size):
    rng = random.Random(size)
    statuses = [rng.choice(list(Status)) for _ in range(size)]
    total = np.zeros(len(encode(0, size, Status.OK)))
    for r, s in enumerate(statuses):
        total += np.asarray(encode(r, size, s))
    v = decode(total.tolist(), size)
    assert v.oom == [r for r, s in enumerate(statuses) if s == Status.OOM]
    assert v.error == [r for r, s in enumerate(statuses) if s == Status.ERROR]
    assert v.stop == [r for r, s in enumerate(statuses) if s == Status.STOP]
    assert v.ok == all(s == Status.OK for s in statuses)


def test_flag_vector_is_tiny():
    assert len(encode(0, 4, Status.OK)) == 3
    assert len(encode(0, 4096, Status.OK)) == 3 * 79


# ----------------------------------------------------------------------------------- batch helpers

def test_split_and_shrink():
    assert split_sizes(64, 16) == [16] * 4
    assert split_sizes(10, 4) == [4, 4, 2]
    assert split_sizes(3, 8) == [3]
    assert shrink_micro_batch(16, 1) == 8
    assert shrink_micro_batch(3, 1) == 1
    assert shrink_micro_batch(5, 4) == 4
    assert shrink_micro_batch(1, 1) is None
    assert shrink_micro_batch(12, 1, factor=4) == 3


def test_slice_batch_nested():
    b = ({"a": np.arange(10), "b": np.ones((10, 2))}, [np.arange(10)], None)
    s = slice_batch(b, 2, 5)
    assert s[0]["a"].tolist() == [2, 3, 4] and s[0]["b"].shape == (3, 2) and s[1][0].tolist() == [2, 3, 4]
    assert s[2] is None
    assert batch_len(b) == 10


# ----------------------------------------------------------------------------------- a model

D = 6


def make_data(seed: int, n: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D))
    y = x @ np.linspace(-1, 1, D) + 0.5
    return x, y


class Linear:
    """Least squares in NumPy: grads_of returns the mean-loss gradient of a micro-batch."""

    def __init__(self):
        self.w = np.zeros(D)
        self.calls = 0
        self.fault = None  # callable(call_index, micro_size) -> exception to raise, or None

    def grads_of(self, x, y):
        self.calls += 1
        if self.fault is not None:
            exc = self.fault(self.calls, len(x))
            if exc is not None:
                raise exc
        err = x @ self.w - y
        return [2 * x.T @ err / len(x)], float((err ** 2).mean())

    def apply(self, grads):
        self.w = self.w - 0.1 * grads[0]


def test_accumulated_gradient_equals_the_whole_batch_gradient():
    x, y = make_data(0, 48)
    m = Linear()
    m.w = np.arange(D, dtype=float)
    full = m.grads_of(x, y)[0][0]
    for micro in (48, 16, 10, 7, 1):
        got = {}
        s = guard.step(m.grads_of, apply=lambda g: got.setdefault("g", g[0]), micro_batch_size=micro,
                       global_batch_size=48, comm=SingleComm())
        s(x, y)
        np.testing.assert_allclose(got["g"], full, rtol=1e-12, atol=1e-12)


def test_single_rank_fallback_keeps_the_global_batch_and_the_result():
    x, y = make_data(1, 32 * 6)
    ref, hit = Linear(), Linear()
    hit.fault = lambda call, n: MemoryError("injected") if call == 6 else None  # step 1, second micro-batch
    s_ref = guard.step(ref.grads_of, apply=ref.apply, micro_batch_size=16, global_batch_size=32, comm=SingleComm())
    s_hit = guard.step(hit.grads_of, apply=hit.apply, micro_batch_size=16, global_batch_size=32, comm=SingleComm())
    for i in range(6):
        s_ref(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
        s_hit(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
    assert s_hit.micro_batch_size == 8 and s_hit.accumulation_steps == 4
    assert len(s_hit.fallbacks) == 1
    fb = s_hit.fallbacks[0]
    assert (fb.old_micro_batch, fb.new_micro_batch, fb.old_accumulation, fb.new_accumulation) == (16, 8, 2, 4)
    assert fb.ranks == [0] and "MemoryError: injected" in fb.errors[0] and fb.global_batch == 32
    assert fb.recovery_seconds is not None
    np.testing.assert_allclose(hit.w, ref.w, rtol=1e-10)


def test_the_floor_raises_with_the_numbers():
    x, y = make_data(2, 16)
    m = Linear()
    m.fault = lambda call, n: MemoryError(f"needs more than {n} samples allow") if n > 2 else MemoryError("still")
    s = guard.step(m.grads_of, apply=m.apply, micro_batch_size=16, min_micro_batch_size=2, comm=SingleComm())
    with pytest.raises(guard.BatchSizeFloorError) as info:
        s(x, y)
    msg = str(info.value)
    assert "micro-batch 2 is the floor" in msg and "min_micro_batch_size=2" in msg and "rank [0]" in msg
    assert [f.new_micro_batch for f in s.fallbacks] == [8, 4, 2]
    assert info.value.ranks == [0]


def test_a_non_oom_error_propagates_unchanged():
    x, y = make_data(3, 16)
    m = Linear()
    boom = ZeroDivisionError("a real bug")
    m.fault = lambda call, n: boom
    s = guard.step(m.grads_of, apply=m.apply, micro_batch_size=8, comm=SingleComm())
    with pytest.raises(ZeroDivisionError) as info:
        s(x, y)
    assert info.value is boom
    assert s.fallbacks == [] and s.micro_batch_size == 8


def test_the_dropped_attempt_releases_its_memory():
    x, y = make_data(4, 16)

    class Activation:  # stands in for a tensor the failing frame still references
        pass

    refs = []

    def grads_of(xb, yb):
        act = Activation()
        refs.append(weakref.ref(act))
        if len(refs) == 1:
            raise MemoryError("while holding an activation")
        return [np.zeros(D)], 0.0

    s = guard.step(grads_of, micro_batch_size=16, comm=SingleComm())
    s(x, y)
    gc.collect()
    assert refs[0]() is None, "the failed attempt's frame still holds its activations"


def test_config_errors_carry_values():
    with pytest.raises(ConfigError, match="multiple of the world size 4.*use 100 or 104"):
        guard.step(lambda: None, micro_batch_size=4, global_batch_size=102, comm=_FakeComm(4))
    with pytest.raises(ConfigError, match="min_micro_batch_size=8 is above micro_batch_size=4"):
        guard.step(lambda: None, micro_batch_size=4, min_micro_batch_size=8, comm=SingleComm())
    x, y = make_data(5, 20)
    m = Linear()
    s = guard.step(m.grads_of, micro_batch_size=4, global_batch_size=16, comm=SingleComm())
    with pytest.raises(ConfigError, match="got a batch of 20 samples .* 16 per rank"):
        s(x, y)


class _FakeComm(SingleComm):
    def __init__(self, size):
        self.size = size


# ----------------------------------------------------------------------------------- thread ranks

def _train(comm, steps=6, micro=16, local=32, fault=None, timeout=20.0, data_seed=10):
    m = Linear()
    m.fault = (lambda call, n: fault(comm.rank, call, n)) if fault else None
    s = guard.step(m.grads_of, apply=m.apply, micro_batch_size=micro, global_batch_size=local * comm.size,
                   comm=comm, timeout=timeout, reduce_gradients=mean_reducer(comm))
    x, y = make_data(data_seed + comm.rank, local * steps)
    for i in range(steps):
        s(x[i * local:(i + 1) * local], y[i * local:(i + 1) * local])
    return m.w, s


def test_one_rank_oom_every_rank_falls_back_together():
    # rank 2 runs out of memory in its 5th micro-batch call (step 2): everyone drops step 2 and halves
    out = run_ranks(4, lambda c: _train(c, fault=lambda r, call, n: MemoryError("rank 2 OOM")
                                         if (r, call) == (2, 5) else None))
    ref = run_ranks(4, lambda c: _train(c))
    for r in range(4):
        assert not isinstance(out[r], BaseException), out[r]
    micro = {s.micro_batch_size for _, s in out}
    assert micro == {8}
    assert [[(f.step, f.ranks, f.old_micro_batch, f.new_micro_batch) for f in s.fallbacks] for _, s in out] == \
        [[(2, [2], 16, 8)]] * 4
    weights = [w for w, _ in out]
    assert all(np.array_equal(w, weights[0]) for w in weights), "ranks ended with different weights"
    np.testing.assert_allclose(weights[0], ref[0][0], rtol=1e-10)  # same training as without the fault


def test_oom_on_several_ranks_at_once_and_again_later():
    faults = {(1, 3), (3, 3), (0, 9)}
    out = run_ranks(4, lambda c: _train(c, steps=5, fault=lambda r, call, n: MemoryError("x")
                                         if (r, call) in faults else None))
    for r in range(4):
        assert not isinstance(out[r], BaseException), out[r]
    hist = [[(f.ranks, f.new_micro_batch) for f in s.fallbacks] for _, s in out]
    assert hist[0] == [([1, 3], 8), ([0], 4)] and all(h == hist[0] for h in hist)


def test_non_oom_error_on_one_rank_stops_every_rank():
    boom = ValueError("bad label 7")
    out = run_ranks(4, lambda c: _train(c, fault=lambda r, call, n: boom if (r, call) == (1, 3) else None))
    assert out[1] is boom
    for r in (0, 2, 3):
        assert isinstance(out[r], guard.PeerError), out[r]
        assert out[r].ranks == [1] and "ValueError: bad label 7" in str(out[r]) and "rank 1" in str(out[r])


def test_data_running_out_on_one_rank_stops_every_rank_at_the_same_step():
    def body(c):
        m = Linear()
        s = guard.step(m.grads_of, apply=m.apply, micro_batch_size=8, comm=c, timeout=20,
                       reduce_gradients=mean_reducer(c))
        x, y = make_data(c.rank, 16 * 5)
        n = 3 if c.rank == 2 else 5  # rank 2 has fewer batches
        it = iter([(x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]) for i in range(n)])
        done = 0
        while True:
            try:
                s.next(it)
            except StopIteration:
                return done
            done += 1

    assert run_ranks(4, body) == [3, 3, 3, 3]


def test_a_missing_rank_is_a_timeout_not_a_hang():
    def body(c):
        if c.rank == 3:
            return "left"  # never calls the step
        return _train(c, steps=1, timeout=1.0)

    out = run_ranks(4, body)
    assert out[3] == "left"
    for r in range(3):
        assert isinstance(out[r], GatherTimeoutError), out[r]
        assert "guarded step 0" in str(out[r]) and "never" in str(out[r])


def test_floor_is_reached_on_every_rank_together():
    out = run_ranks(4, lambda c: _train(c, micro=4, fault=lambda r, call, n: MemoryError("always") if r == 0 else None))
    for r in range(4):
        assert isinstance(out[r], guard.BatchSizeFloorError), out[r]
        assert out[r].ranks == [0]


def test_random_injections_never_hang_and_always_agree():
    rng = random.Random(1234)  # the same schedule on every rank, as in the multi-rank test
    for trial in range(25):
        faults = {(rng.randrange(4), rng.randrange(1, 12)) for _ in range(rng.randrange(1, 3))}
        out = run_ranks(4, lambda c: _train(c, steps=3, micro=8, local=16, fault=lambda r, call, n:
                                            MemoryError("inj") if (r, call) in faults else None))
        kinds = {type(o).__name__ for o in out}
        assert len(kinds) == 1, (trial, faults, out)
        if not isinstance(out[0], BaseException):
            assert len({s.micro_batch_size for _, s in out}) == 1
            assert all(np.array_equal(w, out[0][0]) for w, _ in out)


# ----------------------------------------------------------------------------------- find_batch_size

def _finder(capacity, **kw):
    def body(c):
        seen = []

        def trial(b):
            seen.append(b)
            if b > capacity[c.rank]:
                raise MemoryError(f"{b} > {capacity[c.rank]}")

        return guard.find_batch_size(trial, comm=c, timeout=20, verbose=False, **kw), seen

    return run_ranks(len(capacity), body)


def test_find_batch_size_bisects_to_the_smallest_capacity_on_every_rank():
    out = _finder([300, 1000, 170, 900], start=512)
    assert [b for b, _ in out] == [170] * 4
    seqs = [s for _, s in out]
    assert all(s == seqs[0] for s in seqs)
    assert seqs[0][:3] == [512, 256, 128]


def test_find_batch_size_halving_stops_at_the_first_fit():
    out = _finder([100, 1000], start=512, search="halve")
    assert [b for b, _ in out] == [64, 64]


def test_find_batch_size_grows_to_upper_and_respects_granularity():
    out = _finder([700, 650], start=64, upper=2048, granularity=8)
    assert [b for b, _ in out] == [648, 648]
    out = _finder([5000, 5000], start=64, upper=1024)
    assert [b for b, _ in out] == [1024, 1024]


def test_find_batch_size_lower_bound_error():
    out = _finder([3, 100], start=64, lower=4)
    for r in range(2):
        assert isinstance(out[r], guard.BatchSizeFloorError), out[r]
        assert "lower bound, batch 4" in str(out[r]) and "rank [0]" in str(out[r]) and "64, 32, 16, 8, 4" in str(out[r])


def test_find_batch_size_rejects_different_arguments_per_rank():
    def body(c):
        return guard.find_batch_size(lambda b: None, start=64 if c.rank else 32, comm=c, timeout=10, verbose=False)

    out = run_ranks(2, body)
    for o in out:
        assert isinstance(o, ConfigError) and "rank 0: (32" in str(o) and "rank 1: (64" in str(o)


def test_find_batch_size_non_oom_error_propagates():
    def body(c):
        def trial(b):
            if c.rank == 1:
                raise TypeError("wrong input")

        return guard.find_batch_size(trial, start=8, comm=c, timeout=10, verbose=False)

    out = run_ranks(2, body)
    assert isinstance(out[1], TypeError) and isinstance(out[0], guard.PeerError)
