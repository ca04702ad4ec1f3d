#!/usr/bin/env bash
# Build (or reuse) a distmem virtual environment outside the clone and print its bin/ folder last.
#
#   scripts/env.sh main     TensorFlow 2.15.1 + Horovod 0.28.1 (Gloo + MPI) + mpi4py + torch CPU
#   scripts/env.sh latest   TensorFlow 2.21 (Keras 3), mpi4py, no Horovod
#
# Two layers, so that one clone's run never changes another clone's code:
#
# * the packages: ${DISTMEM_ENV_ROOT:-~/.cache/distmem}/<name>-py<version>-<key>, where <key> hashes
#   the requirement files, the build recipe below (between its markers) and the Python version, so a
#   change to any of them builds a new environment and an unchanged one is reused in a second. It
#   is shared by every clone and holds no distmem: nothing a clone does writes into it after the
#   build. A half-built one (no .complete marker) is removed and rebuilt; builders serialise on a lock.
# * this clone's view of it: <root>/clones/<name>-py<version>-<key>-<clone key>, keyed by this
#   clone's real path too: a venv of no packages of its own whose site-packages holds one link,
#   distmem -> <this clone>/distmem, and a .pth that adds the shared packages after it; its bin/
#   runs the shared environment's tools (horovodrun, torchrun, pytest...) under its own python,
#   and has distmem and distmem-exec. Its bin/ folder is what this script prints.
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
recipe=$(sed -n '/^# >>> build recipe/,/^# <<< build recipe/p' "$here/scripts/env.sh")
key=$(cat "${reqs[@]}" <(echo "$recipe") <(echo "$pyver") | sha256sum | cut -c1-12)
env="$root/$name-py$pyver-$key"
mkdir -p "$root"

exec 9>"$root/.$name.lock"
flock 9

# >>> build recipe (hashed into the environment's key: a change here builds a new environment)
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
# <<< build recipe

# This clone's view: built in about a second, checked on every call (a moved or replaced clone, or a
# view someone changed, is built again). Nothing of this clone is ever written into "$env".
clone=$(cd "$here" && pwd -P)
ckey=$(printf '%s' "$clone" | sha256sum | cut -c1-12)
view="$root/clones/$name-py$pyver-$key-$ckey"
site="$view/lib/python$pyver/site-packages"
if [ ! -f "$view/.complete" ] || [ "$(readlink "$site/distmem" 2>/dev/null)" != "$clone/distmem" ]; then
  rm -rf "$view"
  mkdir -p "$root/clones"
  "$env/bin/python" -m venv --without-pip "$view" >&2
  env_real=$(cd "$env" && pwd -P)
  ln -s "$clone/distmem" "$site/distmem"
  # After this venv's own site-packages (distmem): the shared packages, their own .pth files included.
  echo "import site; site.addsitedir('$env/lib/python$pyver/site-packages')" > "$site/zz-distmem-shared-env.pth"
  for tool in "$env/bin/"*; do
    tname=$(basename "$tool")
    case "$tname" in python*|activate*|Activate*|pip*|distmem|distmem-exec) continue ;; esac
    [ -f "$tool" ] && [ -x "$tool" ] || continue
    first=$(head -n 1 "$tool")
    if [ "${first#\#!"$env"/bin/python}" != "$first" ] || [ "${first#\#!"$env_real"/bin/python}" != "$first" ]; then
      # A console script of the shared environment, run by this view's python (so it sees this clone).
      printf '#!/bin/sh\nexec "%s" "%s" "$@"\n' "$view/bin/python" "$tool" > "$view/bin/$tname"
      chmod +x "$view/bin/$tname"
    else
      ln -s "$tool" "$view/bin/$tname"
    fi
  done
  for entry in distmem=distmem.cli distmem-exec=distmem.cli.exec; do
    printf '#!%s\nimport sys\nfrom %s import main\nsys.exit(main())\n' "$view/bin/python" "${entry#*=}" \
      > "$view/bin/${entry%%=*}"
    chmod +x "$view/bin/${entry%%=*}"
  done
  "$view/bin/python" -c 'import distmem, os, sys; assert os.path.realpath(distmem.__file__).startswith(sys.argv[1])' \
    "$clone/distmem/" >&2 || { echo "env.sh: the view $view does not import distmem from $clone" >&2; exit 1; }
  touch "$view/.complete"
fi
echo "$view/bin"
