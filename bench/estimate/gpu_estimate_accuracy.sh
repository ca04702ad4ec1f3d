#!/usr/bin/env bash
# The PyTorch half of the estimator's accuracy benchmark, on a CUDA machine (torch + torchvision,
# no TensorFlow, no network: torchvision models are built with weights=None).
#
#   bash bench/estimate/gpu_estimate_accuracy.sh [OUT_FILE]      # default: $OUT or bench/results, estimate_accuracy_torch.json
#   MODELS=resnet50,gpt_decoder bash bench/estimate/gpu_estimate_accuracy.sh   # a subset (the full zoo takes ~5 minutes)
#
# Each model is measured in a fresh process (torch.cuda.max_memory_allocated over four Adam steps);
# the estimate runs on the meta device in this process. One JSON line goes to stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-${OUT:-$here/bench/results}/estimate_accuracy_torch.json}
cd "$here"
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} exec "${PYTHON:-python}" bench/estimate/estimate_accuracy.py --framework torch --device cuda \
  ${MODELS:+--models "$MODELS"} --out "$out"
