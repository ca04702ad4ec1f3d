"""What the parallel wrappers add, predicted against measured: rank 0 of N on one GPU.

    PYTHONPATH=. python bench/plan/wrappers_gpu.py --out $OUT/wrappers_gpu.jsonl              # on a GPU
    PYTHONPATH=. python bench/plan/wrappers_gpu.py --device cpu --tiny --out /tmp/w.jsonl      # plumbing on CPU
    python bench/plan/wrappers_measure.py --out measured.jsonl                                 # the GPU side alone
    PYTHONPATH=. python bench/plan/wrappers_gpu.py --measured measured.jsonl --out FILE         # predicted here

For each model (small LLM configs and vision models, AdamW, float32) and world size N (2, 8, 64),
one process is rank 0 of N through PyTorch's fake process group (``fake_pg``: collectives return
at once, every allocation is real): FSDP2 (``fully_shard`` per block, then the root),
``ZeroRedundancyOptimizer`` (ZeRO-1) and ZeRO-2 (ZeRO-1 plus, as DeepSpeed stage 2 does, the
gradients of parameters another rank owns freed once reduced: a post-accumulate hook). DDP does
not run on the fake backend, so it runs on a real one-rank NCCL group (default buckets,
``gradient_as_bucket_view``, ``static_graph``). Each case trains 3 steps after the wrapper is built;
the measured peak is ``torch.cuda.max_memory_allocated`` over them (reserved beside it).

distmem's prediction: the estimator's peak of the same step without a wrapper (meta device,
CUDA allocator model) with the wrapper's rule (``distmem.plan.wrappers.rank_peak``). The peers, on
the same cases: PyTorch's ``FSDPMemTracker`` (FSDP2, under FakeTensorMode, as torchtitan runs it)
and DeepSpeed's published model-state formulas (``estimate_zero2_model_states_mem_needs``:
``4 P + 16 P / N`` bytes for P parameters; ``estimate_zero3_model_states_mem_needs``:
``4 x largest layer + 18 P / N``), written out here (DeepSpeed is not installed on the GPU machine).
One JSON line per case, then a summary line per wrapper. The measured side is
``bench/plan/wrappers_measure.py``: run alone on the GPU, its lines are held against distmem's
prediction and the peers' here (``--measured``); the estimator then runs on this machine's torch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

MiB = 1024 ** 2
T0 = time.time()


def log(msg: str) -> None:
    print(f"[wrappers-bench {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


from bench.plan.wrappers_measure import MODELS, build, measure_all  # noqa: E402

# ------------------------------------------------------------------ distmem's side

def model_state(model: Any, units: List[Any], optimizer_bytes: int):
    from distmem.plan.wrappers import ModelState
    params = list(model.parameters())
    tb = tuple(p.numel() * p.element_size() for p in params)
    rows = tuple(int(p.shape[0]) if p.dim() else 1 for p in params)
    in_units = set()
    unit_bytes = []
    for u in units:
        mine = [p for p in u.parameters() if id(p) not in in_units]
        in_units.update(id(p) for p in mine)
        unit_bytes.append(sum(p.numel() * p.element_size() for p in mine))
    P = sum(tb)
    G = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return ModelState(P, G, int(optimizer_bytes), tensor_bytes=tb, unit_bytes=tuple(unit_bytes),
                      root_bytes=P - sum(unit_bytes), tensor_rows=rows)


def estimate(name: str, tiny: bool, device: str) -> Dict[str, Any]:
    """The estimator's unsharded step on the meta device, and the model's state as the rules see it."""
    import torch
    from distmem.estimate import estimate_torch
    model, units, inputs = build(name, "meta", tiny)
    b = MODELS[name][0] if not tiny else 2
    args, kwargs = inputs(b, "meta")
    t = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_torch(model, example_input=kwargs if kwargs else args, batch_size=b,
                             optimizer=torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))]),
                             device="cuda" if device == "cuda" else "cpu", name=name)
        detail = est.peak_detail(b)
        parts = est.breakdown(b)
    state = model_state(model, units, est.optimizer_bytes)
    largest_layer = max((m.weight.numel() if getattr(m, "weight", None) is not None else 0)
                        for m in model.modules() if not list(m.children()))
    return {"est": est, "batch": b, "peak": int(detail["peak"]), "phase": str(detail["phase"]), "parts": parts,
            "activation_bytes": int(est.activation_bytes(b)), "state": state,
            "params": sum(p.numel() for p in model.parameters()), "largest_layer_params": int(largest_layer),
            "estimate_seconds": round(time.time() - t, 2)}


def predict(e: Dict[str, Any], kind: Optional[str], n: int, **options: Any) -> Tuple[int, Dict[str, int]]:
    from distmem.plan.wrappers import Wrapper, rank_peak
    w = Wrapper(kind, n, **options) if kind else None
    peak, parts, _ = rank_peak(e["parts"], e["phase"], e["state"], w, activation_bytes=e["activation_bytes"])
    return peak, parts


def deepspeed_zero2(params: int, n: int) -> int:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs`` per GPU without offload."""
    return 4 * params + int(16 * params / n)


