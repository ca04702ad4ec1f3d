"""Stands in the launcher's slot for one rank of a fault-injection run: runs the rank program as its
child and, when the child dies of the injected SIGKILL, keeps the slot until the harness says the
run is over ($FAULT_DIR/done), then exits 0. Launchers that tear the whole job down on the first
dead rank (horovodrun --gloo, torchrun, distmem launch-tf) would otherwise kill the survivors before
distmem's own timeouts could be observed; on a real cluster a rank lost with its node goes unseen
by the launcher for as long. A SIGTERM/SIGINT from the launcher is passed on to the child.

    keeper.py PROGRAM [ARGS...]      (run with the rank's interpreter)
"""
import os
import signal
import subprocess
import sys
import time

out_dir = os.environ["FAULT_DIR"]
child = subprocess.Popen([sys.executable] + sys.argv[1:])


def forward(signum, _frame):
    try:
        child.send_signal(signum)
    except ProcessLookupError:
        pass


signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
rc = child.wait()
if rc == -signal.SIGKILL:
    # Bounded: the harness writes 'done' once the survivors are finished (or declared hung).
    deadline = time.monotonic() + float(os.environ.get("FAULT_KEEPER_WAIT", "300"))
    while time.monotonic() < deadline and not os.path.exists(os.path.join(out_dir, "done")):
        time.sleep(0.05)
    sys.exit(0)
sys.exit(rc if rc >= 0 else 128 - rc)
