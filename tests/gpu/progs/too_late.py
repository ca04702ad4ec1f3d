"""One process, no launcher (its plan: GPU 0): start CUDA on GPU FIRST with a tensor - and, given
HOLD and LIMIT, have torch hold HOLD of that GPU (a fraction of NVML's total) - then call
distmem.init(framework="torch"[, limit=LIMIT]). Prints one JSON line: the error (if any) and where NVML
sees this process afterwards.

    python tests/gpu/progs/too_late.py FIRST [HOLD LIMIT]
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpuprobe  # noqa: E402

gpuprobe.setup()


def main():
    first = int(sys.argv[1])
    hold, limit = (float(sys.argv[2]), sys.argv[3]) if len(sys.argv) > 3 else (0.0, None)
    nv = gpuprobe.Nvml()
    gpu = gpuprobe.Gpu(first)
    gpu.touch()
    held = [gpu.alloc(int(hold * nv.gpu(nv.index_of(gpu.uuid()))["total"]))] if hold else []
    import distmem

    result = {"first": first, "hold": hold, "limit": limit, "pid": os.getpid(), "error": None, "error_type": None}
    try:
        plan = distmem.init(framework="torch", **({"limit": limit} if limit else {}))
        result["planned"] = plan.mine.device
        gpuprobe.Gpu(plan.mine.device).touch()
    except distmem.DistmemError as exc:
        result.update(error=str(exc), error_type=type(exc).__name__)
    result["where"] = nv.where()
    print("TOO_LATE " + json.dumps(result), flush=True)
    gpu.release(held)


if __name__ == "__main__":
    main()
