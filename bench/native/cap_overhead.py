"""Overhead of the native cap on an allocation-heavy loop, against no cap, in the same run.

    python bench/native/cap_overhead.py [--backend auto|cuda|fake] [--iters N] [--rounds R] [--out PATH]
                                 [--gpu-budget SIZE [--others N]] [--library PATH] [--label TEXT]

Each round runs the loop twice in fresh processes, once plain and once with LD_PRELOAD=
libdistmem_cap.so (cap far above the loop's needs, so nothing is denied), alternating so drift hits
both alike; the figures are medians over rounds. Prints one JSON line:

    {"bench": "cap_overhead", "figure": <ns per pair, capped>, "baseline": <ns per pair, plain>,
     "ratio": figure / baseline, ...}

The loop: cuMemAlloc_v2 + cuMemFree_v2 pairs through the driver (looked up with dlsym, the XLA
road), sizes cycling 1, 4, 16, 64 MiB. With torch installed and a GPU, a second figure times
torch.empty + del with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every tensor a cudaMalloc/cudaFree, the
runtime's cuGetProcAddress road). Backend "fake" (auto without a GPU) runs the driver loop against
the test suite's fake driver: it measures the wrapper's own cost against a driver that does almost
nothing, an upper bound on the ratio, not a GPU figure. With --gpu-budget the capped runs also
hold a GPU-wide budget (DISTMEM_CAP_GPU_BYTES, its table in a fresh private folder): each
allocation then reserves against the per-user table too, and --others N keeps N more capped
processes holding 1 MiB each on the same GPU meanwhile (the table's other slots). --library times
another build (e.g. an older commit's) in the same way.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT
SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
CAP = str(64 << 30)
CHILD_TIMEOUT = 300


# ---- children ----------------------------------------------------------------------------------------

def _driver_loop(iters: int) -> dict:
    cuda = ctypes.CDLL("libcuda.so.1")
    u64 = ctypes.c_ulonglong
    if hasattr(cuda, "cuDevicePrimaryCtxRetain"):  # a real driver: make a context current
        assert cuda.cuInit(0) == 0, "cuInit failed"
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
        assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0, "cuDeviceGet(0) failed"
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0, "cuDevicePrimaryCtxRetain failed"
        assert cuda.cuCtxSetCurrent(ctx) == 0, "cuCtxSetCurrent failed"
    alloc, free = cuda.cuMemAlloc_v2, cuda.cuMemFree_v2
    alloc.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t]
    free.argtypes = [u64]
    ptr = u64(0)
    ref = ctypes.byref(ptr)
    sizes = SIZES
    n = len(sizes)
    for i in range(min(200, iters)):
        assert alloc(ref, sizes[i % n]) == 0, "cuMemAlloc_v2 failed in warm-up"
        free(ptr)
    t0 = time.perf_counter_ns()
    for i in range(iters):
        if alloc(ref, sizes[i % n]) != 0:
            raise SystemExit(f"cuMemAlloc_v2 of {sizes[i % n]} bytes failed at iteration {i}")
        free(ptr)
    dt = time.perf_counter_ns() - t0
    return {"ns_per_pair": dt / iters, "iters": iters}


def _torch_loop(iters: int) -> dict:
    import torch

    assert os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1"
    torch.cuda.init()
    sizes = SIZES
    n = len(sizes)
    for i in range(min(200, iters)):
        del_me = torch.empty(sizes[i % n], dtype=torch.uint8, device="cuda")
        del del_me
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for i in range(iters):
        x = torch.empty(sizes[i % n], dtype=torch.uint8, device="cuda")
        del x
    torch.cuda.synchronize()
    dt = time.perf_counter_ns() - t0
    return {"ns_per_pair": dt / iters, "iters": iters}


def _driver_hold() -> dict:
    """Holds 1 MiB on the GPU until stdin closes: another process in the GPU-wide table."""
    cuda = ctypes.CDLL("libcuda.so.1")
    alloc = cuda.cuMemAlloc_v2
    alloc.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t]
    ptr = ctypes.c_ulonglong(0)
    assert alloc(ctypes.byref(ptr), 1 << 20) == 0, "cuMemAlloc_v2 of 1 MiB failed"
    print(json.dumps({"holding": 1 << 20}), flush=True)
    sys.stdin.read()
    return {}


# ---- parent ------------------------------------------------------------------------------------------

def _library() -> str:
    from distmem.apply import native

    path = native.find_library()
    if path:
        return path
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build_native.sh")], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0 or not native.find_library():
        raise SystemExit(f"cap_overhead: building libdistmem_cap.so failed:\n{proc.stderr[-3000:]}")
    return native.find_library()


def _has_gpu() -> bool:
    code = ("import ctypes\ntry:\n c = ctypes.CDLL('libcuda.so.1'); n = ctypes.c_int(0)\n"
            " print(1 if c.cuInit(0) == 0 and c.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0 else 0)\n"
            "except Exception:\n print(0)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
        return out.strip().endswith("1")
    except subprocess.TimeoutExpired:
        return False


def _has_torch_cuda() -> bool:
    code = "import torch; print(int(torch.cuda.is_available()))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180).stdout
        return out.strip().endswith("1")
    except subprocess.TimeoutExpired:
        return False


def _fake_driver_dir() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise SystemExit("cap_overhead: backend 'fake' compiles the test suite's fake driver and needs cc or gcc")
    out = tempfile.mkdtemp(prefix="distmem-fakecuda-")
    src = os.path.join(ROOT, "tests", "native", "c", "fake_cuda.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-Wl,-soname,libcuda.so.1", "-o",
                    os.path.join(out, "libcuda.so.1"), src, "-lpthread"], check=True, timeout=120)
    return out


def _child(kind: str, iters: int, capped: bool, lib: str, extra_env: dict, capped_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMEM_CAP") and k != "LD_PRELOAD"}
    env.update(extra_env)
    if capped:
        env.update(LD_PRELOAD=lib, DISTMEM_CAP_BYTES=CAP)
        env.update(capped_env)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--iters", str(iters)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"cap_overhead: {kind} child ({'capped' if capped else 'plain'}) failed with exit "
                         f"{proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _start_others(n: int, lib: str, extra_env: dict, capped_env: dict) -> list:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMEM_CAP") and k != "LD_PRELOAD"}
    env.update(extra_env, LD_PRELOAD=lib, DISTMEM_CAP_BYTES=CAP, **capped_env)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "hold", "--iters", "1"],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for proc in procs:
        if not (proc.stdout.readline() or "").startswith('{"holding"'):
            raise SystemExit("cap_overhead: a holding process did not start")
    return procs


def _measure(kind: str, iters: int, rounds: int, lib: str, extra_env: dict, capped_env: dict) -> dict:
    plain, capped = [], []
    for _ in range(rounds):
        plain.append(_child(kind, iters, False, lib, extra_env, capped_env)["ns_per_pair"])
        capped.append(_child(kind, iters, True, lib, extra_env, capped_env)["ns_per_pair"])
    base, fig = statistics.median(plain), statistics.median(capped)
    return {"figure": round(fig, 1), "baseline": round(base, 1), "ratio": round(fig / base, 4),
            "overhead_ns": round(fig - base, 1), "plain_rounds": [round(x, 1) for x in plain],
            "capped_rounds": [round(x, 1) for x in capped], "iters": iters, "rounds": rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["auto", "cuda", "fake"], default="auto")
    p.add_argument("--iters", type=int, default=0, help="pairs per run (default: 20000 on a GPU, 200000 fake)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", help="also write the JSON there (a directory gets cap_overhead.json)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch figure")
    p.add_argument("--gpu-budget", help="capped runs also hold this GPU-wide budget (DISTMEM_CAP_GPU_BYTES)")
    p.add_argument("--library", help="time this libdistmem_cap.so (default: distmem's, built if missing)")
    p.add_argument("--label", help="a name for this run, kept in the JSON")
    p.add_argument("--others", type=int, default=0, help="with --gpu-budget: capped processes holding 1 MiB meanwhile")
    p.add_argument("--child", choices=["driver", "torch", "hold"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        res = {"driver": _driver_loop, "torch": _torch_loop, "hold": lambda _: _driver_hold()}[args.child](args.iters)
        print(json.dumps(res), flush=True)
        return 0

    backend = args.backend
    if backend == "auto":
        backend = "cuda" if _has_gpu() else "fake"
    lib = os.path.abspath(args.library) if args.library else _library()
    capped_env = {}
    if args.gpu_budget:
        capped_env = {"DISTMEM_CAP_GPU_BYTES": args.gpu_budget,
                      "DISTMEM_CAP_SHM_DIR": tempfile.mkdtemp(prefix="distmem-bench-shm-")}
    extra = {}
    fake_dir = None
    if backend == "fake":
        fake_dir = _fake_driver_dir()
        extra["LD_LIBRARY_PATH"] = fake_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    iters = args.iters or (20000 if backend == "cuda" else 200000)
    t0 = time.time()
    others = _start_others(args.others, lib, extra, capped_env) if capped_env and args.others else []
    try:
        driver = _measure("driver", iters, args.rounds, lib, extra, capped_env)
    finally:
        for proc in others:
            proc.stdin.close()
            proc.wait(timeout=60)
    result = {"bench": "cap_overhead", "label": args.label, "backend": backend, "figure": driver["figure"],
              "baseline": driver["baseline"], "ratio": driver["ratio"],
              "unit": "ns per cuMemAlloc_v2 + cuMemFree_v2 pair (ctypes loop, 1-64 MiB)",
              "gpu_budget": args.gpu_budget, "others": len(others), "driver": driver, "torch_nocache": None, "library": lib}
    if backend == "cuda" and not args.no_torch:
        if _has_torch_cuda():
            result["torch_nocache"] = dict(
                _measure("torch", max(1000, iters // 4), args.rounds, lib, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
                         capped_env),
                unit="ns per torch.empty + del with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (cudaMalloc + cudaFree)")
        else:
            result["torch_nocache"] = {"skipped": "torch with CUDA not available"}
    result["seconds"] = round(time.time() - t0, 1)
    for tmp in ([capped_env["DISTMEM_CAP_SHM_DIR"]] if capped_env else []) + ([fake_dir] if fake_dir else []):
        shutil.rmtree(tmp, ignore_errors=True)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        path = os.path.join(args.out, "cap_overhead.json") if os.path.isdir(args.out) else args.out
        with open(path, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
