#!/bin/sh
# One GPU per task, as a site wrapper does it: each task sees only GPU number SLURM_LOCALID.
CUDA_VISIBLE_DEVICES=${SLURM_LOCALID:?one_gpu_per_task.sh runs under srun}
export CUDA_VISIBLE_DEVICES
exec "$@"
