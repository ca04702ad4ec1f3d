"""What the parallel wrappers add, predicted against measured: rank 0 of N on one GPU.

    PYTHONPATH=. python bench/wrappers_gpu.py --out $OUT/wrappers_gpu.jsonl              # on a GPU
    PYTHONPATH=. python bench/wrappers_gpu.py --device cpu --tiny --out /tmp/w.jsonl      # plumbing on CPU

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
One JSON line per case, then a summary line per wrapper.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

MiB = 1024 ** 2
T0 = time.time()


def log(msg: str) -> None:
    print(f"[wrappers-bench {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ models

def _hf(kind: str, tiny: bool):
    import transformers as T
    if kind == "llama":
        cfg = T.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                            num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024)
        model = T.LlamaForCausalLM(cfg)
        return model, list(model.model.layers), cfg.vocab_size
    cfg = T.GPT2Config(vocab_size=50257, n_embd=768, n_layer=6, n_head=12, n_positions=1024)
    model = T.GPT2LMHeadModel(cfg)
    return model, list(model.transformer.h), cfg.vocab_size


#: name -> (batch, seq or image size); tiny: for the CPU check
MODELS = OrderedDict([
    ("gpt-6l", (8, 512)), ("gpt-12l-1024", (4, 512)), ("hf_llama", (4, 512)), ("hf_gpt2", (4, 512)),
    ("resnet50", (32, 224)), ("vit_b_16", (16, 224)), ("convnext_tiny", (32, 224)),
])


def build(name: str, device: str, tiny: bool) -> Tuple[Any, List[Any], Callable[[int, str], Tuple[tuple, dict]]]:
    """(model, FSDP2 units, inputs(batch, device) -> (args, kwargs)) on ``device``."""
    import torch
    import torchvision

    seq_or_size = MODELS[name][1] if not tiny else 32
    with torch.device(device):
        if name.startswith("gpt-"):
            import fit as fitbench
            d, layers = (768, 6) if name == "gpt-6l" else (1024, 12)
            if tiny:
                d, layers = 64, 2
            model = fitbench._gpt(d=d, layers=layers, heads=8 if tiny else (12 if d == 768 else 16),
                                  seq=seq_or_size, vocab=1000 if tiny else 32000)
            units = [m for n, m in model.named_children() if n.startswith("block")]
            vocab = 1000 if tiny else 32000
            return model, units, lambda b, dev: ((_ids(b, seq_or_size, vocab, dev),), {})
        if name.startswith("hf_"):
            model, units, vocab = _hf(name[3:], tiny)
            return model, units, lambda b, dev: ((), {"input_ids": _ids(b, seq_or_size, vocab, dev)})
        if name == "resnet50":
            import fit as fitbench
            model = fitbench._resnet(18 if tiny else 50)
            units = [m for n, m in model.named_children() if n.startswith("layer")]
        elif name == "vit_b_16":
            model = torchvision.models.vit_b_16(weights=None, image_size=seq_or_size if not tiny else 32)
            units = list(model.encoder.layers)
        else:
            model = torchvision.models.convnext_tiny(weights=None)
            units = [blk for stage in model.features for blk in (stage if isinstance(stage, torch.nn.Sequential)
                                                                 else []) if type(blk).__name__ == "CNBlock"]
    s = seq_or_size
    return model, units, lambda b, dev: ((_image(b, s, dev),), {})


def _ids(b: int, seq: int, vocab: int, dev: str):
    import torch
    if dev == "meta":
        return torch.empty((b, seq), dtype=torch.long, device=dev)
    return torch.randint(0, vocab, (b, seq), device=dev)


def _image(b: int, s: int, dev: str):
    import torch
    return torch.empty(b, 3, s, s, device=dev) if dev == "meta" else torch.randn(b, 3, s, s, device=dev)


def cross_entropy(out):
    """The loss the estimator assumes (``loss="auto"``): cross-entropy over the last dimension."""
    import torch
    t = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", out)
    logits = t.reshape(-1, t.shape[-1])
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=t.device)
    return torch.nn.functional.cross_entropy(logits, target)


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


# ------------------------------------------------------------------ measured side

def train_peak(model: Any, opt: Any, inputs: Callable, batch: int, device: str, steps: int = 3) -> Dict[str, int]:
    import torch
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    for _ in range(steps):
        args, kwargs = inputs(batch, device)
        loss = cross_entropy(model(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, args, kwargs
    if not cuda:
        return {"allocated": 0, "reserved": 0, "base": 0}
    torch.cuda.synchronize()
    return {"allocated": int(torch.cuda.max_memory_allocated()), "reserved": int(torch.cuda.max_memory_reserved()),
            "base": int(base)}


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_case(name: str, kind: str, n: int, tiny: bool, device: str, **options: Any) -> Dict[str, int]:
    import torch
    torch.manual_seed(0)
    model, units, inputs = build(name, device, tiny)
    model.train()
    b = MODELS[name][0] if not tiny else 2
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for u in units:
            fully_shard(u, reshard_after_forward=options.get("reshard_after_forward", True))
        fully_shard(model, reshard_after_forward=options.get("reshard_after_forward", True))
        opt = torch.optim.AdamW(model.parameters())
    elif kind in ("zero1", "zero2"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
        if kind == "zero2":
            owned = {id(p) for g in opt.optim.param_groups for p in g["params"]}
            for p in model.parameters():
                if id(p) not in owned and p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, **{k: v for k, v in options.items() if k in ("gradient_as_bucket_view", "static_graph",
                                                                        "bucket_cap_mb")})
        opt = torch.optim.AdamW(model.parameters())
    else:
        opt = torch.optim.AdamW(model.parameters())
    free(device)
    out = train_peak(model, opt, inputs, b, device)
    del model, opt, units
    free(device)
    return out


def fsdp_tracker(name: str, n: int, tiny: bool, device: str, capturable: bool = False) -> Optional[int]:
    """PyTorch's FSDPMemTracker under FakeTensorMode (two steps, the second's peak). AdamW reads its
    step count with ``.item()``, which fake tensors refuse on some paths: then ``capturable=True``
    (the step count on the device, a few bytes) is tried."""
    if not capturable:
        try:
            return _fsdp_tracker(name, n, tiny, device, False)
        except Exception as exc:
            if "DataDependent" not in type(exc).__name__:
                raise
    return _fsdp_tracker(name, n, tiny, device, True)


def _fsdp_tracker(name: str, n: int, tiny: bool, device: str, capturable: bool) -> Optional[int]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh
    b = MODELS[name][0] if not tiny else 2
    mesh = init_device_mesh(device, (n,))  # outside FakeTensorMode: the mesh is built from real tensors
    with FakeTensorMode():
        model, units, inputs = build(name, device, tiny)
        for u in units:
            fully_shard(u, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), capturable=capturable)
        fmt = FSDPMemTracker(model, opt)
        args, kwargs = inputs(b, device)
        fmt.track_inputs(args + tuple(kwargs.values()))
        with fmt:
            for i in range(2):
                loss = cross_entropy(model(*args, **kwargs))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i == 0:
                    fmt.reset_mod_stats()
        return int(fmt.get_tracker_snapshot("peak")[dev]["Total"])


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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dev = args.device
    if dev == "cuda":
        torch.cuda.set_device(0)
    out = open(args.out, "w") if args.out else None
    names = [m for m in args.models.split(",") if m]
    if dev == "cpu":
        try:
            import transformers  # noqa: F401
        except ImportError:
            names = [m for m in names if not m.startswith("hf_")]
            log("transformers missing here: Hugging Face models skipped")
    ests: Dict[str, Dict[str, Any]] = {}
    for m in names:
        try:
            ests[m] = estimate(m, args.tiny, dev)
            log(f"estimate {m}: peak {ests[m]['peak'] / MiB:.1f} MiB ({ests[m]['phase']}) in "
                f"{ests[m]['estimate_seconds']} s")
        except Exception as exc:  # a model the estimator cannot run: say so, carry on
            emit({"case": "estimate", "model": m, "error": f"{type(exc).__name__}: {exc}"[:400]}, out)
    rows: List[Dict[str, Any]] = []

    def case(m: str, kind: str, n: int, **options: Any) -> None:
        if time.time() - T0 > args.budget_s:
            return
        e = ests[m]
        row: Dict[str, Any] = {"case": "wrapper", "model": m, "wrapper": kind, "world_size": n,
                               "batch": e["batch"], "params": e["params"], "options": options}
        try:
            meas = run_case(m, kind, n, args.tiny, dev, **options)
            pred, parts = predict(e, kind if kind != "plain" else None, n, **options)
            row.update(measured_allocated=meas["allocated"], measured_reserved=meas["reserved"],
                       measured_base=meas["base"], distmem=pred, distmem_parts=parts,
                       distmem_error_pct=err(pred, meas["allocated"]), estimate_unsharded=e["peak"],
                       estimate_phase=e["phase"])
            if kind in ("zero1", "zero2"):
                ds = deepspeed_zero2(e["params"], n)
                row.update(deepspeed=ds, deepspeed_error_pct=err(ds, meas["allocated"]))
            if kind == "fsdp2":
                ds = deepspeed_zero3(e["params"], e["largest_layer_params"], n)
                row.update(deepspeed=ds, deepspeed_error_pct=err(ds, meas["allocated"]))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            row["trace"] = traceback.format_exc()[-800:]
            free(dev)
        rows.append(row)
        emit(row, out)

    # plain (no process group), DDP on a real one-rank group, then rank 0 of N under the fake group;
    # the FSDPMemTracker peer last (CPU time only: FakeTensorMode), with what the budget leaves
    for m in ests:
        e = ests[m]
        emit({"case": "estimate", "model": m, "batch": e["batch"], "peak": e["peak"], "phase": e["phase"],
              "parts": e["parts"], "activation_bytes": e["activation_bytes"], "params": e["params"],
              "largest_layer_params": e["largest_layer_params"], "estimate_seconds": e["estimate_seconds"],
              "state": {"param_bytes": e["state"].param_bytes, "grad_bytes": e["state"].grad_bytes,
                        "optimizer_bytes": e["state"].optimizer_bytes, "unit_bytes": list(e["state"].unit_bytes),
                        "root_bytes": e["state"].root, "tensor_bytes": list(e["state"].tensor_bytes),
                        "tensor_rows": list(e["state"].tensor_rows)}}, out)
        case(m, "plain", 1)
    if args.ddp == "on":
        backend = "nccl" if dev == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
        try:
            for m in ests:
                case(m, "ddp", 1)
                case(m, "ddp", 1, gradient_as_bucket_view=True)
                case(m, "ddp", 1, static_graph=True)
        finally:
            dist.destroy_process_group()
    kinds = [k for k in args.kinds.split(",") if k]
    worlds = [int(x) for x in args.worlds.split(",") if x]
    for n in worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
        try:
            for m in ests:
                for kind in kinds:
                    case(m, kind, n)
        finally:
            dist.destroy_process_group()
    if args.peers == "on" and "fsdp2" in kinds:
        for n in worlds:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
            try:
                for r in [r for r in rows if r["wrapper"] == "fsdp2" and r["world_size"] == n and "error" not in r]:
                    if time.time() - T0 > args.budget_s + args.peer_budget_s:
                        break
                    try:
                        fm = fsdp_tracker(r["model"], n, args.tiny, dev)
                        r.update(fsdp_mem_tracker=fm, fsdp_mem_tracker_error_pct=err(fm, r["measured_allocated"]))
                    except Exception as exc:
                        r["fsdp_mem_tracker_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    emit({"case": "peer", "model": r["model"], "world_size": n,
                          **{k: r.get(k) for k in ("fsdp_mem_tracker", "fsdp_mem_tracker_error_pct",
                                                   "fsdp_mem_tracker_error", "measured_allocated")}}, out)
            finally:
                dist.destroy_process_group()
    summary: Dict[str, Any] = {"case": "summary", "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
                               "torch": torch.__version__, "seconds": round(time.time() - T0, 1)}
    for kind in ["plain", "ddp"] + kinds:
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
