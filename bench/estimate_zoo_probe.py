"""Which attention kernel a zoo case's training step uses on CUDA, by memory: the step's allocator
peak with scaled dot-product attention left to torch and with each backend forced in turn.

    PYTHONPATH=. python3 bench/estimate_zoo_probe.py hf_t5 8 adamw float32     # on a GPU

One JSON line per backend: {"case": ..., "backend": ..., "peak": bytes | null, "error": ...}.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import estimate_zoo as zoo  # noqa: E402


def main(argv):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model, batch, optimizer, precision = argv[0], int(argv[1]), argv[2], argv[3]
    case = {"model": model, "size": 224, "batch": batch, "optimizer": optimizer, "precision": precision}
    for name, backend in (("default", None), ("math", SDPBackend.MATH),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        row = {"case": zoo.case_id(case), "backend": name, "peak": None}
        try:
            with ctx:
                row["peak"] = max(zoo.torch_measure(case, 2)["peaks"])
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        print(json.dumps(row), flush=True)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
