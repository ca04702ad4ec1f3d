"""Pid reuse on demand, for test_cap_security: run as root inside
``unshare --pid --mount --fork --mount-proc`` (so this is pid 1 of a fresh PID namespace with its
own /proc), it

1. runs a capped process (``first``) that allocates and is killed (SIGKILL) holding its memory;
   with ``first_without_proc`` that process runs in a mount namespace whose /proc is an empty tmpfs;
2. gives the dead process's pid to a new process (``squatter``: ``sleep``) through
   /proc/sys/kernel/ns_last_pid, as a busy node eventually does;
3. runs a second capped process that asks for the memory the dead one held,

and prints one JSON line with what each saw. With ``hidepid`` /proc is remounted hidepid=2 first
(only this namespace's /proc instance changes).

    python pidns_driver.py SPEC_JSON
"""
import json
import os
import subprocess
import sys


def _as(user):
    return dict(user=user[0], group=user[1], extra_groups=[]) if user else {}


def main(spec):
    env, capdrv = spec["env"], spec["capdrv"]
    if spec.get("hidepid"):
        subprocess.run(["mount", "-o", "remount,hidepid=2", "/proc"], check=True, timeout=30)
    first_cmd = [capdrv, "alloc", str(spec["bytes"]), "die"]
    if spec.get("first_without_proc"):
        user = spec.get("victim")
        drop = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups"] if user else []
        first = subprocess.Popen(["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=1m none /proc && exec "$@"', "sh",
                                  *drop, *first_cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
    else:
        first = subprocess.Popen(first_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 **_as(spec.get("victim")))
    out1, err1 = first.communicate(timeout=60)
    dead = first.pid
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(dead - 1))
    squatter = subprocess.Popen(["sleep", "60"], **_as(spec.get("squatter")))
    try:
        second = subprocess.run([capdrv, "alloc", str(spec["bytes"]), "shared"], env=env, capture_output=True,
                                text=True, timeout=60, **_as(spec.get("victim")))
    finally:
        squatter.kill()
        squatter.wait()
    print(json.dumps({
        "first": {"pid": dead, "rc": first.returncode, "stdout": out1, "stderr": err1},
        "squatter_pid": squatter.pid,
        "second": {"rc": second.returncode, "stdout": second.stdout, "stderr": second.stderr},
    }))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
