"""The agreement every guarded step and every batch-size probe ends with.

    each rank:  try: work()  except: classify  ->  status OK | OOM | ERROR | STOP
    all ranks:  verdict = flag all-reduce(status bit)           (tiny, with a timeout; in the overlapped
                                                                step one element of the gradient
                                                                all-reduce, the failing ranks then
                                                                gathered: see step.py)
    not ok:     descriptions = allgather("Type: message")       (failure path only)
                ERROR anywhere -> the failing rank re-raises its own exception, the others PeerError
                STOP anywhere  -> StopIteration on every rank
                OOM anywhere   -> every rank drops the work; the caller shrinks and retries

Every branch is decided from the verdict alone, so every rank takes the same one and no rank enters a
collective that another rank skips.
"""
from __future__ import annotations

import gc
import logging
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

from ..comm import Comm, get_comm, resolve_timeout
from ..console import say as console_say
from ..errors import GatherTimeoutError
from ..units import plural
from .errors import PeerError
from .flags import FlagReducer, Status, Verdict, decode, encode, flag_reducer
from .oom import describe, is_oom

__all__ = ["Agreement", "classify", "forget", "free_memory", "say", "summarise", "attempt", "failure"]

log = logging.getLogger("distmem")


def say(rank: int, msg: str) -> None:
    """One log line, prefixed like the rest of distmem's (``[distmem rank R]``), on the ``distmem`` logger."""
    console_say(f"[distmem rank {rank}] {msg}", logger=log)


def classify(exc: BaseException, in_fetch: bool = False) -> Status:
    """OOM for out-of-memory errors, STOP for the end of the data while fetching, ERROR for the rest."""
    if is_oom(exc):
        return Status.OOM
    if in_fetch and (isinstance(exc, StopIteration) or
                     any(c.__name__ == "OutOfRangeError" for c in type(exc).__mro__)):
        return Status.STOP
    return Status.ERROR


def forget(exc: BaseException) -> None:
    """Drop the frames an exception keeps alive: after an OOM they hold the step's activations."""
    tb = exc.__traceback__
    if tb is not None:
        traceback.clear_frames(tb)
    exc.__traceback__ = None
    exc.__context__ = None
    exc.__cause__ = None


def free_memory(full: bool = True) -> None:
    """Collect garbage and hand cached framework memory back (torch's CUDA cache when CUDA is up).

    ``full``: a full collection (0.1-0.5 s in a process that imported TensorFlow and torch; ``gc.freeze()``
    after start-up makes it cheap) on the ranks that ran out of memory; the others only need the young
    generations, since nothing of theirs failed."""
    gc.collect() if full else gc.collect(1)
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - freeing is best effort; the retry shows whether it sufficed
            pass


