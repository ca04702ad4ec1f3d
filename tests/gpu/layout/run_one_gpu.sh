#!/usr/bin/env bash
# On one GPU (the lent H200): the layout cases that one GPU allows, on the new code, then the GPU suite.
#     OUT=/path bash tests/gpu/layout/run_one_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-$PWD/runs/gpu1}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/one_gpu.log") 2>&1
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1
M="mpirun --oversubscribe --bind-to none -x PYTHONPATH"
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
echo "GPU $UUID"
timeout 90 $M -np 2 python tests/gpu/layout/probe.py every-rank-sees-gpu0
timeout 90 $M -np 2 -x CUDA_VISIBLE_DEVICES=0 python tests/gpu/layout/probe.py cvd-index-same-gpu
timeout 90 $M -np 2 -x CUDA_VISIBLE_DEVICES=$UUID python tests/gpu/layout/probe.py cvd-uuid-same-gpu
timeout 90 $M -np 1 -x CUDA_VISIBLE_DEVICES=$UUID python tests/gpu/layout/probe.py cvd-uuid-alone
grep '^LAYOUT ' "$OUT/one_gpu.log" | sed 's/^LAYOUT //' > "$OUT/layout_one_gpu.jsonl"
DISTMEM_REQUIRE_GPU=1 timeout 240 python -m pytest tests/gpu/test_pinning.py tests/gpu/test_equal_split.py tests/gpu/test_overhead.py tests/gpu/test_report_nvml.py -v -ra -p no:cacheprovider -o addopts= 2>&1 | tail -40
