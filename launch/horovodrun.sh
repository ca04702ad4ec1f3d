#!/usr/bin/env bash
# horovodrun with a hard timeout and a local host list by default.
#
#   launch/horovodrun.sh -np 4 python examples/train.py           # -H localhost:4 added
#   launch/horovodrun.sh -np 8 -H node1:4,node2:4 --mpi python examples/train.py
#
# Adds -H localhost:NP when no -H/--hosts/--hostfile/--host-discovery-script is given, a start-up
# timeout (--start-timeout, HOROVOD_START_TIMEOUT, default 120 s), and `timeout` around the whole job:
# after DISTMEM_LAUNCH_TIMEOUT seconds (default 3600) horovodrun gets SIGTERM, 30 s later SIGKILL;
# exit 124. horovodrun forwards the environment to every rank and stops the job when one rank fails.
# DISTMEM_DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
timeout_s=${DISTMEM_LAUNCH_TIMEOUT:-3600}
hvd_bin=${HOROVODRUN:-horovodrun}
if [[ $# -eq 0 ]]; then
  sed -n '2,11p' "$0"; exit 2
fi
np="" hosts=0 start=0 prev=""
for arg in "$@"; do
  case "$prev" in -np|--num-proc) np=$arg ;; esac
  case "$arg" in
    -H|--hosts|--hostfile|--host-discovery-script|-H=*|--hosts=*|--hostfile=*) hosts=1 ;;
    --start-timeout|--start-timeout=*) start=1 ;;
    -np=*|--num-proc=*) np=${arg#*=} ;;
  esac
  prev=$arg
done
extra=()
if [[ $hosts == 0 ]]; then
  [[ -n $np ]] || { echo "horovodrun.sh: give -np N (or -H hosts)" >&2; exit 2; }
  extra+=(-H "localhost:$np")
fi
[[ $start == 1 ]] || extra+=(--start-timeout "${HOROVOD_START_TIMEOUT:-120}")
cmd=(timeout --kill-after=30 "$timeout_s" "$hvd_bin" "${extra[@]}" "$@")
if [[ ${DISTMEM_DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo; exit 0
fi
exec "${cmd[@]}"
