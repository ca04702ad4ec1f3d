#!/usr/bin/env bash
# Second GPU call: the measured path again on the fp16 cases (GradScaler skips the first steps'
# updates; a measurement now counts only steps that updated) and the compiled pairs, and the true
# peak of the compiled resnet18's eager twin.   OUT=/tmp/out bash bench/estimate/gpu_estimate_measured2.sh
set -u -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DISTMEM_MEASURE_CACHE=off
OUT=${OUT:?set OUT to a folder for the results}
timeout 150 python3 bench/estimate/estimate_zoo.py --framework torch --models resnet18 --no-peer --jobs 2 \
    --reuse bench/results/estimate_accuracy_torch_written_h200.json --out "$OUT/zoo_torch_resnet18.json" 2> "$OUT/zoo_torch_resnet18.log"
echo "zoo rc $?"
timeout 200 python3 bench/estimate/estimate_measured_path.py --framework torch --jobs 8 \
    --models mobilenet_v3_small,shufflenet_v2_x1_0,hf_roberta_cls,hf_bart,resnet18,resnet18_compiled,custom_transformer_compiled,custom_transformer \
    --out "$OUT/measured_torch2.jsonl" 2> "$OUT/measured_torch2.log"
echo "measured rc $?"
ls -la "$OUT"
