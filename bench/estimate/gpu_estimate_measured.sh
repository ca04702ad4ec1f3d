#!/usr/bin/env bash
# On the GPU machine, in one call: the true peaks of the zoo's torch cases that have none yet (its
# hand-written, checkpointed, LoRA, frozen and compiled models: bench/estimate/estimate_zoo.py, reusing the
# committed measurements of the others), the measured path on every torch case
# (bench/estimate/estimate_measured_path.py), and what each cuDNN convolution of three conv nets allocates
# beyond its outputs (bench/estimate/estimate_zoo_probe.py --ops). Everything lands under $OUT as it goes.
#
#   OUT=/tmp/out bash bench/estimate/gpu_estimate_measured.sh
set -u -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DISTMEM_MEASURE_CACHE=off
OUT=${OUT:?set OUT to a folder for the results}
NEW=custom_unet,custom_transformer,ckpt_reentrant,ckpt_nonreentrant,ckpt_selective,hf_gpt2_ckpt,hf_llama_ckpt
NEW=$NEW,hf_llama_lora,hf_bert_frozen,resnet50_frozen,resnet50,resnet18_compiled,custom_transformer_compiled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout "${ZOO_S:-220}" python3 bench/estimate/estimate_zoo.py --framework torch --models "$NEW" --no-peer --jobs 4 \
    --reuse bench/results/estimate_accuracy_torch_zoo.json --out "$OUT/zoo_torch_new.json" 2> "$OUT/zoo_torch_new.log"
echo "zoo rc $?"
timeout "${MEASURED_S:-250}" python3 bench/estimate/estimate_measured_path.py --framework torch --jobs 8 \
    --out "$OUT/measured_torch.jsonl" 2> "$OUT/measured_torch.log"
echo "measured rc $?"
mkdir -p "$OUT/probe"
timeout "${PROBE_S:-60}" python3 bench/estimate/estimate_zoo_probe.py --ops "$OUT/probe" resnet50@224/b32/adam/bf16 \
    resnet50@224/b32/adam/float32 resnext50_32x4d@224/b16/adamw/float32 > "$OUT/probe.log" 2>&1
echo "probe rc $?"
tar czf "$OUT/probe.tgz" -C "$OUT" probe && rm -rf "$OUT/probe"
ls -la "$OUT"
