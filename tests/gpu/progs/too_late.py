"""One process posing as torchrun's rank 1 of 2 (so its plan is GPU 1): start CUDA on GPU FIRST with
a tensor, then call distmem.init(framework="torch"). Prints one JSON line: the error (if any) and where
NVML sees this process afterwards.

    python tests/gpu/progs/too_late.py FIRST
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.update({"TORCHELASTIC_RUN_ID": "distmem-too-late", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "2"})

import gpuprobe  # noqa: E402

gpuprobe.setup()


def main():
    first = int(sys.argv[1])
    nv = gpuprobe.Nvml()
    gpuprobe.Gpu(first).touch()
    import distmem

    result = {"first": first, "pid": os.getpid(), "error": None, "error_type": None}
    try:
        plan = distmem.init(framework="torch")
        result["planned"] = plan.mine.device
        gpuprobe.Gpu(plan.mine.device).touch()
    except distmem.DistmemError as exc:
        result.update(error=str(exc), error_type=type(exc).__name__)
    result["where"] = nv.where()
    print("TOO_LATE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
