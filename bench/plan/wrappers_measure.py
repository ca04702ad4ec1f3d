"""The measured side of ``bench/plan/wrappers_gpu.py``: the models, rank 0 of N's training peak under each
wrapper (PyTorch's fake process group for FSDP2 and ZeRO, a real one-rank NCCL group for DDP) and
PyTorch's ``FSDPMemTracker``. Alone (``python bench/plan/wrappers_measure.py --out FILE``) it measures and
writes one JSON line per case, for ``wrappers_gpu.py --measured FILE`` to hold distmem's prediction
against; it needs only torch, torchvision, transformers and ``bench/plan/fit.py``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

T0 = time.time()


def log(msg: str) -> None:
    print(f"[wrappers-measure {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


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
            from bench.plan import fit as fitbench
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
            from bench.plan import fit as fitbench
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


# ------------------------------------------------------------------ measured side

def train_peak(model: Any, opt: Any, inputs: Callable, batch: int, device: str, steps: int = 3) -> Dict[str, Any]:
    """The allocator's peak over ``steps`` steps of the loop the estimator assumes: ``out = model(x);
    loss = crit(out); loss.backward(); opt.step()`` (the output stays referenced to the update). Each
    step's peak is kept beside it, and the last step's peak of each phase (forward, backward,
    update): which step and where the peak falls."""
    import torch
    cuda = device == "cuda"  # on the CPU (the plumbing check) the loop runs and nothing is measured
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    per_step: List[int] = []
    phases: Dict[str, int] = {}
    reserved = 0

    def peak() -> int:
        nonlocal reserved
        if not cuda:
            return 0
        torch.cuda.synchronize()
        reserved = max(reserved, int(torch.cuda.max_memory_reserved()))
        value = int(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        return value

    for i in range(steps):
        last = i == steps - 1
        args, kwargs = inputs(batch, device)
        out = model(*args, **kwargs)
        loss = cross_entropy(out)
        if last:
            phases["forward"] = peak()
        loss.backward()
        if last:
            phases["backward"] = peak()
        opt.step()
        if last:
            phases["update"] = peak()
        opt.zero_grad(set_to_none=True)
        del out, loss, args, kwargs
        per_step.append(max(phases.values()) if last else peak())
    if not cuda:
        return {"allocated": 0, "reserved": 0, "base": 0}
    return {"allocated": max(per_step), "reserved": reserved, "base": int(base), "phases": phases,
            "steps": per_step}


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def zero_optimizer(model: Any, kind: str, optimizer_class: Any) -> Any:
    """``ZeroRedundancyOptimizer`` over ``optimizer_class`` (ZeRO-1); ``kind="zero2"`` also frees the
    gradients of parameters another rank owns once they are accumulated (DeepSpeed stage 2 keeps
    only its partition's)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class)
    if kind == "zero2":
        owned = {id(p) for g in opt.optim.param_groups for p in g["params"]}
        for p in model.parameters():
            if id(p) not in owned and p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    return opt


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
        fully_shard(model)  # the root as users write it: torch keeps it unsharded from forward to backward
        opt = torch.optim.AdamW(model.parameters())
    elif kind in ("zero1", "zero2"):
        opt = zero_optimizer(model, kind, torch.optim.AdamW)
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


def measure_all(names: List[str], worlds: List[int], kinds: List[str], tiny: bool, device: str, ddp: bool,
                peers: bool, budget_s: float, peer_budget_s: float, emit: Callable[[Dict[str, Any]], None]) -> None:
    """Every case, in this order: plain; rank 0 of N under the fake group; DDP (one-rank NCCL/gloo
    group); the FSDPMemTracker peer (CPU time only), with what the budget leaves."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def one(m: str, kind: str, n: int, **options: Any) -> Optional[Dict[str, Any]]:
        if time.time() - T0 > budget_s:
            return None
        row: Dict[str, Any] = {"case": "measured", "model": m, "wrapper": kind, "world_size": n,
                               "batch": MODELS[m][0] if not tiny else 2, "options": options}
        try:
            meas = run_case(m, kind, n, tiny, device, **options)
            row.update(measured_allocated=meas["allocated"], measured_reserved=meas["reserved"],
                       measured_base=meas["base"], measured_phases=meas.get("phases", {}),
                       measured_steps=meas.get("steps", []))
        except Exception as exc:  # one case failing says so and the rest carry on
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            free(device)
        emit(row)
        return row

    for m in names:
        one(m, "plain", 1)
    fsdp_rows: List[Dict[str, Any]] = []
    for n in worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
        try:
            for m in names:
                for kind in kinds:
                    r = one(m, kind, n)
                    if r is not None and kind == "fsdp2" and "error" not in r:
                        fsdp_rows.append(r)
        finally:
            dist.destroy_process_group()
    if ddp:
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
        try:
            for m in names:
                one(m, "ddp", 1)
                one(m, "ddp", 1, gradient_as_bucket_view=True)
                one(m, "ddp", 1, static_graph=True)
        finally:
            dist.destroy_process_group()
    if not peers:
        return
    for n in worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
        try:
            for r in [r for r in fsdp_rows if r["world_size"] == n]:
                if time.time() - T0 > budget_s + peer_budget_s:
                    break
                row: Dict[str, Any] = {"case": "peer", "model": r["model"], "world_size": n}
                try:
                    row["fsdp_mem_tracker"] = fsdp_tracker(r["model"], n, tiny, device)
                except Exception as exc:
                    row["fsdp_mem_tracker_error"] = f"{type(exc).__name__}: {exc}"[:300]
                emit(row)
        finally:
            dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description="rank 0 of N's measured peaks under each wrapper")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--worlds", default="2,8,64")
    ap.add_argument("--kinds", default="fsdp2,zero1,zero2")
    ap.add_argument("--ddp", default="on", choices=("on", "off"))
    ap.add_argument("--peers", default="on", choices=("on", "off"))
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--peer-budget-s", type=float, default=60.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    if args.device == "cuda":
        torch.cuda.set_device(0)
    out = open(args.out, "w") if args.out else None

    def emit(row: Dict[str, Any]) -> None:
        line = json.dumps(row, sort_keys=True)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()
    emit({"case": "device", "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
          "torch": torch.__version__})
    measure_all([m for m in args.models.split(",") if m], [int(x) for x in args.worlds.split(",") if x],
                [k for k in args.kinds.split(",") if k], args.tiny, args.device, args.ddp == "on",
                args.peers == "on", args.budget_s, args.peer_budget_s, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
