"""The overlapped guard step on thread ranks: from the step after the first clean one the verdict
rides in the gradient all-reduce (a reducer that carries it: one element more, the failing ranks
gathered only when it is not 0), or, with a reducer of the user's, the flag all-reduce is posted
before the gradient all-reduce and waited after it; every rank enters the
gradient all-reduce on every step (a rank whose step failed with zeros of the last clean step's
shapes), and the step's own verdict decides whether the reduced gradients are applied. Same
fallbacks and bit-identical weights as the blocking protocol, with and without faults."""
from __future__ import annotations

from typing import Any, List

import numpy as np
import pytest

import distmem.guard as guard
from distmem.comm import FlagReducer, PostedFlags
from distmem.guard.grads import CarryingReducer
from unit.guard.test_guard import Linear, make_data
from unit.guard.test_threads import mean_reducer, run_ranks


class EventFlags(FlagReducer):
    """Flags over the thread transport that record when they are posted and waited."""

    name = "threads"
    overlaps = True

    def __init__(self, comm, events: List[str]):
        self.comm, self.events = comm, events
        super().__init__(comm.rank, comm.size)

    def reduce(self, vec, timeout):
        self.events.append("flags")
        return self.comm.allreduce(vec, "sum", timeout)

    def post(self, vec):
        self.events.append("post")
        me = self

        class Posted(PostedFlags):
            def wait(self, timeout):
                me.events.append("wait")
                return me.comm.allreduce(vec, "sum", timeout)

        return Posted(self, vec)


def _train(comm, overlap, fault=None, steps=6, local=32, micro=16, carry=False):
    """``steps`` guarded steps on the thread ranks; the gradients reduced by a reducer of the user's
    (the flags posted beside it) or, ``carry``, by one carrying the verdict. Returns (weights, the
    guard, the events, what the step raised or None)."""
    events: List[str] = []
    m = Linear()
    m.fault = (lambda call, n: fault(comm.rank, call, n)) if fault else None
    if carry:
        reduce: Any = _carrying(comm, events)
    else:
        grads_reduce = mean_reducer(comm)

        def reduce(grads: List[Any]) -> List[Any]:
            events.append("grads" if grads[0] is not None and np.any(grads[0]) else "grads(zeros)")
            return grads_reduce(grads)

    s = guard.step(m.grads_of, apply=m.apply, micro_batch_size=micro, global_batch_size=local * comm.size,
                   comm=comm, timeout=20.0, reduce_gradients=reduce, flags=EventFlags(comm, events),
                   overlap=overlap)
    x, y = make_data(10 + comm.rank, local * steps)
    for i in range(steps):
        try:
            s(x[i * local:(i + 1) * local], y[i * local:(i + 1) * local])
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the test's subject
            return m.w, s, events, exc
        events.append("|")
    return m.w, s, events, None


def _steps(events: List[str]) -> List[List[str]]:
    """The events of each step (a step ends at ``|``)."""
    return [st.split() for st in "".join(e if e == "|" else e + " " for e in events).split("|")]


def _carrying(comm, events: List[str]) -> CarryingReducer:
    """The thread ranks' mean, carrying the verdict as the built-in reducers do (one more element)."""
    def flat(grads, flag):
        events.append("grads" if flag is None else
                      ("grads+flag" if flag == 0.0 else "grads(zeros)+flag"))
        rows = comm.allgather([[g.copy() for g in grads], flag], 30.0)
        out = [sum(r[0][i] for r in rows) / len(rows) for i in range(len(grads))]
        return out, (sum(r[1] for r in rows) if flag is not None else 0.0)

    return CarryingReducer(flat)


def rank2_oom_at_call7(r, call, n):
    """Rank 2 runs out of memory in its 7th micro-batch (step 3's first: micro-batch 16, 2 per step)."""
    return MemoryError("rank 2 OOM") if (r, call) == (2, 7) else None


def test_from_the_second_step_the_flags_ride_beside_the_gradient_all_reduce():
    out = run_ranks(4, lambda c: _train(c, True))
    for r in range(4):
        assert not isinstance(out[r], BaseException), out[r]
        w, s, events, exc = out[r]
        assert exc is None
        steps = _steps(events)
        assert steps[0] == ["flags", "grads"]  # the first step: blocking (no shapes known yet)
        assert all(st == ["post", "grads", "wait"] for st in steps[1:6]), steps
        assert s.overlapped
    ref = run_ranks(4, lambda c: _train(c, False))
    assert not ref[0][1].overlapped and ref[0][2].count("post") == 0
    for r in range(4):
        assert ref[r][3] is None
        assert np.array_equal(out[r][0], ref[r][0]), "the overlapped protocol trains differently"


