#!/usr/bin/env bash
# Issue #6 on the GPU machine (2 GPUs), from anywhere in the tree:
#     OUT=/path/to/out bash tests/gpu/run_gpu.sh
# Writes under $OUT: gpu.log (everything below), gpu-evidence.jsonl (the figures each GPU test judged),
# packing.json (bench/plan/packing.py). Three files, at most two levels deep.
# Steps in order of importance, each with its own timeout, all inside DISTMEM_GPU_BUDGET seconds
# (default 540; expected ~5 min): machine facts; the GPU tests (pinning, equal split, overhead, report
# vs NVML; they launch mpirun -np 2 / -np 4 themselves) with pytest, or tests/gpu/progs/minitest.py
# where pytest is missing; the packing benchmark; the example on the GPUs. Every step runs; exit 1
# when any failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/runs/gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
set -x
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_DEVICE_ORDER=PCI_BUS_ID
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1
export DISTMEM_REQUIRE_GPU=1 DISTMEM_GPU_EVIDENCE="$OUT/gpu-evidence.jsonl"
PY=${PYTHON:-python3}
MPIRUN="mpirun --oversubscribe --bind-to none -x PYTHONPATH -x NCCL_NVLS_ENABLE -x CUDA_DEVICE_ORDER"
END=$((SECONDS + ${DISTMEM_GPU_BUDGET:-540}))
status=0
# step NAME SECONDS CMD...: run CMD with a timeout of SECONDS, cut to what is left of the budget.
step() {
    local name=$1 limit=$2; shift 2
    local left=$((END - SECONDS - 5))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then echo "=== $name: skipped, budget spent"; status=1; return; fi
    echo "=== [$(date +%T)] $name (timeout ${limit}s)"
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "=== [$(date +%T)] $name: exit $rc"
    [ $rc -eq 0 ] || status=1
}

# 1. What the machine is: driver, NVML totals and reserve, CUDA's totals (in a throwaway process).
step nvidia-smi 20 nvidia-smi
step nvidia-smi-memory 20 nvidia-smi -q -d MEMORY
step versions 30 bash -c "mpirun --version | head -2; $PY -c 'import sys; print(sys.version)'; $PY -m pytest --version || echo 'pytest: not installed (tests/gpu/progs/minitest.py runs the tests)'"
step machine-facts 60 $PY - <<'PY'
import json, os
import torch, pynvml
pynvml.nvmlInit()
facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
         "driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": []}
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    try:
        m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        v2 = {"total": m2.total, "reserved": m2.reserved, "used": m2.used, "free": m2.free}
    except Exception as exc:
        v2 = {"error": str(exc)}
    free, total = torch.cuda.mem_get_info(i)
    facts["gpus"].append({"cuda": i, "name": p.name, "uuid": str(p.uuid), "nvml_uuid": str(pynvml.nvmlDeviceGetUUID(h)),
                          "props_total": p.total_memory, "cuda_total": total, "cuda_free": free,
                          "nvml_v1": {"total": m1.total, "used": m1.used, "free": m1.free}, "nvml_v2": v2,
                          "nvml_total_minus_cuda_total_mib": (m1.total - total) / 2**20})
print(json.dumps(facts, indent=1, default=str))
with open(os.environ["DISTMEM_GPU_EVIDENCE"], "a") as f:
    f.write(json.dumps({"name": "machine-facts", **facts}, default=str) + "\n")
PY

# 2. The GPU tests. They launch mpirun -np 2 / -np 4 themselves, each launch with a hard timeout.
TESTS="tests/gpu/test_pinning.py tests/gpu/test_equal_split.py tests/gpu/test_overhead.py tests/gpu/test_report_nvml.py"
if $PY -c "import pytest" 2>/dev/null; then
    step gpu-tests 240 $PY -m pytest $TESTS -v -ra -p no:cacheprovider -o addopts=
else
    step gpu-tests 240 $PY tests/gpu/progs/minitest.py $TESTS
fi

# 3. Packing benchmark: distmem vs naive 0.9/k vs no limits, k = 1, 2, 4 ranks per GPU.
BENCH=$((END - SECONDS - 90)); [ "$BENCH" -gt 150 ] && BENCH=150
step packing $((BENCH + 25)) $PY bench/plan/packing.py --out "$OUT/packing.json" --budget "$BENCH"

# 4. The example on the GPUs: two ranks per GPU averaging with mpi4py, one per GPU with DDP/NCCL (tables in the log).
step example-np4-mpi 60 $MPIRUN -np 4 $PY examples/torch_train.py --steps 20 --comm mpi
step example-np2-ddp 60 $MPIRUN -np 2 $PY examples/torch_train.py --steps 20 --comm ddp

set +x
echo "=== done in $SECONDS s: status $status; files in $OUT:"; ls -la "$OUT"
exit $status
