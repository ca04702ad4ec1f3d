"""Every rank under mpirun: distmem's equal split, enforced, tried for real on the GPU.

    mpirun -np 4 python tests/gpu/progs/equal_split.py --out RESULT.json            # 2 ranks per GPU
    EQ_MEMORY=limit mpirun -np 2 python tests/gpu/progs/equal_split.py --out R.json  # 1 per GPU, hard limit

After distmem.init(framework="torch", memory=$EQ_MEMORY) and one training step (so every context
holds cuBLAS/cuDNN, as in training), the tenants of each GPU:
  A. the first tenant fills its GPU alone until OOM: it must stop at its share, with the rest of the
     GPU still free (the OOM is its own limit, not the device);
  B. the other tenants fill while the first keeps everything: each must still get its full share;
  C. all release, then all fill at once: each must get its full share.
Fill = chunks of 256 MiB, then 128 ... 16 MiB and 1 MiB until OOM. Every figure beside an
independent NVML read. Rank 0 writes RESULT.json for tests/gpu/test_equal_split.py.
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
    rank, size = comm.Get_rank(), comm.Get_size()
    nv = gpuprobe.Nvml()
    import distmem

    plan = distmem.init(framework="torch", memory=os.environ.get("EQ_MEMORY", "auto"))
    mine = plan.mine
    slot = mine.devices[0]
    tenants = sorted(a.rank for a in plan.allocations
                     if a.host == mine.host and a.devices and a.devices[0].index == slot.index)
    pos = tenants.index(rank)
    gpu = gpuprobe.Gpu(slot.index)
    gpu.train_step()
    gpu.release([])
    physical = nv.index_of(gpu.uuid())
    row = {"rank": rank, "pid": os.getpid(), "pos": pos, "tenants": tenants, "index": slot.index,
           "physical": physical, "share": slot.planned_bytes, "enforce": slot.enforce, "k": slot.shared_by,
           "reserved_after_step": gpu.reserved(), "nvml_after_step": nv.where().get(physical),
           "cuda_free_total": gpu.mem_get_info()}
    held = []
    comm.Barrier()
    if pos == 0:
        row["A"] = gpu.fill(held)
        row["A"]["nvml_process"] = nv.where().get(physical)
        row["A"]["nvml_gpu"] = {k: v for k, v in nv.gpu(physical).items() if k != "procs"}
    comm.Barrier()
    if pos > 0:
        row["B"] = gpu.fill(held)
        row["B"]["nvml_process"] = nv.where().get(physical)
    comm.Barrier()
    row["after_AB"] = {"nvml_process": nv.where().get(physical), "reserved": gpu.reserved(),
                       "nvml_gpu": {k: v for k, v in nv.gpu(physical).items() if k != "procs"}}
    row["expandable"] = gpu.expandable()
    comm.Barrier()
    gpu.release(held)
    comm.Barrier()
    row["C"] = gpu.fill(held)
    row["C"]["nvml_process"] = nv.where().get(physical)
    comm.Barrier()
    gpu.release(held)
    rows = comm.gather(row, root=0)
    if rank == 0:
        out = {"np": size, "memory": os.environ.get("EQ_MEMORY", "auto"),
               "expandable_env": os.environ.get("DISTMEM_TORCH_EXPANDABLE_SEGMENTS"), "plan": plan.to_dict(),
               "warnings": list(plan.warnings), "rows": rows,
               "nvml": [{k: v for k, v in g.items() if k != "procs"} for g in nv.gpus()]}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"[rank 0] wrote {args.out}", flush=True)
    comm.Barrier()


if __name__ == "__main__":
    gpuprobe.mpi_main(main)
