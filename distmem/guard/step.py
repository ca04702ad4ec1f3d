"""A training step that survives an out-of-memory error on any rank, with every rank in step.

    step = distmem.guard.step(grads_of, apply=apply, micro_batch_size=64, global_batch_size=512)
    for x, y in batches:            # this rank's share: global_batch_size / world size samples
        loss = step(x, y)

Each call splits this rank's batch into micro-batches, accumulates their gradients (weighted by
micro-batch size, so the result equals the whole batch's mean gradient), then agrees with the other
ranks through one tiny flag all-reduce (from the second clean step on, carried inside the gradient
all-reduce itself: see ``overlap``). On a clean verdict it averages the gradients over the ranks
and applies them. If any rank ran out of memory, every rank drops the step, frees what it can, and all
retry the same batch with a smaller micro-batch and more accumulation steps: the global batch, and with
it the learning-rate schedule, is unchanged. No rank enters the gradient all-reduce unless all do.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from ..comm import Comm
from ..errors import ConfigError
from ..units import plural
from .errors import BatchSizeFloorError
from .flags import CLEAN, FlagReducer, Status
from .grads import Reducer, dense, gradient_reducer, kind_of
from .protocol import Agreement, attempt, failure, free_memory, say, summarise

__all__ = ["StepGuard", "Fallback", "step", "split_sizes", "shrink_micro_batch", "planned_micro_batch"]


def split_sizes(n: int, micro: int) -> List[int]:
    """Micro-batch sizes covering ``n`` samples: full ones, then the remainder."""
    full, rest = divmod(n, micro)
    return [micro] * full + ([rest] if rest else [])


def shrink_micro_batch(micro: int, floor: int, factor: int = 2) -> Optional[int]:
    """The next smaller micro-batch (``micro // factor``, not below ``floor``); None at the floor."""
    if micro <= floor:
        return None
    return max(floor, micro // factor)


def batch_len(batch: Any) -> int:
    """Leading dimension of the first array/tensor in a (nested) batch."""
    if isinstance(batch, dict):
        for v in batch.values():
            n = batch_len(v)
            if n >= 0:
                return n
        return -1
    if isinstance(batch, (tuple, list)):
        for v in batch:
            n = batch_len(v)
            if n >= 0:
                return n
        return -1
    if batch is None:
        return -1
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape) > 0 and shape[0] is not None:
        return int(shape[0])
    return len(batch)


def slice_batch(batch: Any, i: int, j: int) -> Any:
    """Samples ``i:j`` of every array/tensor in a (nested) batch."""
    if isinstance(batch, dict):
        return {k: slice_batch(v, i, j) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(v, i, j) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(v, i, j) for v in batch)
    if batch is None or getattr(batch, "shape", (1,)) == ():
        return batch
    return batch[i:j]


def _axpy(acc: Optional[List[Any]], grads: Sequence[Any], w: float) -> List[Any]:
    """acc + w * grads, element-wise, keeping None where a gradient is None."""
    if acc is None:
        if w == 1.0:
            return list(grads)  # one micro-batch: its gradients are the step's, no copy (nothing adds to them)
        return [None if g is None else g * w for g in grads]
    if len(acc) != len(grads):
        raise ConfigError(f"the step function returned {len(grads)} gradients for one micro-batch and "
                          f"{len(acc)} for an earlier one; return one entry (None allowed) per parameter")
    out = []
    for a, g in zip(acc, grads):
        if g is None:
            out.append(a)
        elif a is None:
            out.append(g * w)
        elif hasattr(a, "add_"):
            out.append(a.add_(g, alpha=w))
        else:
            out.append(a + g * w)
    return out


def _grads_and_loss(out: Any) -> Tuple[Any, Any]:
    """``fn``'s ``(grads, loss)`` when ``params=`` is not given; ConfigError naming what it returned."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ConfigError("the step function must return (grads, loss) when params= is not "
                          f"given; it returned {type(out).__name__}")
    return out


def _scaled(loss: Any, w: float) -> Any:
    if loss is None:
        return None
    if hasattr(loss, "detach"):
        loss = loss.detach()
    return loss * w


@dataclass
class Fallback:
    """One agreed fallback. Identical on every rank except the timings, which are this rank's."""
    step: int                 #: index of the guarded step (calls so far, from 0)
    old_micro_batch: int
    new_micro_batch: int
    old_accumulation: int     #: micro-batches per step before / after
    new_accumulation: int
    local_batch: int          #: samples per rank per step (unchanged)
    global_batch: int         #: samples per step over all ranks (unchanged)
    ranks: List[int]          #: ranks that ran out of memory
    errors: Dict[int, str]    #: rank -> "Type: message" of its out-of-memory error
    wasted_seconds: float = 0.0   #: this rank's compute of the dropped attempt
    agree_seconds: float = 0.0    #: flag all-reduce + gathering the failures
    free_seconds: float = 0.0     #: garbage collection and cache release
    recovery_seconds: Optional[float] = None  #: from the fault (this rank's OOM, else the verdict) to the end of the first successful step
    _fault_at: float = field(default=0.0, repr=False)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.pop("_fault_at")
        d["errors"] = {str(k): v for k, v in self.errors.items()}
        return d


class StepGuard:
    """A guarded training step. Build it with :func:`step`; call it once per global batch on every rank.

    Two ways to hand over gradients:

    * ``params=None`` (TensorFlow, NumPy, JAX-style): ``fn(*micro_batch)`` returns ``(grads, loss)``,
      a list of per-parameter gradients (None allowed) of the micro-batch's *mean* loss. The guard
      accumulates ``sum(n_i / n * grads_i)`` and calls ``apply(averaged_grads)``.
    * ``params=model.parameters()`` (PyTorch): ``fn(*micro_batch)`` returns the micro-batch's mean loss;
      the guard runs ``(loss * n_i / n).backward()`` so ``.grad`` accumulates, averages ``.grad`` over
      ranks in place and calls ``apply([p.grad ...])`` (e.g. ``lambda _: opt.step()``).

    ``__call__`` returns the step's loss (sample-weighted mean over micro-batches, this rank's), or None.
    """

    def __init__(self, fn: Callable[..., Any], *, micro_batch_size: Optional[int] = None,
                 global_batch_size: Optional[int] = None,
                 apply: Optional[Callable[[List[Any]], Any]] = None, params: Optional[Sequence[Any]] = None,
                 min_micro_batch_size: int = 1, shrink: int = 2,
                 reduce_gradients: Union[str, Reducer, None] = "auto", comm: Optional[Comm] = None,
                 timeout: Optional[float] = None, no_sync: Optional[Callable[[], Any]] = None,
                 on_oom: Optional[Callable[[], None]] = None, flags: Optional[FlagReducer] = None,
                 log_rank: int = 0, overlap: Union[str, bool] = "auto"):
        micro_batch_size = planned_micro_batch() if micro_batch_size is None else micro_batch_size
        for name, v in (("micro_batch_size", micro_batch_size), ("min_micro_batch_size", min_micro_batch_size)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if not isinstance(shrink, int) or shrink < 2:
            raise ConfigError(f"shrink={shrink!r} must be an integer >= 2 (the micro-batch is divided by it)")
        if min_micro_batch_size > micro_batch_size:
            raise ConfigError(f"min_micro_batch_size={min_micro_batch_size} is above micro_batch_size="
                              f"{micro_batch_size}; lower the floor or raise the micro-batch")
        self.agreement = Agreement(comm, timeout, flags)
        self.rank, self.size = self.agreement.rank, self.agreement.size
        self.local_batch_size: Optional[int] = None
        self.global_batch_size = global_batch_size
        if global_batch_size is not None:
            if not isinstance(global_batch_size, int) or global_batch_size < 1 or global_batch_size % self.size:
                below = max(1, int(global_batch_size or 0) // self.size) * self.size
                raise ConfigError(
                    f"global_batch_size={global_batch_size!r} must be a positive multiple of the world size "
                    f"{self.size} (each rank takes an equal share); use {below} or {below + self.size}")
            self.local_batch_size = global_batch_size // self.size
            micro_batch_size = min(micro_batch_size, self.local_batch_size)
            min_micro_batch_size = min(min_micro_batch_size, micro_batch_size)
        self.fn = fn
        self.apply = apply
        self.params = None if params is None else list(params)
        self.micro_batch_size = micro_batch_size
        self.initial_micro_batch_size = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.shrink = shrink
        self._reduce_spec = reduce_gradients
        self._reducer: Optional[Reducer] = reduce_gradients if callable(reduce_gradients) else None
        if reduce_gradients not in ("auto", None) and not callable(reduce_gradients):
            raise ConfigError(f"reduce_gradients={reduce_gradients!r} must be 'auto', None or a callable")
        self.no_sync = no_sync
        self.on_oom = on_oom
        self.log_rank = log_rank
        if overlap not in ("auto", True, False):
            raise ConfigError(f"overlap={overlap!r} is not 'auto', True or False")
        self.overlap = overlap
        #: True once every rank runs the overlapped protocol (from the step after the first clean one)
        self.overlapped = False
        self._template: List[Any] = []
        self._pattern: Optional[List[bool]] = None
        self._voted = False
        #: the overlapped step with the verdict carried in the gradient all-reduce: the clean path
        self._fast = False
        self.steps = 0        #: guarded steps called so far (successful or not)
        self.fallbacks: List[Fallback] = []
        self._waiting: List[Fallback] = []

    # ------------------------------------------------------------------ public

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per step at the current micro-batch size (needs the local batch size)."""
        n = self.local_batch_size or self.micro_batch_size
        return math.ceil(n / self.micro_batch_size)

    def __call__(self, *batch: Any) -> Any:
        """Run one guarded step on this rank's batch (positional arrays/tensors, sliced on dim 0)."""
        return self.run(lambda: batch)

    def next(self, iterator: Iterator[Any]) -> Any:
        """Fetch the next batch inside the protocol, then run the step. When the data runs out on any
        rank, every rank raises StopIteration at the same step (uneven shards end together)."""
        def fetch() -> Tuple[Any, ...]:
            b = next(iterator)
            return tuple(b) if isinstance(b, (tuple, list)) else (b,)

        return self.run(fetch)

    def run(self, fetch: Callable[[], Tuple[Any, ...]]) -> Any:
        """The protocol; ``fetch()`` returns the positional arguments of ``fn`` (called at most once)."""
        if self._fast and not self._waiting:
            return self._clean_step(fetch)
        index = self.steps
        self.steps += 1
        return self._protocol(index, fetch)

    def _clean_step(self, fetch: Callable[[], Tuple[Any, ...]]) -> Any:
        """The overlapped step with the verdict in the gradient all-reduce, written for the step that
        is clean on every rank (the guard's whole cost in a healthy job, so it does the least it
        can); the first sign of anything else hands the step, where it is, to :meth:`_protocol`."""
        index = self.steps
        self.steps += 1
        t0 = time.monotonic()
        try:
            batch = fetch()
        except Exception as exc:  # noqa: BLE001 - classified by the protocol, on every rank alike
            return self._protocol(index, fetch, first=failure(exc, True) + (t0, None))
        try:
            loss, grads = self._compute(batch)
        except Exception as exc:  # noqa: BLE001
            return self._protocol(index, lambda: batch, first=failure(exc, False) + (t0, None))
        reduced, flag = self._reducer.with_flag(grads, 0.0)  # type: ignore[union-attr]
        if flag != 0.0:  # another rank was not clean: this step's verdict is gathered
            return self._protocol(index, lambda: batch,
                                  first=(Status.OK, (loss, grads), None, None, 0.0, t0, (reduced, flag)))
        self._remember_shapes(grads)
        if self.params is not None:
            self._set_grads(reduced)
        if self.apply is not None:
            self.apply(reduced)
        return loss

    def _protocol(self, index: int, fetch: Callable[[], Tuple[Any, ...]], first: Optional[Tuple[Any, ...]] = None) -> Any:
        """Step ``index`` through the whole protocol: attempt, verdict, and on a failure anywhere the
        same drop, fall-back and retry on every rank. ``first``: the outcome of an attempt already
        made by :meth:`_clean_step` (status, result, kept exception, description, time of the
        fault, its start, and the carried all-reduce's (gradients, flag) where it ran)."""
        where = f"guarded step {index}"
        box: Dict[str, Any] = {}
        in_fetch = [False]

        def work() -> Any:
            if "batch" not in box:
                in_fetch[0] = True
                box["batch"] = fetch()
                in_fetch[0] = False
            return self._compute(box["batch"])

        reduced: Optional[List[Any]] = None
        while True:
            carried: Optional[Tuple[List[Any], float]] = None
            if first is not None:
                status, result, own, desc, t_fault, t0, carried = first
                first = None
            else:
                t0 = time.monotonic()
                status, result, own, desc, t_fault = attempt(work, in_fetch)
            t1 = time.monotonic()
            descs: Optional[Dict[int, str]] = None
            if self.overlapped:
                # Overlapped: every rank all-reduces its gradients (zeros of the last clean step's
                # shapes where this rank has none) and this step's verdict decides whether the
                # reduced gradients are applied or dropped. A built-in reducer carries the verdict
                # in the gradients' own buffer (one element: 0 where clean), so a clean step runs no
                # collective of its own; who failed is gathered only when it is not 0. A reducer of
                # the user's: the flags posted before its all-reduce and waited after it.
                if self._carries:
                    if carried is None:
                        local = result[1] if status == Status.OK else self._zeros()
                        carried = self._reduce_with_flag(local, 0.0 if status == Status.OK else 1.0)
                    reduced, flag = carried
                    verdict, descs = ((CLEAN, None) if flag == 0.0
                                      else self.agreement.gather_verdict(status, desc, where))
                else:
                    local = result[1] if status == Status.OK else self._zeros()
                    posted = self.agreement.post(status, where)
                    reduced = self._reduce(local)
                    verdict = self.agreement.wait(posted, where)
            else:
                verdict = self.agreement.verdict(status, where)
            if verdict.ok:
                break
            result = reduced = None
            if descs is None:
                descs = self.agreement.descriptions(desc, where) if (verdict.oom or verdict.error) else {}
            self.agreement.raise_if_failed(verdict, status, own, descs, where)
            t2 = time.monotonic()
            self._drop(full=status == Status.OOM)
            t3 = time.monotonic()
            self._fall_back(verdict.oom, descs, wasted=(t_fault or t1) - t0, agree=t2 - t1, free=t3 - t2,
                            fault_at=t_fault or t2, where=where)
        loss, grads = result
        self._remember_shapes(grads)
        if reduced is None:
            if not self._voted and self.overlap is not False and self._reduce_spec is not None and self.size > 1:
                # Once, after the first clean verdict (the same step on every rank): every rank
                # votes; only a unanimous yes switches, and all switch at the next step.
                self._voted = True
                self._reducer_for(grads)
                self.overlapped = self.agreement.vote(self._may_overlap(), where)
                self._fast = self.overlapped and self._carries
            grads = self._reduce(grads)
        else:
            grads = self._set_grads(reduced)
        if self.apply is not None:
            self.apply(grads)
        t_end = time.monotonic()
        for fb in self._waiting:
            fb.recovery_seconds = t_end - fb._fault_at
        self._waiting.clear()
        return loss

    def describe(self) -> str:
        return (f"micro-batch {self.micro_batch_size} x {self.accumulation_steps} accumulation step(s)"
                + (f" = {self.local_batch_size} per rank, global batch {self.global_batch_size}"
                   if self.global_batch_size else ""))

    # ------------------------------------------------------------------ internals

    def _compute(self, batch: Tuple[Any, ...]) -> Tuple[Any, List[Any]]:
        n = batch_len(batch)
        if n < 1:
            raise ConfigError(f"the step got a batch without a leading dimension ({type(batch).__name__}); pass "
                              "arrays or tensors whose first dimension is the sample")
        if self.local_batch_size is not None and n != self.local_batch_size:
            raise ConfigError(
                f"rank {self.rank} got a batch of {n} samples but global_batch_size={self.global_batch_size} over "
                f"{self.size} ranks means {self.local_batch_size} per rank; batch the data per rank with "
                f"{self.local_batch_size} (drop the remainder) or change global_batch_size")
        if self.params is not None:
            for p in self.params:
                p.grad = None
        if n <= self.micro_batch_size and self.no_sync is None:
            return self._one_micro_batch(batch)
        acc: Optional[List[Any]] = None
        loss_sum: Any = None
        start = 0
        ctx = self.no_sync() if self.no_sync is not None else contextlib.nullcontext()
        with ctx:
            for size in split_sizes(n, self.micro_batch_size):
                args = batch if size == n else slice_batch(batch, start, start + size)
                start += size
                w = size / n
                out = self.fn(*args)
                if self.params is not None:
                    (out * w).backward()
                    loss = out
                else:
                    grads, loss = _grads_and_loss(out)
                    acc = _axpy(acc, list(grads), w)
                part = _scaled(loss, w)
                loss_sum = part if loss_sum is None else (None if part is None else loss_sum + part)
                del out, loss, args
        if self.params is not None:
            acc = [p.grad for p in self.params]
        return loss_sum, acc or []

    def _one_micro_batch(self, batch: Tuple[Any, ...]) -> Tuple[Any, List[Any]]:
        """The batch in one forward/backward (weight 1): what the loop does for one micro-batch."""
        out = self.fn(*batch)
        if self.params is not None:
            out.backward()
            return _scaled(out, 1.0), [p.grad for p in self.params]
        grads, loss = _grads_and_loss(out)
        return _scaled(loss, 1.0), list(grads)

    def _reducer_for(self, grads: List[Any]) -> Reducer:
        if self._reducer is None:
            self._reducer = gradient_reducer(self.agreement.comm, grads)
        return self._reducer

    @property
    def _carries(self) -> bool:
        """Whether the gradient all-reduce carries the verdict (a built-in reducer)."""
        return bool(getattr(self._reducer, "carries_flag", False))

    @property
    def verdict_in_gradients(self) -> bool:
        """True when the overlapped step runs and its verdict rides in the gradient all-reduce (no
        collective of the guard's own on a clean step)."""
        return self.overlapped and self._carries

    def _reduce(self, grads: List[Any]) -> List[Any]:
        if self._reduce_spec is None:
            return grads
        return self._set_grads(self._reducer_for(grads)(grads))

    def _reduce_with_flag(self, grads: List[Any], flag: float) -> Tuple[List[Any], float]:
        out, reduced = self._reducer.with_flag(grads, flag)  # type: ignore[union-attr]
        return self._set_grads(out), reduced

    def _set_grads(self, out: List[Any]) -> List[Any]:
        if self.params is not None:
            for p, g in zip(self.params, out):
                if g is not None and g is not p.grad:
                    p.grad = g
        return out

    def _may_overlap(self) -> bool:
        """This rank's vote for the overlapped protocol from the next step on (all must vote yes on
        the same clean verdict): asked for, a gradient all-reduce to overlap with, a flag transport
        that runs in the background, and - for ``overlap="auto"`` - fail fast running, since the
        gradient all-reduce is then entered before the verdict and only the heartbeat bounds it
        when a rank is gone."""
        if self.overlap is False or self._reduce_spec is None or self.size == 1:
            return False
        if not self._carries and not getattr(self.agreement.flags, "overlaps", False):
            return False
        if self.overlap == "auto":
            from ..comm import heartbeat

            return heartbeat.current() is not None
        return True

    def _remember_shapes(self, grads: List[Any]) -> None:
        """What a rank without gradients (its step failed) all-reduces in the overlapped step: zeros
        of the shapes of the last clean step's gradients."""
        if self.params is not None:
            self._template = [p.grad is not None for p in self.params]
            return
        pattern = [g is None for g in grads]
        if pattern != self._pattern:  # a parameter's gradient keeps its shape: rebuilt only when the set changes
            self._pattern = pattern
            self._template = [_zero_factory(g) for g in grads]

    def _zeros(self) -> List[Any]:
        if self.params is not None:
            import torch

            return [torch.zeros_like(p) if had else None for p, had in zip(self.params, self._template)]
        return [None if make is None else make() for make in self._template]

    def _drop(self, full: bool) -> None:
        if self.params is not None:
            for p in self.params:
                p.grad = None
        if self.on_oom is not None:
            self.on_oom()
        free_memory(full)

    def _fall_back(self, ranks: List[int], descs: Dict[int, str], *, wasted: float, agree: float, free: float,
                   fault_at: float, where: str) -> None:
        old = self.micro_batch_size
        new = shrink_micro_batch(old, self.min_micro_batch_size, self.shrink)
        local = self.local_batch_size
        what = summarise(ranks, descs)
        if new is None:
            raise BatchSizeFloorError(
                f"{where}: micro-batch {old} is the floor (min_micro_batch_size={self.min_micro_batch_size}) and "
                f"still runs out of memory on {plural(len(ranks), 'rank', bare=True)} {ranks} ({what}); the step "
                "cannot shrink further. Lower "
                "min_micro_batch_size, shorten the sequences / images, enable activation checkpointing or mixed "
                "precision, or spread the model over more devices", ranks, descs)
        old_acc = self.accumulation_steps
        self.micro_batch_size = new
        fb = Fallback(step=self.steps - 1, old_micro_batch=old, new_micro_batch=new, old_accumulation=old_acc,
                      new_accumulation=self.accumulation_steps, local_batch=local or 0,
                      global_batch=self.global_batch_size or 0, ranks=list(ranks), errors=dict(descs),
                      wasted_seconds=wasted, agree_seconds=agree, free_seconds=free, _fault_at=fault_at)
        self.fallbacks.append(fb)
        self._waiting.append(fb)
        if self.rank == self.log_rank:
            glob = (f"; global batch {self.global_batch_size} = {self.size} x {local} unchanged"
                    if self.global_batch_size else "")
            say(self.rank, f"guard: {where}: out of memory on {plural(len(ranks), 'rank', bare=True)} {ranks} ({what}); "
                           "every rank drops the step "
                           f"and retries with micro-batch {old} -> {new} (accumulation {old_acc} -> "
                           f"{self.accumulation_steps}){glob}")


def _zero_factory(g: Any) -> Optional[Callable[[], Any]]:
    """A function making zeros shaped like gradient ``g`` (None for None)."""
    if g is None:
        return None
    g = dense(g)
    kind = kind_of(g)
    shape = tuple(int(d) for d in g.shape)
    if kind == "torch":
        dtype, device = g.dtype, g.device

        def torch_zeros() -> Any:
            import torch

            return torch.zeros(shape, dtype=dtype, device=device)

        return torch_zeros
    if kind == "tensorflow":
        tf_dtype = g.dtype

        def tf_zeros() -> Any:
            import tensorflow as tf

            return tf.zeros(shape, dtype=tf_dtype)

        return tf_zeros
    import numpy as np

    np_dtype = np.asarray(g).dtype
    return lambda: np.zeros(shape, dtype=np_dtype)


def planned_micro_batch() -> int:
    """The micro-batch ``init(strategy="auto")`` chose (``plan.extras["fit"]["guard_start_batch"]``)."""
    from .. import session

    plan = session.current_plan()
    fit = (plan.extras.get("fit") or {}) if plan is not None else {}
    if not fit.get("guard_start_batch"):
        raise ConfigError("micro_batch_size= is needed: give the samples per forward/backward to start with, or "
                          "plan with distmem.init(strategy='auto', model=..., global_batch_size=...), whose chosen "
                          "micro-batch the guard then starts from")
    return int(fit["guard_start_batch"])


def step(fn: Callable[..., Any], *, micro_batch_size: Optional[int] = None, global_batch_size: Optional[int] = None,
         apply: Optional[Callable[[List[Any]], Any]] = None, params: Optional[Sequence[Any]] = None,
         **options: Any) -> StepGuard:
    """A guarded training step; see :class:`StepGuard`. Every rank builds it with the same arguments.

    micro_batch_size: samples per forward/backward to start with; halved (``shrink=2``) on every
        out-of-memory verdict, never below ``min_micro_batch_size`` (default 1). Omitted after
        ``init(strategy="auto")``: the micro-batch the plan chose.
    global_batch_size: samples per step over all ranks; each rank's batch must hold
        ``global_batch_size / world size`` of them. Omitted: whatever each call gets.
    apply: called with the rank-averaged gradients after a clean verdict (``opt.apply_gradients`` /
        ``opt.step``).
    params: PyTorch parameters: ``fn`` returns the loss and the guard runs backward (see StepGuard).
    reduce_gradients: ``"auto"`` (Horovod, torch.distributed or MPI, whichever the job runs), a callable
        over the gradient list, or None when ``apply`` all-reduces itself.
    comm, timeout: the transport (default ``distmem.comm.get_comm()``) and the seconds a rank waits for
        the others at the flag all-reduce (default ``DISTMEM_TIMEOUT`` or 60) before raising
        GatherTimeoutError instead of hanging.
    no_sync: a context manager factory around the micro-batches (``ddp_model.no_sync``): the guard
        all-reduces after the verdict, so DDP must not all-reduce inside backward.
    on_oom: extra clean-up on every rank after a dropped step (before the garbage collection).
    overlap: ``"auto"`` (default): from the step after the first clean one, every rank enters the
        gradient all-reduce and the verdict rides in it (one element more in a built-in reducer's
        buffer; with a reducer of your own, the flag all-reduce is posted before it and waited
        after it), when fail fast runs (``init()``'s default: it bounds the gradient all-reduce a
        lost rank would otherwise leave waiting); ``True`` without fail fast too; ``False``: the
        blocking protocol (flags, then the gradient all-reduce only on a clean verdict).
    """
    return StepGuard(fn, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, apply=apply,
                     params=params, **options)
