"""One rank of the victim's job in the heartbeat's cross-user tests: ``distmem.init()`` (fail fast on,
as by default), then nothing but waiting, so that only the heartbeat can end it early.

$HB_OUT (the victim's own folder): rank 0 writes ``port`` (its hub's port) and, under horovodrun,
``store`` (the launcher's rendezvous port); every rank writes ``pid-<rank>``, sends its stderr to
``stderr-<rank>.txt`` and, once it sees ``$HB_OUT/stop``, tries to open 64 files (``opened-<rank>``:
``ok`` or the error - a hub that let strangers take its descriptors fails here) and exits 0.
HB_NOFILE: the soft limit of open files on rank 0 (1024 is the usual login default).
"""
import os
import sys
import time

out = os.environ["HB_OUT"]


def rank_of() -> int:
    for key in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "RANK", "PMI_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def put(name: str, text: str) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, name))


rank = rank_of()
err = os.open(os.path.join(out, f"stderr-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.dup2(err, 2)
sys.stderr = os.fdopen(2, "w", buffering=1)
if rank == 0 and os.environ.get("HB_NOFILE"):
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(os.environ["HB_NOFILE"]), hard))

import distmem  # noqa: E402
from distmem.comm import heartbeat  # noqa: E402

distmem.init(fleet="4x16GiB", framework="none", verbose=False)
hb = heartbeat.current()
if rank == 0:
    put("port", str(hb.info["port"]) if hb is not None else "none")
    if os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT"):
        put("store", os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
put(f"pid-{rank}", str(os.getpid()))
deadline = time.monotonic() + float(os.environ.get("HB_LIMIT", "120"))
while not os.path.exists(os.path.join(out, "stop")) and time.monotonic() < deadline:
    time.sleep(0.05)
opened = []
try:
    for _ in range(64):
        opened.append(open(os.devnull))
    put(f"opened-{rank}", "ok")
except OSError as exc:
    put(f"opened-{rank}", f"{type(exc).__name__}: {exc}")
for f in opened:
    f.close()
sys.exit(0)
