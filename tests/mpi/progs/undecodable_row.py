"""One rank sends a row no other rank can decode: an object of a class from a module only that rank
has (what a rank running other code, or another version, sends). Rank 0's gather must keep
the good rows and report that rank as missing, and no rank may wait for the timeout.

TRANSPORT picks the transport: ``mpi`` (mpirun), ``horovod`` (horovodrun --gloo), ``torch``
(torch.distributed gloo under mpirun, MASTER_PORT from the test), ``tf`` (MultiWorkerMirroredStrategy
under launch/tf_config.py). Each rank prints ``RESULT {json}`` (under tf_config.py prefixed ``[rank i]``).
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from distmem.errors import GatherTimeoutError  # noqa: E402

TIMEOUT = float(os.environ.get("DECODE_TIMEOUT", "20"))
transport = os.environ["TRANSPORT"]
if transport == "mpi":
    from distmem.comm.mpi import MPIComm

    comm = MPIComm(timeout=TIMEOUT)
elif transport == "horovod":
    import horovod.tensorflow as hvd

    from distmem.comm.horovod import HorovodComm

    hvd.init()
    comm = HorovodComm(hvd)
elif transport == "torch":
    import torch.distributed as dist

    from distmem.comm.torch_dist import TorchDistComm

    os.environ.update(RANK=os.environ["OMPI_COMM_WORLD_RANK"], WORLD_SIZE=os.environ["OMPI_COMM_WORLD_SIZE"],
                      MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo")
    comm = TorchDistComm()
else:
    import tensorflow as tf

    from distmem.comm.tf_strategy import StrategyComm

    comm = StrategyComm(tf.distribute.MultiWorkerMirroredStrategy())

rank = comm.rank
if rank == 1:
    # A module only this rank has (other code, another version): its objects are pickled by
    # reference (by pickle and by cloudpickle alike), and unpickling them anywhere else fails.
    import types

    only = types.ModuleType("distmem_test_only_on_rank_1")
    exec("class OnlyHere:\n    pass\n", only.__dict__)
    sys.modules[only.__name__] = only
    row = {"rank": 1, "obj": only.OnlyHere()}
else:
    row = {"rank": rank}
t0 = time.monotonic()
rows, missing = comm.gather(row, 0, timeout=TIMEOUT)
out = {"rank": rank, "gather_seconds": time.monotonic() - t0, "missing": missing,
       "rows": None if rows is None else [r["rank"] if isinstance(r, dict) else None for r in rows]}
t0 = time.monotonic()
try:
    got = comm.allgather(row, timeout=TIMEOUT)
    out["allgather"] = [r["rank"] for r in got]
except GatherTimeoutError as exc:
    out["allgather"] = {"missing": exc.missing}
out["allgather_seconds"] = time.monotonic() - t0
print("RESULT " + json.dumps(out), flush=True)
if transport == "torch":
    dist.destroy_process_group()
