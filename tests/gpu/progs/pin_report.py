"""Every rank under mpirun: distmem.init(framework="torch"), a training step, a distinct hold, then
distmem.report(); beside each figure an independent read (pynvml directly, torch's own stats).

    mpirun -np N python tests/gpu/progs/pin_report.py --out RESULT.json

Rank 0 writes RESULT.json: the plan, one row per rank (where NVML sees its pid before distmem and
after the step, the physical GPU torch's ordinal is, what it read right after report()), the
report, and NVML's view of every GPU. tests/gpu/test_pinning.py, test_report_nvml.py and
test_overhead.py judge it.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpuprobe  # noqa: E402

gpuprobe.setup()


def main(comm):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, size = comm.Get_rank(), comm.Get_size()
    nv = gpuprobe.Nvml()
    before = nv.where()  # MPI is up; neither torch nor distmem has touched CUDA yet
    comm.Barrier()

    import distmem

    t0 = time.monotonic()
    plan = distmem.init(framework="torch")
    init_s = time.monotonic() - t0
    slot = plan.mine.devices[0]
    gpu = gpuprobe.Gpu(slot.index)
    gpu.train_step()
    held = [gpu.alloc((rank + 1) * 256 * gpuprobe.MiB)]  # a different size per rank: rows cannot be swapped
    gpu.sync()
    physical = nv.index_of(gpu.uuid())
    comm.Barrier()  # every rank holds its memory before anyone looks
    where = nv.where()
    comm.Barrier()
    rep = distmem.report(timeout=60, print_table=rank == 0)
    # Independent reads right after report()'s own; nothing is allocated in between.
    after = nv.where()
    torch_now = {"allocated": gpu.allocated(), "peak": gpu.peak(), "reserved": gpu.reserved()}
    pids_on_gpu = sorted(nv.procs(physical)) if physical is not None else []
    comm.Barrier()
    row = {"rank": rank, "pid": os.getpid(), "local_rank": plan.mine.local_rank, "planned_index": slot.index,
           "planned_nvml_index": slot.nvml_index, "physical_nvml_index": physical, "before": before,
           "where": where, "after_report": after, "torch": torch_now, "pids_on_gpu": pids_on_gpu,
           "init_s": round(init_s, 3), "held": len(held),
           "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "device_order": os.environ.get("CUDA_DEVICE_ORDER")}
    rows = comm.gather(row, root=0)
    if rank == 0:
        out = {"np": size, "plan": plan.to_dict(), "rows": rows, "report": rep.to_dict() if rep else None,
               "nvml": nv.gpus(), "driver": nv.driver(), "warnings": list(plan.warnings)}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"[rank 0] wrote {args.out}", flush=True)
    comm.Barrier()
    gpu.release(held)


if __name__ == "__main__":
    gpuprobe.mpi_main(main)