def deepspeed_zero3(params: int, largest_layer_params: int, n: int) -> int:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs`` per GPU without offload."""
    return 4 * largest_layer_params + int(18 * params / n)


def err(pred: Optional[int], meas: int) -> Optional[float]:
    if pred is None or not meas:
        return None
    return round(100.0 * (pred - meas) / meas, 2)


def emit(row: Dict[str, Any], out) -> None:
    line = json.dumps(row, sort_keys=True)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny configs (the CPU check of the plumbing)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--worlds", default="2,8,64")
    ap.add_argument("--kinds", default="fsdp2,zero1,zero2")
    ap.add_argument("--ddp", default="on", choices=("on", "off"))
    ap.add_argument("--peers", default="on", choices=("on", "off"))
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting cases after this many seconds")
    ap.add_argument("--peer-budget-s", type=float, default=60.0, help="seconds more for the FSDPMemTracker peer")
    ap.add_argument("--measured", default=None, help="measured lines (wrappers_measure.py) instead of measuring")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = open(args.out, "w") if args.out else None
    measured: List[Dict[str, Any]] = []
    if args.measured:
        with open(args.measured) as f:
            measured = [json.loads(line) for line in f if line.strip()]
    else:
        import torch
        if args.device == "cuda":
            torch.cuda.set_device(0)
        measured.append({"case": "device", "device": torch.cuda.get_device_name(0) if args.device == "cuda"
                         else "cpu", "torch": torch.__version__})
    names = [m for m in args.models.split(",") if m]
    if args.measured:
        names = [m for m in names if any(r.get("model") == m for r in measured)]
    try:
        import transformers  # noqa: F401
    except ImportError:
        names = [m for m in names if not m.startswith("hf_")]
        log("transformers missing here: Hugging Face models skipped")
    ests: Dict[str, Dict[str, Any]] = {}
    for m in names:
        try:
            ests[m] = estimate(m, args.tiny, "cuda" if args.measured else args.device)
            log(f"estimate {m}: peak {ests[m]['peak'] / MiB:.1f} MiB ({ests[m]['phase']}) in "
                f"{ests[m]['estimate_seconds']} s")
        except Exception as exc:  # a model the estimator cannot run: say so, carry on
            emit({"case": "estimate", "model": m, "error": f"{type(exc).__name__}: {exc}"[:400]}, out)
    if not args.measured:
        measure_all(list(ests), [int(x) for x in args.worlds.split(",") if x],
                    [k for k in args.kinds.split(",") if k], args.tiny, args.device, args.ddp == "on",
                    args.peers == "on", args.budget_s, args.peer_budget_s, measured.append)
    device = next((r for r in measured if r.get("case") == "device"), {})
    for m in ests:
        e = ests[m]
        emit({"case": "estimate", "model": m, "batch": e["batch"], "peak": e["peak"], "phase": e["phase"],
              "parts": e["parts"], "activation_bytes": e["activation_bytes"], "params": e["params"],
              "largest_layer_params": e["largest_layer_params"], "estimate_seconds": e["estimate_seconds"],
              "state": {"param_bytes": e["state"].param_bytes, "grad_bytes": e["state"].grad_bytes,
                        "optimizer_bytes": e["state"].optimizer_bytes, "unit_bytes": list(e["state"].unit_bytes),
                        "root_bytes": e["state"].root}}, out)
    peers = {(r["model"], r["world_size"]): r for r in measured if r.get("case") == "peer"}
    rows: List[Dict[str, Any]] = []
    for r in measured:
        if r.get("case") != "measured" or r.get("model") not in ests:
            continue
        e, kind, n = ests[r["model"]], r["wrapper"], r["world_size"]
        row = dict(r, case="wrapper", params=e["params"], estimate_unsharded=e["peak"], estimate_phase=e["phase"])
        if "error" not in r:
            meas = r["measured_allocated"]
            pred, parts = predict(e, kind if kind != "plain" else None, n, **r.get("options", {}))
            row.update(distmem=pred, distmem_parts=parts, distmem_error_pct=err(pred, meas))
            if kind in ("zero1", "zero2"):
                ds = deepspeed_zero2(e["params"], n)
                row.update(deepspeed=ds, deepspeed_error_pct=err(ds, meas))
            if kind == "fsdp2":
                ds = deepspeed_zero3(e["params"], e["largest_layer_params"], n)
                row.update(deepspeed=ds, deepspeed_error_pct=err(ds, meas))
                p = peers.get((r["model"], n), {})
                if p.get("fsdp_mem_tracker") is not None:
                    row.update(fsdp_mem_tracker=p["fsdp_mem_tracker"],
                               fsdp_mem_tracker_error_pct=err(p["fsdp_mem_tracker"], meas))
                elif p.get("fsdp_mem_tracker_error"):
                    row["fsdp_mem_tracker_error"] = p["fsdp_mem_tracker_error"]
        rows.append(row)
        emit(row, out)
    summary: Dict[str, Any] = {"case": "summary", "device": device.get("device"), "torch_measured": device.get("torch"),
                               "seconds": round(time.time() - T0, 1)}
    try:
        import torch
        summary["torch_estimated"] = torch.__version__
    except ImportError:
        pass
    for kind in ["plain", "ddp", "fsdp2", "zero1", "zero2"]:
        ok = [r for r in rows if r["wrapper"] == kind and r.get("distmem_error_pct") is not None]
        if not ok:
            continue
        s: Dict[str, Any] = {"cases": len(ok), "errors": sum(1 for r in rows if r["wrapper"] == kind and "error" in r)}
        for who in ("distmem", "deepspeed", "fsdp_mem_tracker"):
            errs = [abs(r[f"{who}_error_pct"]) for r in ok if r.get(f"{who}_error_pct") is not None]
            if errs:
                s[who] = {"max_abs_error_pct": max(errs), "mean_abs_error_pct": round(sum(errs) / len(errs), 2),
                          "within_3pct": sum(1 for x in errs if x <= 3.0), "n": len(errs)}
        summary[kind] = s
    emit(summary, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
