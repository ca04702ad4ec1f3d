#!/usr/bin/env bash
# Build the native hard cap (native/ -> libdistmem_cap.so) and install it where distmem finds it:
# distmem/_native/libdistmem_cap.so. Prints the installed path last.
#
#   scripts/build_native.sh                  Release build in build/native
#   BUILD_DIR=/tmp/b scripts/build_native.sh another build directory
#   CMAKE_BUILD_TYPE=Debug scripts/build_native.sh
#   DEST_DIR=/tmp/pkg/distmem/_native scripts/build_native.sh   install elsewhere (setup.py's wheel build)
#
# Needs a C compiler; uses CMake (>= 3.16) when present and falls back to a direct compiler call
# (same sources and flags) when it is not, so the GPU machine builds it either way. No CUDA toolkit.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
src="$here/native"
build=${BUILD_DIR:-$here/build/native}
dest=${DEST_DIR:-$here/distmem/_native}
type=${CMAKE_BUILD_TYPE:-Release}
log() { echo "[build_native] $*" >&2; }

mkdir -p "$build" "$dest"
if command -v cmake >/dev/null 2>&1; then
  log "cmake -S native -B $build ($type)"
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE="$type" >"$build/configure.log" 2>&1 \
    || { cat "$build/configure.log" >&2; echo "build_native.sh: cmake configure failed (log above)" >&2; exit 1; }
  cmake --build "$build" --parallel >"$build/build.log" 2>&1 \
    || { cat "$build/build.log" >&2; echo "build_native.sh: cmake build failed (log above)" >&2; exit 1; }
  lib="$build/libdistmem_cap.so"
else
  cc=${CC:-$(command -v cc || command -v gcc || true)}
  [ -n "$cc" ] || { echo "build_native.sh: neither cmake nor a C compiler (cc/gcc) found; install one" >&2; exit 1; }
  log "cmake not found; building with $cc directly"
  srcs=("$src/src/account.c" "$src/src/config.c" "$src/src/hook.c" "$src/src/shared.c" "$src/src/table.c" "$src/src/wrappers.c")
  case "$(uname -m)" in x86_64|amd64) srcs+=("$src/src/dlsym_x86_64.S") ;; esac
  lib="$build/libdistmem_cap.so"
  "$cc" -shared -fPIC -O2 -std=gnu11 -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter \
    -fno-strict-aliasing -foptimize-sibling-calls -I"$src/include" -I"$src/src" \
    -o "$lib" "${srcs[@]}" -Wl,-z,defs -Wl,--exclude-libs,ALL -ldl -lpthread
fi

[ -f "$lib" ] || { echo "build_native.sh: $lib was not produced" >&2; exit 1; }
# Install by rename so a process that has the old copy mapped keeps a consistent file.
cp "$lib" "$dest/.libdistmem_cap.so.tmp"
mv -f "$dest/.libdistmem_cap.so.tmp" "$dest/libdistmem_cap.so"
log "installed $dest/libdistmem_cap.so"
echo "$dest/libdistmem_cap.so"
