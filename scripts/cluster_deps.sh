#!/usr/bin/env bash
# Install what the simulated multi-host cluster (tests/cluster/) needs, from Debian's packages:
# sshd and ssh (mpirun/horovodrun reach the other hosts through them), SLURM 22.05 with munge
# (slurmctld + one slurmd per host), iproute2 (ip netns, veth), util-linux (unshare, nsenter).
#
# Idempotent and fast when everything is present (one `command -v` per tool, no apt call).
# Only acts as root on a Debian-like system; elsewhere it says what is missing and exits 0, so
# the cluster tests then skip with that reason (DISTMEM_REQUIRE_CLUSTER=1 makes them fail).
# The packages' maintainer scripts would start sshd/munge/slurm as system services; a temporary
# policy-rc.d stops that, because the harness starts its own daemons inside its namespaces.
set -euo pipefail

log() { echo "[cluster deps] $*" >&2; }

# tool -> Debian package providing it
declare -A need=(
  [sshd]=openssh-server
  [ssh]=openssh-client
  [ssh-keygen]=openssh-client
  [slurmctld]=slurmctld
  [slurmd]=slurmd
  [srun]=slurm-client
  [munged]=munge
  [ip]=iproute2
  [unshare]=util-linux
  [nsenter]=util-linux
  [pkill]=procps
)

missing=()
for tool in "${!need[@]}"; do
  if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null 2>&1; then
    missing+=("${need[$tool]}")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
# unique package names, stable order
mapfile -t pkgs < <(printf '%s\n' "${missing[@]}" | sort -u)

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  log "missing ${pkgs[*]} and not root with apt-get: the cluster tests will skip" \
      "(install them, e.g. 'sudo apt-get install ${pkgs[*]}')"
  exit 0
fi

log "installing ${pkgs[*]} (first run only)"
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  made_policy=1
fi
cleanup() { if [ "$made_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT

apt=(apt-get -o DPkg::Lock::Timeout=600 -y -qq --no-install-recommends)
export DEBIAN_FRONTEND=noninteractive
# An old or absent package list finds nothing; update once, then install.
timeout 600 apt-get -o DPkg::Lock::Timeout=600 update -qq >&2 || log "apt-get update failed; trying the install anyway"
timeout 900 "${apt[@]}" install "${pkgs[@]}" >&2
log "installed ${pkgs[*]}"
