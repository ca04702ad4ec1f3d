"""The one thread-with-timeout helper: run a blocking call that has no timeout of its own
(Horovod, torch.distributed, tf.distribute collectives) on a long-lived worker thread and give up
waiting after ``timeout`` seconds.

A call that does not return in time keeps running on its thread (Python cannot stop it) and the
worker is marked stuck until it does. The next call then either fails at once (``while_stuck="fail"``:
the guard's flag all-reduce, whose next call under the same collective name must not overtake the
stuck one) or runs on a fresh worker (``"replace"``: gathers, whose names are unique per call)."""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional, Tuple

__all__ = ["Stuck", "Worker", "call_with_timeout"]


class Stuck(Exception):
    """The call did not return within its timeout (it may still be running on its thread)."""


class Worker:
    """A daemon thread that runs one call at a time; ``call`` waits at most ``timeout`` seconds."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: "queue.Queue[Tuple[Callable[[], Any], queue.Queue]]" = queue.Queue()
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def stuck(self) -> bool:
        """True while a call that timed out is still running."""
        return self._busy.is_set()

    def _loop(self) -> None:
        while True:
            fn, out = self._jobs.get()
            try:
                result = (True, fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result = (False, exc)
            self._busy.clear()
            out.put(result)

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        if self._busy.is_set():
            raise Stuck(f"{self.name}: an earlier call is still blocked after its timeout")
        out: "queue.Queue[Tuple[bool, Any]]" = queue.Queue(maxsize=1)
        self._busy.set()
        self._jobs.put((fn, out))
        try:
            ok, value = out.get(timeout=max(timeout, 0.001))
        except queue.Empty:
            raise Stuck(f"{self.name}: no answer within {timeout:.1f} s") from None
        if ok:
            return value
        raise value


_workers: dict = {}
_lock = threading.Lock()


def call_with_timeout(fn: Callable[[], Any], timeout: float, name: str = "distmem-collective", *,
                      while_stuck: str = "replace") -> Any:
    """Run ``fn`` on the named worker thread; :class:`Stuck` after ``timeout`` seconds.

    ``while_stuck``: what a call does while an earlier one on this worker is still blocked:
    ``"replace"`` runs on a fresh worker, ``"fail"`` raises :class:`Stuck` at once."""
    with _lock:
        w: Optional[Worker] = _workers.get(name)
        if w is None or (w.stuck and while_stuck == "replace"):
            w = _workers[name] = Worker(name)
    return w.call(fn, timeout)
