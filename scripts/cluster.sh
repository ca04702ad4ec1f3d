#!/usr/bin/env bash
# The simulated multi-host cluster of tests/cluster/, by hand (root; see docs/cluster.md).
#
#   scripts/cluster.sh shell [N]   build N hosts (default 3), open a shell on hosta with the launch
#                                  environment (ssh hostb, mpirun, srun work), take it all down on exit
#   scripts/cluster.sh clean       remove namespaces left by killed runs (only slots no live run holds)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
py=${DISTMEM_ENV_BIN:+$DISTMEM_ENV_BIN/python}
py=${py:-$("$here/scripts/env.sh" main | tail -n 1)/python}
case "${1:-}" in
  shell)
    bash "$here/scripts/cluster_deps.sh"
    # -c, not a here-document: the shell on hosta needs this terminal as its standard input.
    exec "$py" -c '
import os, subprocess, sys
sys.path.insert(0, os.path.join(sys.argv[2], "tests", "cluster"))
from harness import Cluster
with Cluster(hosts=int(sys.argv[1]), python_bin=os.path.dirname(sys.executable)) as c:
    print(f"[cluster] {c.log[-1]}; temporary folder {c.tmp}; exit the shell to take it down", flush=True)
    env = c.env({"PS1": r"[\h \W]# ", "TERM": os.environ.get("TERM", "xterm")})
    subprocess.call(c.enter(c.login.name) + ["bash", "-c", "cd \"$0\" && exec bash --norc -i", sys.argv[2]], env=env)
' "${2:-3}" "$here"
    ;;
  clean)
    exec "$py" - "$here" <<'PY'
import fcntl, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "cluster"))
from harness import LOCKS, PREFIX, SLOTS, _clean_tmp, clean_stale
os.makedirs(LOCKS, exist_ok=True)
for slot in range(SLOTS):
    fd = os.open(os.path.join(LOCKS, f"{PREFIX}{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        print(f"[cluster] slot {slot} is held by a live run: left alone")
        continue
    previous = os.pread(fd, 4096, 0).decode(errors="replace").split()
    left = clean_stale(f"{PREFIX}{slot}") + (_clean_tmp(previous[1]) if len(previous) >= 2 else [])
    for what in left:
        print(f"[cluster] removed {what}")
    os.close(fd)
PY
    ;;
  *) sed -n '2,7p' "$0"; exit 2 ;;
esac
