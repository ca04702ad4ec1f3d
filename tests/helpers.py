"""Launch multi-rank jobs from tests: hard timeout, whole process group killed, output kept."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_bin() -> str:
    """The bin/ folder of the environment running the tests (where mpirun's python and horovodrun live)."""
    return os.environ.get("DISTMEM_ENV_BIN") or os.path.dirname(sys.executable)


def python() -> str:
    return sys.executable


def have(cmd: str) -> bool:
    return shutil.which(cmd) is not None or os.path.exists(os.path.join(env_bin(), cmd))


@dataclass
class Result:
    rc: int
    out: str
    seconds: float
    timed_out: bool

    def check(self) -> "Result":
        assert not self.timed_out, f"launch timed out after {self.seconds:.0f} s\n{self.out[-6000:]}"
        assert self.rc == 0, f"launch failed with exit code {self.rc}\n{self.out[-8000:]}"
        return self


def run(cmd: List[str], timeout: float, env: Optional[Dict[str, str]] = None, cwd: str = ROOT) -> Result:
    full_env = dict(os.environ)
    full_env.update({"PYTHONPATH": ROOT + os.pathsep + full_env.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1",
                     "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                     "TF_CPP_MIN_LOG_LEVEL": "2", "OMPI_MCA_btl": "self,vader,tcp",
                     "OMPI_MCA_btl_vader_single_copy_mechanism": "none"})
    full_env.update(env or {})
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return Result(proc.returncode, out, time.monotonic() - t0, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return Result(-9, out, time.monotonic() - t0, True)


def mpirun(np: int, args: List[str], timeout: float = 300, env: Optional[Dict[str, str]] = None) -> Result:
    exe = shutil.which("mpirun")
    assert exe, "mpirun not found: install Open MPI (make env does it)"
    cmd = [exe, "-np", str(np), "--oversubscribe", "--bind-to", "none"]
    for k in ("PYTHONPATH", "DISTMEM_TIMEOUT", "DISTMEM_FLEET", "DISTMEM_QUIET", "TF_CPP_MIN_LOG_LEVEL"):
        cmd += ["-x", k]
    for k in (env or {}):
        cmd += ["-x", k]
    return run(cmd + [python()] + args, timeout, env)


def horovodrun(np: int, args: List[str], mode: str = "gloo", timeout: float = 400,
               env: Optional[Dict[str, str]] = None) -> Result:
    exe = os.path.join(env_bin(), "horovodrun")
    assert os.path.exists(exe), f"horovodrun not found in {env_bin()}: use the main environment (make env)"
    return run([exe, "-np", str(np), "-H", f"localhost:{np}", f"--{mode}", python()] + args, timeout, env)


def result_rows(out: str, tag: str = "RESULT ") -> List[dict]:
    """Every JSON object printed after ``tag``. The launcher forwards several ranks' output through one
    pipe, so two ranks' results may share a line ("RESULT {..}RESULT {..}"): each object is decoded
    where it starts and ends, never by a regular expression to the end of the line."""
    dec = json.JSONDecoder()
    rows, i = [], out.find(tag)
    while i >= 0:
        j = i + len(tag)
        try:
            obj, j = dec.raw_decode(out, j)
            rows.append(obj)
        except ValueError:
            pass
        i = out.find(tag, j)
    return rows


def pytest_args(folder: str, *extra: str) -> List[str]:
    return ["-m", "pytest", os.path.join(ROOT, "tests", folder), "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "--rootdir", os.path.join(ROOT, "tests", folder), *extra]
