#!/usr/bin/env bash
# Fault counts and report latency for the transports the GPU node has (mpirun + mpi4py, torchrun +
# Gloo; the node has no TensorFlow or Horovod): bench/comm/faults.py in CHAINS parallel slices of the
# same seeded injections (--offset), one --log per slice, then one retally per launcher; and
# bench/report/report_overhead.py's latency figures at 2..64 ranks under mpirun (16 cores: up to 16 ranks
# without oversubscription).
#   bash bench/comm/gpu_node_faults.sh faults    # OUT=dir CHAINS=10 PER=10 MINUTES=7
#   bash bench/comm/gpu_node_faults.sh latency   # OUT=dir SIZES=2,4,16,32,64
set -u
OUT=${OUT:-/tmp/distmem-gpu-node}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python}
case "${1:-faults}" in
faults)
  CHAINS=${CHAINS:-10}; PER=${PER:-10}; MINUTES=${MINUTES:-7}
  for L in ${LAUNCHERS:-mpirun torchrun}; do
    for k in $(seq 0 $((CHAINS - 1))); do
      bare=0; [ "$k" = 0 ] && bare=2
      $PY bench/comm/faults.py --launcher "$L" --injections "$PER" --offset $((k * PER)) --bare $bare \
        --minutes "$MINUTES" --log "$OUT/faults-$L-$k.jsonl" >"$OUT/chain-$L-$k.out" 2>&1 &
    done
  done
  wait
  for L in ${LAUNCHERS:-mpirun torchrun}; do
    $PY bench/comm/faults.py --retally "$OUT"/faults-"$L"-*.jsonl --out "$OUT/faults_gpu_node.json" | cut -c1-400
  done
  cat "$OUT"/faults-*.jsonl >"$OUT/faults_gpu_node.log"
  tar -C "$OUT" -czf "$OUT/faults_gpu_node.tgz" faults_gpu_node.json faults_gpu_node.log
  ;;
latency)
  $PY bench/report/report_overhead.py --only latency --launchers mpirun --sizes "${SIZES:-2,4,16,32,64}" \
    --out "$OUT/report_overhead_gpu_node.json"
  ;;
esac
