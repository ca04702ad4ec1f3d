"""A stand-in worker for the launcher's own tests (no TensorFlow): prints its TF_CONFIG, then does
what MODE says. MODE=ok | fail (rank FAIL_RANK exits 3 at once, the others wait) | sleep | signal |
grandchild (starts a child process that would outlive the worker, writes its pid to PID_DIR)."""
import json
import os
import signal
import subprocess
import sys
import time

cfg = json.loads(os.environ["TF_CONFIG"])
task = cfg["task"]
rank = [(t, i) for t in ("chief", "worker") for i in range(len(cfg["cluster"].get(t, [])))].index(
    (task["type"], task["index"]))
print("CONFIG " + json.dumps({"rank": rank, "cfg": cfg}), flush=True)
print(f"stderr line from {rank}", file=sys.stderr, flush=True)
print(f"[distmem rank {rank}] a line as distmem writes it", file=sys.stderr, flush=True)
mode = os.environ.get("MODE", "ok")
if mode == "fail":
    if rank == int(os.environ.get("FAIL_RANK", "1")):
        print("failing on purpose", flush=True)
        sys.exit(3)
    time.sleep(300)
elif mode == "sleep":
    time.sleep(300)
elif mode == "signal":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)
elif mode == "grandchild":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(os.path.join(os.environ["PID_DIR"], f"{rank}.pid"), "w") as f:
        f.write(str(child.pid))
    if rank == 0:
        time.sleep(1)
        sys.exit(5)
    time.sleep(300)
print(f"rank {rank} done", flush=True)
