"""What a zoo case's training step allocates on CUDA, by memory, to find what the estimator misses.

Two probes, on a GPU:

    PYTHONPATH=. python3 bench/estimate/estimate_zoo_probe.py hf_t5 8 adamw float32
    PYTHONPATH=. python3 bench/estimate/estimate_zoo_probe.py --ops OUT_DIR squeezenet1_1@224/b64/rmsprop/float32 ...

The first: the step's allocator peak with scaled dot-product attention left to torch and with
each backend forced in turn, one JSON line per backend: {"case", "backend", "peak": bytes | null,
"error"}.

The second (``--ops``): one step after two warm-up steps, each aten op seen through a dispatch
mode with the allocator's peak reset before it, so every op says what it allocated beyond its own
outputs (``hidden``: a cuDNN/cuBLAS workspace, an internal copy, a cast; what a meta-device
simulation, which only sees outputs, cannot have). ``OUT_DIR/<case>.json``: the plain steps'
peaks, the op at the step's peak, the ops with the most hidden bytes, and every op's record
``[op, phase, allocated before, peak over before, after over before, new output bytes, dtype,
input shapes, sdpa backend]``; a ``@math``/``@cudnn``/``@efficient``/``@flash`` suffix on a case
forces that attention backend.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line
from bench.estimate import estimate_zoo as zoo, estimate_zoo_torch as zoot  # noqa: E402


def main(argv):
    if argv and argv[0] == "--ops":
        return ops_main(argv[1], argv[2:])
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model, batch, optimizer, precision = argv[0], int(argv[1]), argv[2], argv[3]
    case = {"model": model, "size": 224, "batch": batch, "optimizer": optimizer, "precision": precision}
    for name, backend in (("default", None), ("math", SDPBackend.MATH),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        row = {"case": zoo.case_id(case), "backend": name, "peak": None}
        try:
            with ctx:
                row["peak"] = max(zoot.torch_measure(case, 2)["peaks"])
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        print(json.dumps(row), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return 0


def _parse(cid: str):
    backend = None
    if cid.count("@") > 1:
        cid, backend = cid.rsplit("@", 1)
    model, rest = cid.split("@", 1)
    size, batch, optimizer, precision = rest.split("/")
    return {"model": model, "size": int(size), "batch": int(batch[1:]), "optimizer": optimizer,
            "precision": precision}, backend


def _op_recorder():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows = []
            self.phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flat = [t for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)]
            ins = {t.untyped_storage().data_ptr() for t in flat if t.device.type == "cuda"}
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = func(*args, **kwargs)
            peak = torch.cuda.max_memory_allocated()
            after = torch.cuda.memory_allocated()
            new = {}
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t) and t.device.type == "cuda":
                    s = t.untyped_storage()
                    if s.data_ptr() and s.data_ptr() not in ins:
                        new[s.data_ptr()] = s.nbytes()
            out_bytes = sum((n + 511) // 512 * 512 for n in new.values())
            dtype = str(flat[0].dtype).replace("torch.", "") if flat else ""
            shapes = [list(t.shape) for t in flat[:3]]
            self.rows.append([str(func), self.phase, before, peak - before, after - before, out_bytes, dtype, shapes])
            return out
    return Recorder


def ops_main(out_dir: str, ids) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    os.makedirs(out_dir, exist_ok=True)
    Recorder = _op_recorder()
    backends = {"math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    for cid in ids:
        c, backend = _parse(cid)
        res = {"case": cid, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
        try:
            ctx = sdpa_kernel(backends[backend]) if backend else contextlib.nullcontext()
            with ctx:
                res.update(_ops_case(c, Recorder))
        except Exception as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"[:400]
        with open(os.path.join(out_dir, cid.replace("/", "_").replace("@", "_") + ".json"), "w") as f:
            json.dump(res, f)
        print(json.dumps({k: v for k, v in res.items() if k not in ("rows", "top_hidden")}), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return 0


def _ops_case(c, Recorder):
    import torch
    model, inputs = zoot.torch_build(c, "cuda")
    model.train()
    opt = zoot.torch_optimizer(c["optimizer"], model.parameters())
    amp = zoot.amp_dtype(c["precision"])
    scaler = torch.amp.GradScaler("cuda") if c["precision"] == "fp16" else None
    args, kwargs = inputs(c["batch"], "cuda")
    rec = Recorder()
    plain = []
    for step in range(3):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        mode = rec if step == 2 else contextlib.nullcontext()
        with mode:
            rec.phase = "forward"
            with (torch.autocast("cuda", dtype=amp) if amp is not None else contextlib.nullcontext()):
                out = model(*args, **kwargs)
                loss = zoot.cross_entropy(out)
            rec.phase = "backward"
            if scaler is not None:
                scaler.scale(loss).backward()
                rec.phase = "update"
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                rec.phase = "update"
                opt.step()
            opt.zero_grad(set_to_none=True)
            del out, loss
        torch.cuda.synchronize()
        plain.append(int(torch.cuda.max_memory_allocated()))
    rows = rec.rows
    at = max(range(len(rows)), key=lambda i: rows[i][2] + rows[i][3])
    hidden = []
    for i, r in enumerate(rows):
        h = r[3] - r[5]
        if h >= 256 * 1024:
            hidden.append([i, h, r])
    hidden.sort(key=lambda x: -x[1])
    attn = sorted({r[0] for r in rows if "attention" in r[0]})
    return {"plain_peaks": plain, "recorded_peak": rows[at][2] + rows[at][3], "peak_op": [at, rows[at]],
            "around_peak": rows[max(0, at - 8): at + 3], "attention_ops": attn, "ops": len(rows),
            "hidden_total_at_peak": rows[at][3] - rows[at][5], "top_hidden": hidden[:60], "rows": rows}


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
