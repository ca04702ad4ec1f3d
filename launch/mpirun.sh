#!/usr/bin/env bash
# mpirun with distmem's defaults and a hard timeout.
#
#   launch/mpirun.sh -np 4 python examples/train.py
#   DISTMEM_LAUNCH_TIMEOUT=600 launch/mpirun.sh -np 8 -H node1:4,node2:4 python examples/train.py
#
# Adds: --oversubscribe --bind-to none (ranks pinned to GPUs by distmem, not to cores by MPI),
# -x for every DISTMEM_*, TF_CPP_*, TF_FORCE_*, TF_GPU_*, NCCL_*, HOROVOD_* variable and CUDA_VISIBLE_DEVICES / PYTHONPATH set
# here (remote ranks do not inherit them otherwise), and `timeout` around the whole job: after
# DISTMEM_LAUNCH_TIMEOUT seconds (default 3600) mpirun gets SIGTERM, 30 s later SIGKILL; exit 124.
# Open MPI already ends the job when any rank exits non-zero. DISTMEM_DRY_RUN=1 prints the command.
set -euo pipefail
timeout_s=${DISTMEM_LAUNCH_TIMEOUT:-3600}
mpirun_bin=${MPIRUN:-mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
if [[ $# -eq 0 ]]; then
  sed -n '2,13p' "$0"; exit 2
fi
forward=()
while IFS= read -r name; do
  forward+=(-x "$name")
done < <(compgen -e | grep -E '^(DISTMEM_[A-Z0-9_]*|TF_CPP_[A-Z_]*|TF_FORCE_[A-Z_]*|TF_GPU_[A-Z_]*|NCCL_[A-Z0-9_]*|HOROVOD_[A-Z0-9_]*|CUDA_VISIBLE_DEVICES|PYTHONPATH)$' | sort)
cmd=(timeout --kill-after=30 "$timeout_s" "$mpirun_bin" --oversubscribe --bind-to none "${forward[@]}" "$@")
if [[ ${DISTMEM_DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo; exit 0
fi
exec "${cmd[@]}"
