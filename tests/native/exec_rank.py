"""One rank of a job started as ``LAUNCHER distmem-exec -o framework=none -- python exec_rank.py TRANSPORT``.

The rank does what a training script does: ``distmem.init(enforce="native")`` first (it raises unless
the cap distmem-exec set is this rank's figure of the same plan), then the launcher's own transport -
``mpi`` (mpi4py: mpirun), ``horovod`` (horovod.tensorflow: horovodrun, Gloo or MPI),
``torch`` (torch.distributed with Gloo: torchrun) - which distmem-exec must have left to it. Through
the fake driver (libcuda.so.1 on LD_LIBRARY_PATH) it allocates its whole cap, then 1 MiB more, which
the cap must deny. Rank 0 prints ``EXEC_RANKS {json}``: every rank's row, gathered over the transport.
"""
import ctypes
import json
import os
import sys

import distmem
from distmem.apply import native

MiB = 1024 ** 2


def _alloc(size: int) -> int:
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t]
    ptr = ctypes.c_ulonglong(0)
    return int(cuda.cuMemAlloc_v2(ctypes.byref(ptr), size))


def _gather(transport: str, row: dict) -> list:
    if transport == "mpi":
        from mpi4py import MPI

        return MPI.COMM_WORLD.allgather(row)
    if transport == "horovod":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import horovod.tensorflow as hvd

        hvd.init()
        return hvd.allgather_object(row)
    if transport == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
        return rows
    raise SystemExit(f"exec_rank.py: unknown transport {transport!r} (mpi, horovod, torch)")


def main(transport: str) -> None:
    plan = distmem.init(framework="none", enforce="native", verbose=False)
    st = native.status()
    cap = st["cap_bytes"]
    row = {"rank": plan.mine.rank, "pid": os.getpid(), "limit": plan.mine.limit_bytes, "cap": cap,
           "origin": os.environ.get(native.ENV_ORIGIN), "plan": st["plan_fingerprint"] == plan.fingerprint(),
           "allocs": [_alloc(cap), _alloc(MiB)] if cap else []}
    rows = _gather(transport, row)
    if plan.mine.rank == 0:
        print("EXEC_RANKS " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
