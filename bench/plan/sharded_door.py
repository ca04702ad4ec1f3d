"""The sharded door's accuracy: what `distmem plan --strategy sharded` plans for rank 0 of N, against
rank 0 of N measured, and the measured path of `distmem.estimate` on models whose memory follows
their data.

    PYTHONPATH=. python3 bench/plan/sharded_door.py --out $OUT            # one H200, ~6-8 min
    PYTHONPATH=. python3 bench/plan/sharded_door.py --dry --out /tmp/sd   # tiny, on CPU (plumbing)

Models are built as users build them: Hugging Face decoders from config files (Llama, GPT-2, a
Qwen2-style 152k vocabulary, Mistral; `config.save_pretrained(DIR)`, the door given `hf:DIR`,
the measured side `AutoModelForCausalLM.from_config`), torchvision's ViT-B/16 and ResNet-50. Each
is wrapped as users wrap it: `fully_shard` on every module of its block class (Hugging Face's
`_no_split_modules`, what `transformer_layer_cls_to_wrap` defaults to; torchvision's
`EncoderBlock` / `Bottleneck`), then the root; FSDP2 in float32 and with
`MixedPrecisionPolicy(param_dtype=torch.bfloat16)`; ZeRO-1 (`ZeroRedundancyOptimizer`) and ZeRO-2
(ZeRO-1 with the gradients of other ranks' parameters freed once accumulated, as DeepSpeed stage 2
keeps only its partition's). AdamW; the loop keeps its output to the update (`out = model(x); loss =
crit(out); loss.backward(); opt.step()`), the loss cross-entropy over the logits in float32 (as
Hugging Face's loss upcasts them; the door's default loss). Rank 0 of N = 2, 8, 64 through torch's
fake process group (collectives return at once, every allocation real), three steps,
`torch.cuda.max_memory_allocated`. Several measuring processes share the GPU, each capped by its
own memory fraction. The door is asked per case, as a user would (`--estimate model`: the dry
run's answer, the same on a laptop), with no `--units`: its default (the model's repeated block)
is what is checked against the wrapping above.

Data-dependent models: a top-2 mixture-of-experts LM (`torch.where(chosen == e)`, `index_add_`)
and a model selecting rows with a boolean mask, built on the GPU in this process first (as a
script does), then `distmem.estimate(model, example_input=..., method="auto")`: the meta device
cannot run them, so the door's measured path answers (a spawned child, the inputs as given); held
against the same step measured here at the target batch.

One JSON line per case, a summary line, and a table last. Targets (issue 38): every sharded case
within 3% and none more than 1% under; the data-dependent models within 5%.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 1024 ** 2
T0 = time.time()

#: name -> (family, builder arguments, batch, sequence or image size, block class the user wraps)
MODELS: Dict[str, Tuple[str, Dict[str, Any], int, int, str]] = {
    "llama": ("hf", dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=2048), 4, 512, ""),
    "gpt2": ("hf", dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=8, n_head=12, n_positions=1024),
             4, 512, ""),
    "qwen2_152k": ("hf", dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                              num_hidden_layers=8, num_attention_heads=14, num_key_value_heads=2,
                              max_position_embeddings=2048, tie_word_embeddings=False), 4, 512, ""),
    "mistral": ("hf", dict(model_type="mistral", vocab_size=32000, hidden_size=1024, intermediate_size=3584,
                           num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                           max_position_embeddings=2048, sliding_window=None), 4, 512, ""),
    "vit_b_16": ("tv", dict(name="vit_b_16"), 16, 224, "EncoderBlock"),
    "resnet50": ("tv", dict(name="resnet50"), 32, 224, "Bottleneck"),
}
TINY: Dict[str, Dict[str, Any]] = {  # --dry: the same families, small enough for a CPU
    "llama": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4),
    "gpt2": dict(n_embd=128, n_layer=2, n_head=4),
    "qwen2_152k": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2),
    "mistral": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2),
}
MODES = ("fsdp2", "fsdp2_bf16", "zero1", "zero2")


def log(msg: str) -> None:
    print(f"[sharded-door {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def emit(row: Dict[str, Any], out: Any) -> None:
    line = json.dumps(row, sort_keys=True, default=str)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def shape_of(name: str, dry: bool) -> Tuple[int, int]:
    _, _, batch, size, _ = MODELS[name]
    if dry:
        return (2, 32) if MODELS[name][0] == "hf" else (2, 64)
    return batch, size


# ------------------------------------------------------------------ models as users build them

def write_config(name: str, folder: str, dry: bool) -> str:
    """``config.save_pretrained(folder/name)``: the folder the door gets as ``hf:FOLDER``."""
    import transformers
    args = dict(MODELS[name][1])
    kind = args.pop("model_type")
    if dry:
        args.update(TINY[name])
    cfg = transformers.AutoConfig.for_model(kind, **args)
    path = os.path.join(folder, name)
    cfg.save_pretrained(path)
    return path


def build(name: str, spec: str, device: str, dry: bool) -> Any:
    import torch
    family, args, _, size, _ = MODELS[name]
    with torch.device(device):
        if family == "hf":
            import transformers
            cfg = transformers.AutoConfig.from_pretrained(spec[len("hf:"):])
            return transformers.AutoModelForCausalLM.from_config(cfg)
        import torchvision
        kw = {"image_size": size if not dry else 64} if args["name"].startswith("vit") else {}
        return getattr(torchvision.models, args["name"])(weights=None, **kw)


def block_class(name: str, model: Any) -> str:
    """The class a user wraps: Hugging Face's ``_no_split_modules`` (what Accelerate's FSDP wraps by
    default), else the torchvision block named in :data:`MODELS`."""
    own = MODELS[name][4]
    if own:
        return own
    names = list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise SystemExit(f"{name}: no _no_split_modules to wrap by")
    return names[0]


def inputs(name: str, batch: int, size: int, device: str, vocab: int) -> Tuple[tuple, Dict[str, Any]]:
    import torch
    if MODELS[name][0] == "hf":
        return (), {"input_ids": torch.randint(0, vocab, (batch, size), device=device)}
    return (torch.randn(batch, 3, size, size, device=device),), {}


def loss_of(out: Any) -> Any:
    """Cross-entropy over the logits in float32 (Hugging Face's loss upcasts them)."""
    import torch
    t = getattr(out, "logits", out)
    t = t.reshape(-1, t.shape[-1])
    return torch.nn.functional.cross_entropy(t.float(), torch.zeros(t.shape[0], dtype=torch.long, device=t.device))


# ------------------------------------------------------------------ the door

def door_command(name: str, spec: str, mode: str, n: int, dry: bool) -> List[str]:
    batch, size = shape_of(name, dry)
    sharding = "fsdp2" if mode.startswith("fsdp2") else mode
    cmd = [sys.executable, "-m", "distmem", "plan", "--strategy", "sharded", "--gpus", f"{n}x141GiB",
           "--ranks", str(n), "--model", spec, "--batch-size", str(batch), "--sharding", sharding,
           "--optimizer", "adamw", "--estimate", "model", "--framework", "torch", "--json"]
    cmd += ["--input-shape", str(size) if MODELS[name][0] == "hf" else f"3,{size},{size}"]
    if mode == "fsdp2_bf16":
        cmd += ["--param-dtype", "bfloat16"]
    return cmd


def ask_door(case: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    t = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]), CUDA_VISIBLE_DEVICES="")  # the dry run's answer: what a laptop plans
    try:
        done = subprocess.run(case["command"], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"door_error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"door_error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    plan = json.loads(done.stdout)
    a0 = next(a for a in plan["allocations"] if a["rank"] == 0)
    sh = plan.get("extras", {}).get("sharded", {})
    return {"door": int(a0["demand_bytes"]), "door_parts": {k: v for k, v in a0["breakdown"].items()},
            "door_units": sh.get("units"), "door_seconds": round(time.time() - t, 1)}


# ------------------------------------------------------------------ the measured side

def cpu_peak(fn: Any) -> int:
    """The CPU allocator's peak over ``fn()`` (bytes beyond what was held before), from the
    profiler's memory events: torch's CPU allocator keeps no statistics (the --dry plumbing)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, b in events:
        cur += b
        peak = max(peak, cur)
    return peak


def measure_model(name: str, spec: str, worlds: List[int], modes: List[str], dry: bool,
                  fraction: float) -> List[Dict[str, Any]]:
    """Every (N, mode) case of one model in this (spawned) process: rank 0 of N, three steps."""
    import gc
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    device = "cpu" if dry else "cuda"
    if not dry:
        torch.cuda.set_device(0)
        torch.cuda.set_per_process_memory_fraction(fraction)
    batch, size = shape_of(name, dry)
    rows = []
    for n in worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
        try:
            for mode in modes:
                row: Dict[str, Any] = {"model": name, "mode": mode, "world_size": n, "batch": batch}
                try:
                    row.update(_one(name, spec, mode, batch, size, device, dry))
                except Exception as exc:  # one case failing says so; the rest carry on
                    row["measure_error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                gc.collect()
                if not dry:
                    torch.cuda.empty_cache()
        finally:
            dist.destroy_process_group()
    return rows


def _one(name: str, spec: str, mode: str, batch: int, size: int, device: str, dry: bool) -> Dict[str, Any]:
    import torch
    torch.manual_seed(0)
    model = build(name, spec, device, dry)
    model.train()
    wrapped = block_class(name, model)
    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mode == "fsdp2_bf16" else MixedPrecisionPolicy()
        units = [m for m in model.modules() if type(m).__name__ == wrapped]
        for u in units:
            fully_shard(u, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters())
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        units = []
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
        if mode == "zero2":
            owned = {id(p) for g in opt.optim.param_groups for p in g["params"]}
            for p in model.parameters():
                if id(p) not in owned and p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    args, kwargs = inputs(name, batch, size, device, vocab)

    def steps() -> None:
        for _ in range(3):
            out = model(*args, **kwargs)
            loss = loss_of(out)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, loss
    t = time.time()
    if dry:
        held = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                   for p in model.parameters())
        held += sum(t.numel() * t.element_size() for t in (*args, *kwargs.values()))
        peak = held + cpu_peak(steps)
        reserved = 0
    else:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        steps()
        torch.cuda.synchronize()
        peak, reserved = int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
    return {"measured": int(peak), "measured_reserved": reserved, "wrapped": f"{len(units)} x {wrapped}"
            if units else "", "measure_seconds": round(time.time() - t, 1)}


# ------------------------------------------------------------------ data-dependent models

def data_dependent(dry: bool) -> List[Dict[str, Any]]:
    """The measured path of ``distmem.estimate`` on the MoE and masked models (this process has
    started CUDA first, as a script that built its model on the GPU has)."""
    import warnings
    import torch
    import distmem.estimate as de
    from bench.estimate import data_dependent_models as ddm
    device = "cpu" if dry else "cuda"
    rows = []
    for name, batch in (("moe_lm", 8 if dry else 64), ("masked_mlp", 16 if dry else 256)):
        row: Dict[str, Any] = {"model": name, "batch": batch}
        torch.manual_seed(0)
        model = ddm.build(name, dry).to(device)
        example = ddm.example(name, batch, dry, device)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                t = time.time()
                est = de.estimate(model, example_input=example, optimizer=torch.optim.AdamW(model.parameters()),
                                  loss=ddm.loss, method="auto")
            meas = est.measurement or {}
            row.update(estimate=int(est.peak_bytes), method=est.method, how=meas.get("how"),
                       fallback=meas.get("fallback"), rule=meas.get("rule"), prior=meas.get("prior"),
                       points=meas.get("points"), estimate_seconds=round(time.time() - t, 1),
                       warnings=[str(w.message)[:200] for w in seen][:3])
        except Exception as exc:  # the door's own refusal is the answer here
            row["estimate_error"] = f"{type(exc).__name__}: {exc}"[:400]
        if not dry:
            opt = torch.optim.AdamW(model.parameters())
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(3):
                out = model(example)
                value = ddm.loss(out, example)
                value.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del out, value
            torch.cuda.synchronize()
            row["measured"] = int(torch.cuda.max_memory_allocated())
        rows.append(row)
        del model
    return rows


def _data_dependent_child(dry: bool, q: Any) -> None:
    try:
        q.put(("ok", data_dependent(dry)))
    except BaseException as exc:  # noqa: BLE001 - said in the results
        q.put(("error", f"{type(exc).__name__}: {exc}"[:400]))


# ------------------------------------------------------------------ the run

def err(pred: Optional[int], meas: Optional[int]) -> Optional[float]:
    if not pred or not meas:
        return None
    return round(100.0 * (pred - meas) / meas, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="tiny configs on CPU (the plumbing; figures not comparable)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for sharded_door.jsonl/.json")
    ap.add_argument("--models", default=None, help=f"default {','.join(MODELS)} (--dry: llama,qwen2_152k)")
    ap.add_argument("--worlds", default=None, help="default 2,8,64 (--dry: 2,8)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workers", type=int, default=4, help="measuring processes sharing the GPU")
    ap.add_argument("--door-workers", type=int, default=max(1, (os.cpu_count() or 2) - 4))
    ap.add_argument("--budget-s", type=float, default=460.0, help="cases not started by then are skipped")
    ap.add_argument("--no-data-dependent", action="store_true")
    ap.add_argument("--heldout-s", type=float, default=300.0,
                    help="seconds for the measured path on the held-out torch zoo beside the rest "
                         "(estimate_measured_path.py: distmem.estimate(method='measure') per case; 0: skip)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = open(os.path.join(args.out, "sharded_door.jsonl"), "w")
    import torch
    dev = "cpu" if args.dry else torch.cuda.get_device_name(0)
    emit({"case": "device", "device": dev, "torch": torch.__version__}, out)
    names = [m for m in (args.models or ("llama,qwen2_152k" if args.dry else ",".join(MODELS))).split(",") if m]
    try:
        import transformers
        emit({"case": "versions", "transformers": transformers.__version__}, out)
    except ImportError:
        names = [m for m in names if MODELS[m][0] != "hf"]
        log("transformers missing: Hugging Face decoders skipped")
    worlds = [int(x) for x in (args.worlds or ("2,8" if args.dry else "2,8,64")).split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    folder = os.path.join(args.out, "models")
    specs = {m: ("hf:" + write_config(m, folder, args.dry)) if MODELS[m][0] == "hf" else f"torchvision:{MODELS[m][1]['name']}"
             for m in names}
    cases = [{"model": m, "mode": mode, "world_size": n, "command": door_command(m, specs[m], mode, n, args.dry)}
             for m in names for n in worlds for mode in modes]
    heldout = None
    if args.heldout_s > 0 and not args.dry:
        script = next((p for p in (os.path.join(ROOT, "bench", "estimate", "estimate_measured_path.py"),
                                   os.path.join(ROOT, "bench", "estimate_measured_path.py")) if os.path.exists(p)), None)
        if script:
            log_to = open(os.path.join(args.out, "measured_torch.log"), "w")
            heldout = subprocess.Popen(["timeout", str(int(args.heldout_s)), sys.executable, script, "--framework",
                                        "torch", "--jobs", "6", "--out", os.path.join(args.out, "measured_torch.jsonl")],
                                       cwd=ROOT, stdout=log_to, stderr=subprocess.STDOUT,
                                       env=dict(os.environ, PYTHONPATH=ROOT, DISTMEM_MEASURE_CACHE="off"))
    ctx = mp.get_context("spawn")
    # the GPU is shared with the held-out measurements: the sharded cases take 60% of it
    fraction = (0.6 if heldout is not None else 0.9) / max(1, args.workers)
    measured: Dict[Tuple[str, str, int], Dict[str, Any]] = {}
    dd_rows: List[Dict[str, Any]] = []
    with cf.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as gpu, \
            cf.ThreadPoolExecutor(max_workers=args.door_workers) as cpu:
        dd_q = ctx.Queue()
        dd = None if args.no_data_dependent else ctx.Process(target=_data_dependent_child, args=(args.dry, dd_q))
        if dd is not None:
            dd.start()
        meas_f = {gpu.submit(measure_model, m, specs[m], worlds, modes, args.dry, fraction): m for m in names}
        door_f = {cpu.submit(ask_door, c, max(60.0, args.budget_s - (time.time() - T0))): c for c in cases}
        for f in cf.as_completed(list(meas_f)):
            try:
                for r in f.result():
                    measured[(r["model"], r["mode"], r["world_size"])] = r
                log(f"measured {meas_f[f]}")
            except Exception as exc:  # a worker that died: its cases say so
                log(f"measuring {meas_f[f]} failed: {exc}")
        for f in cf.as_completed(list(door_f)):
            c = door_f[f]
            c.update(f.result())
            log(f"door {c['model']} {c['mode']} N={c['world_size']}: {c.get('door', c.get('door_error'))}")
        if dd is not None:
            try:
                status, value = dd_q.get(timeout=max(30.0, args.budget_s + 120 - (time.time() - T0)))
                dd_rows = value if status == "ok" else [{"model": "data-dependent", "estimate_error": value}]
            except Exception as exc:  # noqa: BLE001 - a child that never answered
                dd_rows = [{"model": "data-dependent", "estimate_error": f"no answer: {exc}"}]
            dd.join(timeout=10)
            if dd.is_alive():
                dd.kill()
    if heldout is not None:
        try:
            heldout.wait(timeout=max(10.0, args.heldout_s + 30 - (time.time() - T0)))
        except subprocess.TimeoutExpired:
            heldout.kill()
        emit({"case": "heldout_measured_path", "returncode": heldout.returncode,
              "out": "measured_torch.jsonl (score: estimate_heldout.py --framework torch --measured it)"}, out)
    rows = []
    for c in cases:
        r = dict(measured.get((c["model"], c["mode"], c["world_size"]), {}), **{k: v for k, v in c.items()
                                                                               if k != "command"})
        r["case"] = "sharded"
        r["command"] = " ".join(x if not x.startswith(ROOT) else os.path.relpath(x, ROOT) for x in c["command"][1:])
        r["error_pct"] = err(r.get("door"), r.get("measured"))
        rows.append(r)
        emit(r, out)
    for r in dd_rows:
        r["case"] = "data_dependent"
        r["error_pct"] = err(r.get("estimate"), r.get("measured"))
        emit(r, out)
    errs = [r["error_pct"] for r in rows if r["error_pct"] is not None]
    dd_errs = [r["error_pct"] for r in dd_rows if r.get("error_pct") is not None]
    summary = {"case": "summary", "device": dev, "dry": args.dry, "seconds": round(time.time() - T0, 1),
               "sharded": {"cases": len(rows), "compared": len(errs),
                           "failures": sum(1 for r in rows if "door_error" in r or "measure_error" in r),
                           "max_abs_pct": max((abs(e) for e in errs), default=None),
                           "worst_under_pct": min(errs, default=None),
                           "within_3pct_none_under_1pct": sum(1 for e in errs if -1.0 <= e <= 3.0)},
               "data_dependent": {"cases": len(dd_rows), "errors_pct": dd_errs,
                                  "within_5pct": sum(1 for e in dd_errs if abs(e) <= 5.0)}}
    emit(summary, out)
    with open(os.path.join(args.out, "sharded_door.json"), "w") as f:
        json.dump({"summary": summary, "sharded": rows, "data_dependent": dd_rows}, f, indent=1, sort_keys=True,
                  default=str)
    print("\nmodel        mode        N    door MiB  measured MiB   error  units (door) | wrapped")
    for r in rows:
        d, m = r.get("door"), r.get("measured")
        print(f"{r['model']:<12} {r['mode']:<11} {r['world_size']:<3} {d / MiB if d else float('nan'):>9.1f} "
              f"{m / MiB if m else float('nan'):>12.1f} {r['error_pct'] if r['error_pct'] is not None else '-':>7}"
              f"  {(r.get('door_units') or r.get('door_error') or '')[:40]} | "
              f"{r.get('wrapped') or r.get('measure_error', '')[:40]}")
    for r in dd_rows:
        print(f"{r['model']:<12} estimate({r.get('method') or '-'}, rule {r.get('rule')}) "
              f"{(r.get('estimate') or 0) / MiB:.1f} MiB vs measured {(r.get('measured') or 0) / MiB:.1f} MiB: "
              f"{r.get('error_pct')}% {r.get('estimate_error') or r.get('fallback') or ''}"[:200])
    print(f"sharded: {summary['sharded']}\ndata-dependent: {summary['data_dependent']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
