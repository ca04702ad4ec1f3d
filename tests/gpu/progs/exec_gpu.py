"""Every rank of ``mpirun -np N distmem-exec -- python tests/gpu/progs/exec_gpu.py --out RESULT.json``:
distmem.init(framework="torch", enforce="native") under the cap distmem-exec computed from the same
plan, a training step, a tensor of a quarter of its share; beside it what the cap, CUDA and the plan
say. Rank 0 writes RESULT.json for tests/gpu/test_exec_gpu.py.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpuprobe  # noqa: E402

gpuprobe.setup()


def main(comm):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import distmem
    from distmem.apply import native

    plan = distmem.init(framework="torch", enforce="native")
    slot = plan.mine.devices[0]
    gpu = gpuprobe.Gpu(slot.index)
    gpu.train_step()
    held = [gpu.alloc(slot.planned_bytes // 4)]
    gpu.sync()
    free, total = gpu.mem_get_info()
    st = native.status(slot.index)
    row = {"rank": plan.mine.rank, "pid": os.getpid(), "limit": plan.mine.limit_bytes, "planned": slot.planned_bytes,
           "shared_by": slot.shared_by, "enforce": slot.enforce, "cap": st["cap_bytes"], "active": st["active"],
           "cap_used": st["used_bytes"], "cap_peak": st["peak_bytes"], "denials": st["denials"],
           "cuda_total": total, "cuda_free": free, "reserved": gpu.reserved(), "warnings": list(plan.warnings),
           "origin": os.environ.get(native.ENV_ORIGIN)}
    rows = comm.gather(row, root=0)
    if comm.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"np": comm.Get_size(), "rows": rows, "fake": gpuprobe.FAKE}, f, indent=1, default=str)
        print(f"[rank 0] wrote {args.out}", flush=True)
    comm.Barrier()
    gpu.release(held)


if __name__ == "__main__":
    gpuprobe.mpi_main(main)
