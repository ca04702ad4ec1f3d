"""Child program for test_native_py: a Python process that allocates through the (fake) driver
with ctypes, as XLA does (dlsym by name), and prints distmem.apply.native's view as JSON lines.

    python pyprog_cap.py [alloc BYTES]... [status] [require CAP] [require-any]
"""
import ctypes
import json
import sys

from distmem.apply import native
from distmem.errors import DistmemError


def main(argv):
    cuda = ctypes.CDLL("libcuda.so.1")
    alloc = cuda.cuMemAlloc_v2
    alloc.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t]
    i = 0
    while i < len(argv):
        op = argv[i]
        if op == "alloc":
            ptr = ctypes.c_ulonglong(0)
            rc = alloc(ctypes.byref(ptr), int(argv[i + 1]))
            print(json.dumps({"op": "alloc", "rc": rc}))
            i += 2
        elif op == "status":
            print(json.dumps({"op": "status", "status": native.status()}))
            i += 1
        elif op in ("require", "require-any"):
            cap = int(argv[i + 1]) if op == "require" else None
            try:
                native.require_active(cap)
                print(json.dumps({"op": op, "ok": True}))
            except DistmemError as exc:
                print(json.dumps({"op": op, "ok": False, "error": str(exc), "type": type(exc).__name__}))
            i += 2 if op == "require" else 1
        else:
            raise SystemExit(f"pyprog_cap: unknown op {op!r}")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
