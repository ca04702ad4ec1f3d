#!/usr/bin/env bash
# The GPU suite on the machine that is lent, any number of GPUs from one, in one call, from the root:
#     OUT=/path/to/out bash tests/gpu/run_gpu.sh
# Runs every test in tests/gpu (the ranks of a case share the GPUs there are; a case that needs more
# GPUs than the machine has is skipped and says so), within DISTMEM_GPU_BUDGET seconds (default 500;
# 1200 against the fake GPU). Writes under $OUT:
#   gpu_suite.json      the machine's facts (GPU name and count, driver, CUDA, torch, Python), the
#                       tests passed/failed/skipped with each one's outcome and seconds, the wall time
#                       (committed as bench/results/gpu_suite_<gpu>.json)
#   gpu.log             everything below;  gpu-evidence.jsonl  the figures each test judged
#   native_gpu_results.json  the native cap's children (tests/gpu/test_native_cap.py)
# DISTMEM_GPU_EXTRAS=1 also runs the packing benchmark and the torch example when time is left.
# With DISTMEM_FAKE_GPU=1 (PYTHONPATH=tests/gpu/progs/fakegpu) the harness runs on a CPU machine against
# a fake GPU: the tests that need real CUDA (native cap, guard, tenant share) are left out, and the
# summary says it was a fake. Exit 1 when a test failed or a step did not finish.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/runs/gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_DEVICE_ORDER=PCI_BUS_ID
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1
export DISTMEM_REQUIRE_GPU=1 DISTMEM_GPU_EVIDENCE="$OUT/gpu-evidence.jsonl" DISTMEM_GPU_OUT="$OUT"
export DISTMEM_GPU_RESULTS="$OUT/tests.json"
PY=${PYTHON:-python3}
# The fake GPU starts torch and mpirun as often as a GPU run but on a CPU machine: give it longer.
[ "${DISTMEM_FAKE_GPU:-0}" = 1 ] && BUDGET=${DISTMEM_GPU_BUDGET:-1200} || BUDGET=${DISTMEM_GPU_BUDGET:-500}
END=$((SECONDS + BUDGET))
status=0
rm -f "$DISTMEM_GPU_RESULTS"
# step NAME SECONDS CMD...: run CMD with a timeout of SECONDS, cut to what is left of the budget.
step() {
    local name=$1 limit=$2; shift 2
    local left=$((END - SECONDS - 15))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then echo "=== $name: skipped, budget spent"; status=1; return; fi
    echo "=== [$(date +%T)] $name (timeout ${limit}s)"
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "=== [$(date +%T)] $name: exit $rc"
    [ $rc -eq 0 ] || status=1
}

# 1. The machine: NVML (names, totals, driver), torch (version, CUDA, each device's total), Python.
step machine-facts 60 "$PY" - "$OUT/machine.json" <<'PY'
import json, os, platform, sys
import pynvml
pynvml.nvmlInit()
text = lambda v: v.decode() if isinstance(v, bytes) else str(v)
facts = {"python": platform.python_version(), "host": platform.node(), "driver": text(pynvml.nvmlSystemGetDriverVersion()),
         "fake": os.environ.get("DISTMEM_FAKE_GPU") == "1", "gpus": []}
try:
    import torch
    facts.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
except ImportError as exc:
    facts.update(torch=None, cuda=None, cuda_available=False, torch_error=str(exc))
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    row = {"index": i, "name": text(pynvml.nvmlDeviceGetName(h)), "uuid": text(pynvml.nvmlDeviceGetUUID(h)),
           "nvml_total": int(m.total)}
    if facts["cuda_available"] and i < torch.cuda.device_count():
        row["cuda_total"] = int(torch.cuda.get_device_properties(i).total_memory)
    facts["gpus"].append(row)
facts["gpu_count"] = len(facts["gpus"])
facts["gpu_name"] = facts["gpus"][0]["name"] if facts["gpus"] else None
print(json.dumps(facts, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(facts, f, indent=1)
PY
step versions 30 bash -c "nvidia-smi -L || true; mpirun --version | head -2; $PY -m pytest --version || echo 'pytest: not installed (tests/gpu/progs/minitest.py runs the tests)'"

# 2. The native cap, for distmem-exec's and the cap's tests (CMake, or the compiler directly).
step build-native 120 bash scripts/build_native.sh

# 3. The suite. Each multi-rank case launches mpirun itself, with a hard timeout per launch.
if [ "${DISTMEM_FAKE_GPU:-0}" = 1 ]; then
    TESTS="tests/gpu/test_pinning.py tests/gpu/test_equal_split.py tests/gpu/test_overhead.py tests/gpu/test_report_nvml.py tests/gpu/test_exec_gpu.py tests/gpu/test_fake_gpu.py"
else
    TESTS=$(ls tests/gpu/test_*.py)
fi
if $PY -c "import pytest" 2>/dev/null; then
    step gpu-tests $((END - SECONDS - 60)) $PY -m pytest $TESTS -v -ra -p no:cacheprovider -o addopts=
else
    step gpu-tests $((END - SECONDS - 60)) $PY tests/gpu/progs/minitest.py $TESTS
fi

# 4. The summary: the machine's facts beside every test's outcome (always written, even past the budget).
echo "=== [$(date +%T)] summary"
timeout 30 "$PY" - "$OUT" "$SECONDS" "$BUDGET" "$TESTS" <<'PY'
import json, os, sys, time
out, wall, budget, tests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        return {"error": f"{name}: {exc}"}
res = load("tests.json")
suite = {"what": "tests/gpu on the lent machine", "command": "OUT=$OUT bash tests/gpu/run_gpu.sh",
         "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": load("machine.json"), "files": tests,
         "passed": res.get("passed", 0), "failed": res.get("failed", 0), "skipped": res.get("skipped", 0),
         "runner": res.get("runner"), "complete": res.get("complete", False), "wall_s": wall, "budget_s": budget,
         "tests": res.get("tests", []),
         **({"error": res["error"]} if "error" in res else {})}
with open(os.path.join(out, "gpu_suite.json"), "w") as f:
    json.dump(suite, f, indent=1)
m = suite["machine"]
print(f"gpu_suite.json: {suite['passed']} passed, {suite['failed']} failed, {suite['skipped']} skipped on "
      f"{m.get('gpu_count')} x {m.get('gpu_name')} (driver {m.get('driver')}, CUDA {m.get('cuda')}, torch {m.get('torch')}"
      f"{', FAKE GPU' if m.get('fake') else ''}) in {wall} s")
if not suite["complete"]:
    print("gpu_suite.json: the test run did not finish (its time limit, or it crashed): the counts are what finished")
sys.exit(0 if suite["failed"] == 0 and suite["passed"] and suite["complete"] else 1)
PY
[ $? -eq 0 ] || status=1

# 5. Optional: the packing benchmark and the example, when asked for and time is left.
if [ "${DISTMEM_GPU_EXTRAS:-0}" = 1 ]; then
    BENCH=$((END - SECONDS - 90)); [ "$BENCH" -gt 150 ] && BENCH=150
    PACKING=bench/plan/packing.py
    step packing $((BENCH + 25)) $PY "$PACKING" --out "$OUT/packing.json" --budget "$BENCH"
    step example-mpi 60 mpirun --oversubscribe --bind-to none -x PYTHONPATH -np 2 $PY examples/torch_train.py --steps 20 --comm mpi
fi

echo "=== done in $SECONDS s: status $status; files in $OUT:"; ls -la "$OUT"
exit $status
