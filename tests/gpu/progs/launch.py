"""Launch a GPU scenario once per session and share its result between test files; keep evidence.

``scenario(prog, np, env)`` runs ``mpirun -np N`` (hard timeout) over a program in this folder and
returns the JSON its rank 0 wrote; a second call with the same arguments returns the same result
(or raises the same failure) without launching again. ``evidence(name, data)`` appends one JSON line
to $DISTMEM_GPU_EVIDENCE when set (tests/gpu/run_gpu.sh points it into $OUT).
"""
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/, for helpers

from helpers import ROOT, mpirun  # noqa: E402

__all__ = ["scenario", "run_python", "evidence", "gpu_count", "write_results", "GPU_ENV", "MiB", "ROOT"]

MiB = 1024 ** 2
#: Set for every GPU launch: NVLink multicast stays off; CUDA numbers GPUs like NVML.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "DISTMEM_TIMEOUT": "60"}
for _k in ("DISTMEM_FAKE_GPU", "DISTMEM_FAKE_GPU_DIR"):
    if os.environ.get(_k):
        GPU_ENV[_k] = os.environ[_k]

_cache = {}


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    """GPUs NVML sees (0 without NVML), asked once in a subprocess so the test process never starts CUDA.
    The suite runs on any count from one: the ranks of a case share the GPUs it has."""
    code = ("import pynvml\n"
            "try:\n pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())\n"
            "except Exception: print(0)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        return int(out.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - no NVML, no GPU
        return 0


def write_results(path, runner, tests, complete=True):
    """The suite's outcomes as JSON (DISTMEM_GPU_RESULTS): counts, the GPUs seen, one row per test
    (id, outcome, seconds, and the reason of a failure or a skip); ``complete`` once the run ended."""
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"runner": runner, "complete": complete, "gpus_seen": gpu_count(), "time": time.time(), **counts,
                   "tests": tests}, f, indent=1)
    os.replace(tmp, path)


def evidence(name, data):
    path = os.environ.get("DISTMEM_GPU_EVIDENCE")
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"name": name, "time": time.time(), **data}, default=str) + "\n")


#: distmem-exec as the GPU machine runs it (no console script there): ``scenario(..., wrapper=DISTMEM_EXEC)``.
DISTMEM_EXEC = ("-m", "distmem.cli.exec", "--", sys.executable)


def scenario(prog, np, env=None, timeout=120, wrapper=()):
    """``mpirun -np NP python [WRAPPER...] PROG --out FILE`` once per arguments; FILE's JSON (rank 0's)."""
    env = dict(env or {})
    key = (prog, np, tuple(sorted(env.items())), tuple(wrapper))
    if key not in _cache:
        out = os.path.join(tempfile.mkdtemp(prefix="distmem-gpu-"), f"{os.path.splitext(prog)[0]}-np{np}.json")
        res = mpirun(np, [*wrapper, os.path.join(HERE, prog), "--out", out], timeout=timeout, env={**GPU_ENV, **env})
        print(res.out[-6000:])  # shown by pytest on failure, and in the log by the minimal runner
        if res.timed_out or res.rc != 0 or not os.path.exists(out):
            why = "timed out" if res.timed_out else f"exit code {res.rc}"
            _cache[key] = AssertionError(f"mpirun -np {np} {prog} {env or ''} {why} after {res.seconds:.0f} s\n"
                                         f"{res.out[-8000:]}")
            evidence(f"{prog}-np{np}", {"env": env, "failed": why, "log_tail": res.out[-3000:]})
        else:
            with open(out) as f:
                data = json.load(f)
            data["_seconds"] = res.seconds
            _cache[key] = data
    got = _cache[key]
    if isinstance(got, AssertionError):
        raise got
    return got


def run_python(args, timeout=120, env=None):
    """Run ``python ARGS`` (this interpreter) with the GPU environment; returns (rc, output)."""
    full = dict(os.environ)
    full.update(GPU_ENV)
    full.update(env or {})
    full["PYTHONPATH"] = ROOT + os.pathsep + full.get("PYTHONPATH", "")
    full["PYTHONUNBUFFERED"] = "1"
    try:
        p = subprocess.run([sys.executable] + list(args), capture_output=True, text=True, timeout=timeout, env=full,
                           cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr)]
        return 124, f"timed out after {timeout} s\n" + "".join(text)
    return p.returncode, p.stdout + p.stderr
