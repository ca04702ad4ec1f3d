#!/usr/bin/env bash
# Everything GPU-side of the native hard cap, as one command, from the repository root:
#
#   OUT=/some/dir bash tests/gpu/run_native_gpu.sh
#
# 1. builds libdistmem_cap.so (scripts/build_native.sh: CMake, or the compiler directly without it)
# 2. runs the CPU suite tests/native against this machine's C library (fake driver; ~10 s)
# 3. runs tests/gpu/test_native_cap.py with DISTMEM_REQUIRE_GPU=1 (torch default + expandable
#    segments, CuPy default + async pool, JAX, two capped processes on one GPU; ~3-4 min)
# 4. runs bench/native/cap_overhead.py (driver loop, and torch without caching; ~1-2 min)
# Results in $OUT (default ./native-gpu-out): env.txt, build.log, cpu_tests.log, gpu_tests.log,
# native_gpu_results.json (every child's figures, NVML per process), cap_overhead.json.
# Exit status: 0 when every step passed; each step has its own timeout, so the whole stays < 10 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$PWD/native-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export DISTMEM_REQUIRE_GPU=${DISTMEM_REQUIRE_GPU:-1}
export DISTMEM_GPU_OUT=$out
py=${PYTHON:-python3}
failed=()
step() { echo; echo "=== $* ($(date +%T))"; }

step "environment"
{
  uname -a; ldd --version 2>&1 | head -1; command -v cmake && cmake --version | head -1; cc --version 2>&1 | head -1
  nvidia-smi -L 2>&1; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1
  "$py" - <<'PY'
import importlib, sys
print("python", sys.version.split()[0])
for m in ("torch", "cupy", "jax", "pynvml", "pytest"):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(m, "missing:", type(exc).__name__, str(exc)[:120])
PY
} 2>&1 | tee "$out/env.txt"

step "build"
if ! bash scripts/build_native.sh >"$out/build.log" 2>&1; then
  cat "$out/build.log"
  if [ -f distmem/_native/libdistmem_cap.so ]; then
    # e.g. no compiler here: a copy built elsewhere and carried along (needs glibc >= 2.34)
    echo "run_native_gpu.sh: the build failed; using the existing distmem/_native/libdistmem_cap.so" \
      | tee -a "$out/build.log"
    failed+=("build")
  else
    echo "run_native_gpu.sh: the build failed and no library exists; nothing else can run"; exit 1
  fi
fi
tail -n 2 "$out/build.log"

have_pytest=0
"$py" -c "import pytest" 2>/dev/null && have_pytest=1

step "CPU tests against the fake driver (tests/native)"
if [ $have_pytest = 1 ]; then
  timeout 240 "$py" -m pytest -p no:cacheprovider -q -ra tests/native 2>&1 | tee "$out/cpu_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("cpu-tests")
else
  echo "pytest is not installed: tests/native skipped" | tee "$out/cpu_tests.log"
fi

step "GPU tests (tests/gpu/test_native_cap.py)"
# --noconftest: this file decides about GPUs itself (pynvml, then nvidia-smi, then torch), so a
# missing pynvml cannot turn the whole run into skips.
if [ $have_pytest = 1 ]; then
  timeout 480 "$py" -m pytest --noconftest -p no:cacheprovider -q -ra -s tests/gpu/test_native_cap.py 2>&1 \
    | tee "$out/gpu_tests.log"
else
  timeout 480 "$py" tests/gpu/test_native_cap.py 2>&1 | tee "$out/gpu_tests.log"
fi
[ "${PIPESTATUS[0]}" = 0 ] || failed+=("gpu-tests")

step "overhead benchmark (bench/native/cap_overhead.py)"
timeout 240 "$py" bench/native/cap_overhead.py --backend auto --out "$out" 2>&1 | tee "$out/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || failed+=("bench")
rm -f "$out/bench.log"  # the JSON line is in cap_overhead.json

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "run_native_gpu.sh: all steps passed; results in $out"
else
  echo "run_native_gpu.sh: FAILED: ${failed[*]}; results and logs in $out"
  exit 1
fi