class Agreement:
    """Flag all-reduce + (on failure) description gather over one transport, with one timeout."""

    def __init__(self, comm: Optional[Comm] = None, timeout: Optional[float] = None,
                 flags: Optional[FlagReducer] = None):
        self.comm = comm if comm is not None else get_comm()
        self.flags = flags if flags is not None else flag_reducer(self.comm)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.timeout = resolve_timeout(timeout)
        if self.timeout <= 0:
            from ..errors import ConfigError

            raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds")

    def verdict(self, status: Status, where: str) -> Verdict:
        try:
            vec = self.flags.reduce(encode(self.rank, self.size, status), self.timeout)
        except GatherTimeoutError as exc:
            raise GatherTimeoutError(f"{where}: {exc}", getattr(exc, "missing", ())) from None
        return decode(vec, self.size)

    def vote(self, yes: bool, where: str) -> bool:
        """True when every rank says yes (one all-reduce of one number, on the job's transport)."""
        try:
            total = self.comm.allreduce([1.0 if yes else 0.0], "sum", self.timeout)[0]
        except GatherTimeoutError as exc:
            raise GatherTimeoutError(f"{where}: agreeing on the overlapped step: {exc}",
                                     getattr(exc, "missing", ())) from None
        return total >= self.size - 0.5

    def post(self, status: Status, where: str) -> Any:
        """Start the flag all-reduce without waiting (the overlapped step); :meth:`wait` ends it."""
        try:
            return self.flags.post(encode(self.rank, self.size, status))
        except GatherTimeoutError as exc:
            raise GatherTimeoutError(f"{where}: {exc}", getattr(exc, "missing", ())) from None

    def wait(self, posted: Any, where: str) -> Verdict:
        try:
            vec = posted.wait(self.timeout)
        except GatherTimeoutError as exc:
            raise GatherTimeoutError(f"{where}: {exc}", getattr(exc, "missing", ())) from None
        return decode(vec, self.size)

    def gather_verdict(self, status: Status, mine: Optional[str], where: str) -> Tuple[Verdict, Dict[int, str]]:
        """The verdict and every failing rank's ``"Type: message"`` from one allgather of each rank's
        status (the overlapped step, once its gradient all-reduce said some rank was not clean)."""
        try:
            rows = self.comm.allgather([int(status), mine], self.timeout)
        except GatherTimeoutError as exc:
            raise GatherTimeoutError(f"{where}: gathering the failures: {exc}", exc.missing) from None
        by = {s: [r for r, row in enumerate(rows) if int(row[0]) == int(s)] for s in (Status.OOM, Status.ERROR,
                                                                                         Status.STOP)}
        verdict = Verdict(by[Status.OOM], by[Status.ERROR], by[Status.STOP])
        return verdict, {r: row[1] for r, row in enumerate(rows) if row[1] is not None}

    def descriptions(self, mine: Optional[str], where: str) -> Dict[int, str]:
        """Every rank's ``"Type: message"`` (None where it had none); only on the failure path."""
        try:
            rows = self.comm.allgather(mine, self.timeout)
        except GatherTimeoutError as exc:
            raise GatherTimeoutError(f"{where}: gathering the failures: {exc}", exc.missing) from None
        return {r: d for r, d in enumerate(rows) if d is not None}

    def raise_if_failed(self, verdict: Verdict, status: Status, own: Optional[BaseException],
                        descs: Dict[int, str], where: str) -> None:
        """ERROR and STOP end the step on every rank; OOM is left to the caller."""
        if verdict.error:
            if status == Status.ERROR and own is not None:
                raise own
            lines = "; ".join(f"rank {r}: {descs.get(r, '?')}" for r in verdict.error)
            one = len(verdict.error) == 1
            raise PeerError(
                f"{where}: {plural(len(verdict.error), 'rank', bare=True)} {verdict.error} raised an error that is not "
                f"an out-of-memory error ({lines}); rank {self.rank} stops here instead of entering the gradient "
                "all-reduce. " + ("The failing rank re-raises its own exception: see that traceback in its log"
                                  if one else "The failing ranks re-raise their own exceptions: see those tracebacks "
                                  "in their logs"), verdict.error, descs)
        if verdict.stop:
            if status == Status.STOP and own is not None:
                raise own
            raise StopIteration(f"{where}: {plural(len(verdict.stop), 'rank', bare=True)} {verdict.stop} ran out of data, "
                                "so every rank stops here")


def summarise(ranks: List[int], descs: Dict[int, str], limit: int = 3) -> str:
    shown = "; ".join(f"rank {r}: {descs[r]}" for r in ranks[:limit] if r in descs)
    more = f"; and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return shown + more


def attempt(work, in_fetch_flag: List[bool]) -> Tuple[Status, Any, Optional[BaseException], Optional[str], float]:
    """Run ``work()``; classify what it raised. Returns (status, result, kept exception, description,
    time of the fault). An OOM's exception is described and forgotten at once (its frames hold memory);
    KeyboardInterrupt / SystemExit are not caught: they end this rank, and the others' next flag
    all-reduce times out."""
    try:
        return Status.OK, work(), None, None, 0.0
    except Exception as exc:  # noqa: BLE001 - classified, and re-raised on this rank unless it is an OOM
        return failure(exc, in_fetch_flag[0])


def failure(exc: BaseException, in_fetch: bool) -> Tuple[Status, None, Optional[BaseException], str, float]:
    """What :func:`attempt` returns for ``exc`` raised by the work (``in_fetch``: while fetching)."""
    t = time.monotonic()
    status = classify(exc, in_fetch)
    desc = describe(exc)
    if status == Status.OOM:
        forget(exc)
        return status, None, None, desc, t
    return status, None, exc, desc, t
