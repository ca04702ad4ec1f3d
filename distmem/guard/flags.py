"""The per-step verdict: one tiny all-reduce that tells every rank which ranks ran out of memory,
failed otherwise, or ran out of data.

Encoding: three bitmaps (OOM, ERROR, STOP), 52 ranks per float64 word. A rank sets only its own bit,
so the element-wise *sum* over ranks equals the bitwise OR, exactly (every sum stays below 2**52). The
vector is ``3 * ceil(size / 52)`` doubles: 24 bytes up to 52 ranks, 1.9 KB for 4,096 ranks.

Transports, each with a real timeout, each supplied by its Comm (distmem.comm): mpi4py
``Iallreduce`` polled with back-off; Horovod (``horovod.torch``: ``allreduce_async_`` + ``poll``;
``horovod.tensorflow``: the eager op on one persistent helper thread); torch.distributed
``all_reduce(async_op=True)`` polled; anything else through ``Comm.allreduce``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from ..comm import Comm, FlagReducer, get_comm

__all__ = ["Status", "Verdict", "CLEAN", "encode", "decode", "FlagReducer", "flag_reducer", "WORD_BITS"]

WORD_BITS = 52


class Status(enum.IntEnum):
    """What one rank reports after computing its share of a step."""
    OK = 0
    OOM = 1     # out of memory: every rank drops the step and retries smaller
    ERROR = 2   # any other exception: every rank raises
    STOP = 3    # the data ran out on this rank: every rank stops


def words(size: int) -> int:
    return (size + WORD_BITS - 1) // WORD_BITS


def encode(rank: int, size: int, status: Status) -> List[float]:
    """This rank's contribution: zeros, plus its bit in the bitmap of its status."""
    w = words(size)
    vec = [0.0] * (3 * w)
    if status != Status.OK:
        vec[(int(status) - 1) * w + rank // WORD_BITS] = float(1 << (rank % WORD_BITS))
    return vec


@dataclass(frozen=True)
class Verdict:
    """The all-reduced flags: which ranks reported OOM, ERROR, STOP. Identical on every rank."""
    oom: List[int] = field(default_factory=list)
    error: List[int] = field(default_factory=list)
    stop: List[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.oom or self.error or self.stop)


#: the verdict of a step where every rank was clean
CLEAN = Verdict()


def decode(vec: Sequence[float], size: int) -> Verdict:
    w = words(size)
    if len(vec) != 3 * w:
        raise ValueError(f"flag vector has {len(vec)} words, {3 * w} expected for {size} ranks")
    if not any(vec):
        return CLEAN  # every step of a healthy job: no bit to look for
    out: List[List[int]] = []
    for k in range(3):
        ranks = []
        for i in range(w):
            bits = int(round(vec[k * w + i]))
            j = 0
            while bits:
                if bits & 1:
                    ranks.append(i * WORD_BITS + j)
                bits >>= 1
                j += 1
        out.append([r for r in ranks if r < size])
    return Verdict(*out)


def flag_reducer(comm: Optional[Comm] = None) -> FlagReducer:
    """The fastest flag transport for ``comm`` (default: the job's transport from ``get_comm()``):
    each transport supplies its own (:meth:`distmem.comm.Comm.flag_reducer`)."""
    c = comm if comm is not None else get_comm()
    return c.flag_reducer()
