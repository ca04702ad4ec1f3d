"""Errors the guard raises on every rank at once, each carrying every rank's view."""
from __future__ import annotations

from typing import Dict, Iterable, Optional

from ..errors import DistmemError

__all__ = ["GuardError", "PeerError", "BatchSizeFloorError"]


class GuardError(DistmemError, RuntimeError):
    """The guarded step (or batch-size probe) stopped on every rank. ``ranks`` are the ranks at fault,
    ``errors`` maps each of them to ``"Type: message"`` as that rank saw it."""

    def __init__(self, message: str, ranks: Iterable[int] = (), errors: Optional[Dict[int, str]] = None):
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.errors = dict(errors or {})


class PeerError(GuardError):
    """Another rank raised an error that is not an out-of-memory error; that rank re-raises its own
    exception unchanged, every other rank raises this one instead of entering the gradient all-reduce."""


class BatchSizeFloorError(GuardError):
    """Even the smallest allowed (micro-)batch runs out of memory on at least one rank."""
