#!/usr/bin/env bash
# Build (or reuse) a distmem virtual environment outside the clone and print its bin/ folder last.
#
#   scripts/env.sh main     TensorFlow 2.15.1 + Horovod 0.28.1 (Gloo + MPI) + mpi4py + torch CPU
#   scripts/env.sh latest   TensorFlow 2.21 (Keras 3), mpi4py, no Horovod
#
# The environment lives in ${DISTMEM_ENV_ROOT:-~/.cache/distmem}/<name>-<key>, where <key> hashes
# the requirement files, this script and the Python version, so a change to any of them builds a
# new environment and an unchanged one is reused in a second. A half-built environment (no
# .complete marker) is removed and rebuilt. Concurrent callers serialise on a lock file.
set -euo pipefail

name=${1:-main}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${DISTMEM_PYTHON:-$(command -v python3.11 || command -v python3)}
root=${DISTMEM_ENV_ROOT:-$HOME/.cache/distmem}

case "$name" in
  main)   reqs=("$here/requirements/main.txt" "$here/requirements/mpi4py.txt" "$here/requirements/horovod.txt") ;;
  latest) reqs=("$here/requirements/tf-latest.txt" "$here/requirements/mpi4py.txt") ;;
  *) echo "env.sh: unknown environment '$name' (use: main | latest)" >&2; exit 2 ;;
esac

log() { echo "[distmem env] $*" >&2; }

ensure_mpi() {
  if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Open MPI from Debian (libopenmpi-dev openmpi-bin)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libopenmpi-dev openmpi-bin >&2
  else
    echo "env.sh: no MPI found (mpicc/mpirun). Install Open MPI first, e.g." \
         "'sudo apt-get install libopenmpi-dev openmpi-bin', then run this again." >&2
    exit 1
  fi
}

ensure_mpi
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$(cat "${reqs[@]}" "$here/scripts/env.sh" <(echo "$pyver") | sha256sum | cut -c1-12)
env="$root/$name-py$pyver-$key"
mkdir -p "$root"

exec 9>"$root/.$name.lock"
flock 9

if [ ! -f "$env/.complete" ]; then
  rm -rf "$env"
  start=$(date +%s)
  log "building $env (first run only; later runs reuse it)"
  "$py" -m venv "$env"
  pip=("$env/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install --upgrade "pip<26" "setuptools<80" wheel >&2
  case "$name" in
    main)
      log "step 1/3: TensorFlow 2.15.1, torch 2.14.1 + torchvision 0.29.1 and tools"
      "${pip[@]}" install -r "$here/requirements/main.txt" >&2
      # torch's wheel brings triton (GPU kernel compiler, unused on CPU); its LLVM crashes the process
      # beside TensorFlow's once both are loaded (seen as a segfault in the test suite), so it goes.
      "${pip[@]}" uninstall -y triton >&2
      log "step 2/3: mpi4py against the system MPI"
      "${pip[@]}" install --no-binary mpi4py -r "$here/requirements/mpi4py.txt" >&2
      log "step 3/3: Horovod 0.28.1 from source with TensorFlow, Gloo and MPI (about 3 minutes)"
      HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
      HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
        "${pip[@]}" install --no-build-isolation --no-cache-dir -r "$here/requirements/horovod.txt" >&2
      "$env/bin/python" -c 'import horovod.tensorflow as hvd; assert hvd.mpi_built() and hvd.gloo_built(), "Horovod built without MPI or Gloo"' >&2
      ;;
    latest)
      log "step 1/2: TensorFlow 2.21 and tools"
      "${pip[@]}" install -r "$here/requirements/tf-latest.txt" >&2
      log "step 2/2: mpi4py against the system MPI"
      "${pip[@]}" install --no-binary mpi4py -r "$here/requirements/mpi4py.txt" >&2
      ;;
  esac
  touch "$env/.complete"
  log "built in $(( $(date +%s) - start )) s"
fi

# The package itself: an editable install pointing at this clone (fast; no dependencies).
"$env/bin/python" -m pip --disable-pip-version-check -q install --no-deps --no-build-isolation -e "$here" >&2 \
  || { echo "env.sh: installing distmem from $here into $env failed" >&2; exit 1; }
echo "$env/bin"
