"""Fill a GPU with one framework until it reaches a target or runs out of memory; print one JSON line.

    python fill.py FRAMEWORK --target BYTES [--chunk BYTES] [--matmul N] [--hold FILE] [--hold-timeout S]

FRAMEWORK: torch | cupy | cupy-async (CuPy's cudaMallocAsync pool) | jax.
--matmul N   first run N fp32 matmuls of 4096 x 4096 (cuBLAS handles and workspaces)
--hold FILE  after filling, print the result, then keep the memory until FILE exists (or the
             timeout passes), so a parent can measure the process with NVML
The result names what the framework saw: bytes reached, whether it hit OOM (and the message), the
device total the framework was told, and distmem.apply.native.status() when distmem is importable.
Exit 0 with {"skip": reason} when the framework is not installed.
"""
import argparse
import json
import os
import sys
import time


def _raw_status(why):
    """The library's own figures for device 0 through ctypes, for when distmem cannot be imported."""
    import ctypes

    try:
        lib = ctypes.CDLL(None)
        get = lib.distmem_cap_get_stats
    except (OSError, AttributeError):
        return {"active": False, "import_error": why}
    buf = (ctypes.c_uint64 * 7)()
    get.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    get(0, ctypes.byref(buf), ctypes.sizeof(buf))
    cap = None if buf[0] == 2**64 - 1 else int(buf[0])
    return {"active": True, "cap_bytes": cap, "used_bytes": int(buf[1]), "peak_bytes": int(buf[2]),
            "denials": int(buf[3]), "lookups": {"dlsym": -1, "cuGetProcAddress": -1}, "import_error": why}


def _native_status():
    try:
        from distmem.apply import native
    except Exception as exc:  # noqa: BLE001 - report, don't fail: the parent decides
        return _raw_status(f"import distmem.apply.native: {type(exc).__name__}: {exc}")
    return native.status()


def _emit(obj):
    print(json.dumps(obj), flush=True)


def fill_torch(args, out):
    import torch

    if not torch.cuda.is_available():
        return {"skip": "torch sees no CUDA device"}
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    out.update(framework_total=total, framework_free=free, torch=torch.__version__,
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if args.matmul:
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(args.matmul):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
        out["matmul_done"] = args.matmul
    held, reached = [], 0
    try:
        while reached + args.chunk <= args.target:
            held.append(torch.empty(args.chunk, dtype=torch.uint8, device="cuda"))
            reached += args.chunk
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as exc:
        out.update(oom=True, oom_message=str(exc)[:600])
    out.update(reached=reached, torch_allocated=torch.cuda.memory_allocated(),
               torch_reserved=torch.cuda.memory_reserved(), after_total=torch.cuda.mem_get_info()[1])
    return held


def fill_cupy(args, out, use_async):
    import cupy

    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return {"skip": "CuPy sees no CUDA device"}
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return {"skip": f"CuPy sees no CUDA device: {exc}"}
    if use_async:
        cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
    free, total = cupy.cuda.runtime.memGetInfo()
    out.update(framework_total=total, framework_free=free, cupy=cupy.__version__)
    held, reached = [], 0
    try:
        while reached + args.chunk <= args.target:
            held.append(cupy.empty(args.chunk, dtype=cupy.uint8))
            reached += args.chunk
        cupy.cuda.Device().synchronize()
    except cupy.cuda.memory.OutOfMemoryError as exc:
        out.update(oom=True, oom_message=str(exc)[:600])
    except cupy.cuda.runtime.CUDARuntimeError as exc:  # the async pool reports OOM this way
        if "out of memory" not in str(exc).lower() and "cudaErrorMemoryAllocation" not in str(exc):
            raise
        out.update(oom=True, oom_message=str(exc)[:600])
    out.update(reached=reached)
    return held


def fill_jax(args, out):
    import jax
    import jax.numpy as jnp

    dev = None
    errors = []
    for platform in ("gpu", "cuda"):
        try:
            dev = jax.devices(platform)[0]
            break
        except RuntimeError as exc:
            errors.append(f"{platform}: {exc}")
    if dev is None:
        return {"skip": f"JAX sees no GPU ({'; '.join(errors)})"}
    stats = dev.memory_stats() or {}
    out.update(jax=jax.__version__, bytes_limit=stats.get("bytes_limit"),
               preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true"))
    held, reached = [], 0
    try:
        while reached + args.chunk <= args.target:
            x = jnp.zeros((args.chunk,), dtype=jnp.uint8)
            x.block_until_ready()
            held.append(x)
            reached += args.chunk
    except Exception as exc:  # noqa: BLE001 - XlaRuntimeError RESOURCE_EXHAUSTED; its class moves between versions
        text = str(exc)
        if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
            raise
        out.update(oom=True, oom_message=text[:600])
    stats = dev.memory_stats() or {}
    out.update(reached=reached, bytes_in_use=stats.get("bytes_in_use"), peak_bytes_in_use=stats.get("peak_bytes_in_use"))
    return held


def main():
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=["torch", "cupy", "cupy-async", "jax"])
    p.add_argument("--target", type=int, required=True)
    p.add_argument("--chunk", type=int, default=256 * 1024**2)
    p.add_argument("--matmul", type=int, default=0)
    p.add_argument("--hold")
    p.add_argument("--hold-timeout", type=float, default=120.0)
    args = p.parse_args()
    out = {"pid": os.getpid(), "framework": args.framework, "target": args.target, "chunk": args.chunk, "oom": False,
           "cap_env": os.environ.get("DISTMEM_CAP_BYTES"), "preloaded": "libdistmem_cap" in os.environ.get("LD_PRELOAD", "")}
    mod = {"torch": "torch", "cupy": "cupy", "cupy-async": "cupy", "jax": "jax"}[args.framework]
    try:
        __import__(mod)
    except ImportError as exc:
        _emit({"skip": f"{mod} is not installed: {exc}"})
        return 0
    t0 = time.time()
    if args.framework == "torch":
        held = fill_torch(args, out)
    elif args.framework == "jax":
        held = fill_jax(args, out)
    else:
        held = fill_cupy(args, out, args.framework == "cupy-async")
    if isinstance(held, dict):  # a skip
        _emit(held)
        return 0
    out["seconds"] = round(time.time() - t0, 2)
    out["native"] = _native_status()
    out["ready"] = True
    _emit(out)
    if args.hold:
        deadline = time.time() + args.hold_timeout
        while not os.path.exists(args.hold) and time.time() < deadline:
            time.sleep(0.1)
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
