"""Stage: the transports. Takes the job's runtime (MPI, Horovod, torch.distributed, a tf.distribute
strategy) and returns one :class:`Comm` - gather to rank 0, all-gather, all-reduce, each bounded
by a timeout - plus each transport's flag all-reduce for the OOM guard.

Chosen in this order: mpi4py when an MPI launcher started the job (point-to-point and
non-blocking collectives on a private communicator, so every call has a real timeout and names
missing ranks); Horovod when it is initialised; torch.distributed when initialised; a
tf.distribute strategy when one is given (:func:`distmem.comm.tf_strategy.use_strategy`); else
one process.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from .. import session, settings
from ..discover import runtime
from ..errors import ConfigError
from .base import (REDUCE_OPS, Comm, CommFlags, FlagReducer, PostedFlags, SingleComm, SingleFlags, check_op, mpi_launched,
                   reduce_rows, resolve_timeout)

__all__ = ["Comm", "SingleComm", "FlagReducer", "PostedFlags", "SingleFlags", "CommFlags", "get_comm", "set_comm",
           "mpi_launched", "REDUCE_OPS", "check_op", "reduce_rows", "resolve_timeout", "MPIComm", "HorovodComm",
           "TorchDistComm"]

log = logging.getLogger("distmem")

_current: dict = {"comm": None}


def __getattr__(name: str) -> Any:
    # The transports import their runtime (mpi4py, torch) only when used.
    if name == "MPIComm":
        from .mpi import MPIComm

        return MPIComm
    if name == "HorovodComm":
        from .horovod import HorovodComm

        return HorovodComm
    if name == "TorchDistComm":
        from .torch_dist import TorchDistComm

        return TorchDistComm
    raise AttributeError(f"module 'distmem.comm' has no attribute {name!r}")


def set_comm(comm: Optional[Comm]) -> None:
    """Use this transport from now on (None: detect again on next use)."""
    _current["comm"] = comm


def get_comm() -> Comm:
    """The transport for this process, detected once and cached."""
    if _current["comm"] is not None:
        return _current["comm"]
    if session.wrapper:
        raise ConfigError(f"this process is {session.wrapper}, the rank's own process until it execs the command: "
                          "it starts no transport (an MPI_Init here would be the rank's, and the command's own would "
                          "then fail); the command's init() gathers")
    comm: Comm
    if mpi_launched() and settings.comm() in ("auto", "mpi"):
        try:
            from .mpi import MPIComm

            comm = MPIComm()
        except ImportError:
            log.info("distmem: launched by MPI but mpi4py is missing (pip install mpi4py); trying Horovod")
        else:
            _current["comm"] = comm
            return comm
    hvd = runtime.horovod()
    if hvd is not None:
        from .horovod import HorovodComm

        comm = HorovodComm(hvd)
    elif runtime.torch_distributed() is not None:
        from .torch_dist import TorchDistComm

        comm = TorchDistComm()
    else:
        from ..discover.identity import from_env

        topo = from_env()
        if topo is not None and topo.size > 1:
            raise ConfigError(
                f"this process is rank {topo.rank} of {topo.size} ({topo.source}) but no transport is ready to "
                "gather from the other ranks; call hvd.init() first, install mpi4py for mpirun jobs, init "
                "torch.distributed, or for tf.distribute (TF_CONFIG) call distmem.use_strategy(strategy) "
                "after creating the strategy")
        comm = SingleComm()
    _current["comm"] = comm
    return comm
