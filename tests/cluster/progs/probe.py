"""One rank of a cluster launch: plan with distmem, print what this rank got, then report().

Prints one line ``PROBE {json}`` with the rank's plan (host, local rank, devices with UUID, share,
enforcement), the hostname and the launcher variables it saw; rank 0 then writes the job's report
to ``--report``. ``--transport`` says how report() reaches the other ranks:

  mpi          mpi4py (mpirun, horovodrun --mpi)
  horovod      hvd.init() from horovod.tensorflow (horovodrun --gloo)
  torch-env    torch.distributed gloo from torchrun's MASTER_ADDR/RANK/WORLD_SIZE
  torch-slurm  torch.distributed gloo from srun's SLURM_PROCID/SLURM_NTASKS, master on the step's first node

On an error the line carries ``"error"`` instead of the plan, and the rank exits 3.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# DISTMEM_CLUSTER_SRC runs the probe against another checkout of distmem (a release, an older commit).
sys.path.insert(0, os.environ.get("DISTMEM_CLUSTER_SRC") or ROOT)

__all__ = []

#: Launcher variables worth printing: what the rank's placement could have been read from.
SEEN = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
        "OMPI_COMM_WORLD_NODE_RANK", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
        "HOROVOD_CROSS_RANK", "HOROVOD_HOSTNAME", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
        "SLURMD_NODENAME", "SLURM_STEP_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "DISTMEM_FLEET")


def _first_node(nodelist: str) -> str:
    """The first host of a SLURM node list (``hosta,hostb`` or ``node[1-2]``)."""
    head = nodelist.split(",")[0]
    if "[" in head:
        base, rest = head.split("[", 1)
        head = base + rest.split("-")[0].split(",")[0].rstrip("]")
    return head


def _transport(kind: str, timeout: float) -> None:
    from datetime import timedelta

    if kind == "mpi":
        from mpi4py import MPI  # noqa: F401 - initialises MPI; distmem's MPIComm uses COMM_WORLD

    elif kind == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
    elif kind in ("torch-env", "torch-slurm"):
        import torch.distributed as dist

        if kind == "torch-env":
            dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout))
        else:
            env = os.environ
            addr = _first_node(env["SLURM_STEP_NODELIST"])
            port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=int(env["SLURM_PROCID"]),
                                    world_size=int(env["SLURM_NTASKS"]), timeout=timedelta(seconds=timeout))
    elif kind != "none":
        raise SystemExit(f"probe: unknown --transport {kind!r}")


def _close(kind: str) -> None:
    if kind.startswith("torch"):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _emit(row: dict, rows: str | None) -> None:
    text = json.dumps(row, sort_keys=True)
    if rows:
        os.makedirs(rows, exist_ok=True)
        tmp = os.path.join(rows, f".{row['hostname']}-{row['pid']}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(rows, f"{row['hostname']}-{row['pid']}.json"))
    print("PROBE " + text, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="none")
    ap.add_argument("--report", default=None, help="rank 0 writes the job's report JSON here")
    ap.add_argument("--rows", default=None, help="folder for this rank's row as <hostname>-<pid>.json "
                    "(launchers may split long output lines; a file cannot be interleaved)")
    ap.add_argument("--timeout", type=float, default=45.0, help="seconds for the transport and report()")
    ap.add_argument("--enforce", default="framework", choices=["framework", "native"],
                    help="init()'s enforce=: native requires the cap distmem-exec set (the row then carries it)")
    args = ap.parse_args()
    row = {"hostname": socket.gethostname(), "pid": os.getpid(),
           "env": {k: os.environ[k] for k in SEEN if k in os.environ}}
    try:
        _transport(args.transport, args.timeout)
        import distmem

        plan = distmem.init(strategy="data", framework="none", verbose=False, enforce=args.enforce)
        m = plan.mine
        if args.enforce == "native":
            from distmem.apply import native

            row.update(cap=native.status()["cap_bytes"], limit=m.limit_bytes)
        row.update(rank=m.rank, size=plan.world_size, local_rank=m.local_rank, host=m.host, mode=m.mode,
                   devices=[{"index": d.index, "uuid": d.uuid, "shared_by": d.shared_by, "enforce": d.enforce,
                             "planned_bytes": d.planned_bytes, "total_bytes": d.total_bytes}
                            for d in m.devices])
    except Exception as exc:  # noqa: BLE001 - the test shows every rank's error, not just the first
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc()[-2000:]
        _emit(row, args.rows)
        if args.transport == "mpi" and "mpi4py.MPI" in sys.modules:
            # The other ranks would wait in report() until its timeout; end the whole job now.
            sys.stdout.flush()
            sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(3)
        return 3
    _emit(row, args.rows)
    try:
        distmem.report(path=args.report, timeout=args.timeout, print_table=False)
    except Exception as exc:  # noqa: BLE001
        print("PROBE-REPORT-ERROR " + json.dumps({"rank": row.get("rank"), "error": f"{type(exc).__name__}: {exc}"}),
              flush=True)
        return 4
    finally:
        _close(args.transport)
    return 0


if __name__ == "__main__":
    sys.exit(main())