def test_an_oom_in_an_overlapped_step_is_decided_on_that_step_by_every_rank():
    out = run_ranks(4, lambda c: _train(c, True, rank2_oom_at_call7))
    ref = run_ranks(4, lambda c: _train(c, False, rank2_oom_at_call7))
    for r in range(4):
        assert not isinstance(out[r], BaseException), out[r]
        w, s, events, exc = out[r]
        assert exc is None
        assert [(f.step, f.ranks, f.new_micro_batch) for f in s.fallbacks] == [(3, [2], 8)]
        assert [(f.step, f.ranks, f.new_micro_batch) for f in ref[r][1].fallbacks] == [(3, [2], 8)]
        assert ref[r][3] is None
        assert np.array_equal(w, ref[r][0]), "the dropped step's reduced gradients were applied"
        step3 = _steps(events)[3]
        # every rank entered the gradient all-reduce of the failed attempt (rank 2 with zeros), then
        # the retry: post, grads, wait again
        assert step3[:3] == ["post", "grads(zeros)" if r == 2 else "grads", "wait"], step3
        assert step3[3:] == ["post", "grads", "wait"], step3


def test_auto_overlaps_only_under_fail_fast():
    out = run_ranks(2, lambda c: _train(c, "auto", steps=3))
    assert all(not s.overlapped and "post" not in ev and exc is None for _, s, ev, exc in out)


def test_overlap_option_is_checked():
    from distmem.errors import ConfigError

    with pytest.raises(ConfigError, match="overlap='yes'"):
        guard.step(lambda x: ([x], 0.0), micro_batch_size=1, overlap="yes")



def test_a_carrying_reducer_runs_no_flag_collective_on_a_clean_step():
    out = run_ranks(4, lambda c: _train(c, True, carry=True))
    ref = run_ranks(4, lambda c: _train(c, False))
    for r in range(4):
        assert not isinstance(out[r], BaseException), out[r]
        w, s, events, exc = out[r]
        assert exc is None and s.overlapped
        steps = _steps(events)
        assert steps[0] == ["flags", "grads"]  # the first step: blocking
        assert all(st == ["grads+flag"] for st in steps[1:6]), steps  # one collective per step
        assert ref[r][3] is None
        assert np.array_equal(w, ref[r][0]), "carrying the verdict trains differently"


def test_a_carried_oom_is_decided_on_that_step_and_trains_as_the_blocking_protocol():
    out = run_ranks(4, lambda c: _train(c, True, rank2_oom_at_call7, carry=True))
    ref = run_ranks(4, lambda c: _train(c, False, rank2_oom_at_call7))
    for r in range(4):
        assert not isinstance(out[r], BaseException), out[r]
        w, s, events, exc = out[r]
        assert exc is None
        assert [(f.step, f.ranks, f.new_micro_batch) for f in s.fallbacks] == [(3, [2], 8)]
        assert s.fallbacks[0].errors == {2: "MemoryError: rank 2 OOM"}
        assert ref[r][3] is None
        assert np.array_equal(w, ref[r][0]), "the dropped step's reduced gradients were applied"
        # the failed attempt: every rank in the gradient all-reduce (rank 2 with zeros and flag 1),
        # then the retry (two micro-batches of 8, one all-reduce)
        assert _steps(events)[3] == ["grads(zeros)+flag" if r == 2 else "grads+flag", "grads+flag"]


def test_a_carried_error_ends_the_step_on_every_rank():
    fault = lambda r, call, n: ValueError("bad shape") if (r, call) == (1, 5) else None  # noqa: E731
    out = run_ranks(3, lambda c: _train(c, True, fault, carry=True))
    for r in range(3):
        assert not isinstance(out[r], BaseException), out[r]
        exc = out[r][3]
        assert type(exc).__name__ == ("ValueError" if r == 1 else "PeerError"), exc
        if r != 1:
            assert "rank [1] raised an error" in str(exc) and "rank 1: ValueError: bad shape" in str(exc), str(exc)


def test_a_carried_end_of_data_stops_every_rank_at_the_same_step():
    def run(c):
        events: List[str] = []
        m = Linear()
        s = guard.step(m.grads_of, micro_batch_size=16, apply=m.apply, comm=c, timeout=20.0,
                       reduce_gradients=_carrying(c, events), flags=EventFlags(c, events), overlap=True)
        x, y = make_data(c.rank, 64)
        batches = iter([(x[:16], y[:16]), (x[16:32], y[16:32])] + ([] if c.rank == 1 else [(x[32:48], y[32:48])]))
        done = 0
        try:
            while True:
                s.next(batches)
                done += 1
        except StopIteration:
            return done, s.overlapped

    out = run_ranks(3, run)
    assert all(not isinstance(o, BaseException) for o in out), out
    assert [o[0] for o in out] == [2, 2, 2] and all(o[1] for o in out)  # every rank stops at the third
