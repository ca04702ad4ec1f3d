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

distmem's prediction: what ``distmem.fit`` (the door) plans for rank 0 of that one layout (N
replicas of the batch, the sharding or DDP named, FSDP2 units said as the measured side wraps
them, no headroom/reserve/overhead: the allocator's peak it prices). The peers, on
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

# ------------------------------------------------------------------ distmem's side: the fit door

#: FSDP2 units as the measured side wraps each model (wrappers_measure.build), said to the door
#: as a user says them (``units=``); None: the door's default (the model's repeated block).
#: resnet50 (bench/fit.py's, an nn.Sequential whose children are numbered) was measured with
#: the root alone: wrappers_measure picks children named ``layer*``, and it has none
UNITS = {"gpt-6l": "Block", "gpt-12l-1024": "Block", "hf_llama": None, "hf_gpt2": None,
         "resnet50": "root", "vit_b_16": None, "convnext_tiny": "CNBlock"}


def estimate(name: str, tiny: bool, device: str) -> Dict[str, Any]:
    """The model as the measured side builds it (on the meta device), its example input and the
    figures the peers need; distmem's prediction comes from the door (:func:`predict`)."""
    model, _, inputs = build(name, "meta", tiny)
    b = MODELS[name][0] if not tiny else 2
    args, kwargs = inputs(b, "meta")
    largest_layer = max((m.weight.numel() if getattr(m, "weight", None) is not None else 0)
                        for m in model.modules() if not list(m.children()))
    return {"model": model, "example": kwargs if kwargs else args, "batch": b, "device": device,
            "params": sum(p.numel() for p in model.parameters()), "largest_layer_params": int(largest_layer)}


def predict(e: Dict[str, Any], name: str, kind: Optional[str], n: int, **options: Any) -> Tuple[int, Dict[str, int]]:
    """Rank 0's peak as ``distmem.fit`` plans it: one layout, ``n`` replicas of ``batch`` each,
    sharded by ``kind`` (FSDP2 units as wrapped: ``UNITS``) or replicated under DDP."""
    import torch
    import distmem
    b = e["batch"]
    wrapper = None
    if kind == "ddp":
        wrapper = "ddp_bucket_view" if options.get("gradient_as_bucket_view") else "ddp"
        if options.get("static_graph"):
            return None, {}  # static_graph changes when the rebuild happens, not its bytes: not a fit option
    shard = [kind if kind != "fsdp2" or options.get("reshard_after_forward", True) else "fsdp2_keep"] \
        if kind in ("fsdp2", "zero1", "zero2") else "none"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = distmem.fit(e["model"], global_batch_size=n * b, gpus=f"{n}x141GiB", precision="float32",
                          optimizer=torch.optim.AdamW, example_input=e["example"], estimate_batch_size=b,
                          device=e["device"], estimate="model", name=name, pipelines=[1], micro_batches=[b],
                          ranks_per_gpu=[1], shardings=shard, wrapper=wrapper, units=UNITS.get(name), top=50,
                          overhead=0, reserve=0, headroom=0)
    pick = [c for c in res.fits + [r for r in res.rejected] if c.layout.micro_batch == b and c.layout.accumulation == 1
            and c.layout.shard == (shard[0] if isinstance(shard, list) else "")]
    if not pick:
        raise RuntimeError(f"fit evaluated no layout of {n} x batch {b} {kind}: {res.table()[:300]}")
    h = pick[0].heaviest if pick[0] in res.fits else pick[0].binding
    return int(h.allocator_bytes), dict(h.breakdown)


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
        except Exception as exc:  # a model that cannot be built: say so, carry on
            emit({"case": "estimate", "model": m, "error": f"{type(exc).__name__}: {exc}"[:400]}, out)
    if not args.measured:
        measure_all(list(ests), [int(x) for x in args.worlds.split(",") if x],
                    [k for k in args.kinds.split(",") if k], args.tiny, args.device, args.ddp == "on",
                    args.peers == "on", args.budget_s, args.peer_budget_s, measured.append)
    device = next((r for r in measured if r.get("case") == "device"), {})
    peers = {(r["model"], r["world_size"]): r for r in measured if r.get("case") == "peer"}
    rows: List[Dict[str, Any]] = []
    for r in measured:
        if r.get("case") != "measured" or r.get("model") not in ests:
            continue
        e, kind, n = ests[r["model"]], r["wrapper"], r["world_size"]
        row = dict(r, case="wrapper", params=e["params"])
        if "error" not in r:
            meas = r["measured_allocated"]
            try:
                pred, parts = predict(e, r["model"], kind if kind != "plain" else None, n, **r.get("options", {}))
            except Exception as exc:  # the door refused: said in the row
                row["door_error"] = f"{type(exc).__name__}: {exc}"[:300]
                pred, parts = None, {}
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
