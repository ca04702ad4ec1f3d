"""The sharded door's accuracy: what `distmem plan --strategy sharded` plans for rank 0 of N, against
rank 0 of N measured, and the measured path of `distmem.estimate` on models whose memory follows
their data.

    PYTHONPATH=. python3 bench/plan/sharded_door.py --out $OUT            # one H200, ~6-8 min
    PYTHONPATH=. python3 bench/plan/sharded_door.py --dry --out /tmp/sd   # tiny, on CPU (plumbing)
    PYTHONPATH=. python3 bench/plan/sharded_door.py --out $OUT/w/sd2 --heldout-s 0 --workers 8 --budget-s 140 \
        --cases "qwen2_152k,mistral=fsdp2,zero2@2 resnet50=fsdp2_bf16" \
        --door "qwen2_152k,mistral=fsdp2,zero1,zero2"                     # a re-run of some cases, ~2 min
    python3 bench/plan/sharded_door.py --merge $OUT/w/sd2/sharded_door.jsonl \
        --into bench/results/sharded_door_h200.jsonl                      # its lines into the results
    PYTHONPATH=. python3 bench/plan/sharded_door.py --out $OUT/sd3 --heldout-s 0 --no-data-dependent \
        --workers 8 --door-workers 10 --budget-s 240                     # every case, each in its own process
    PYTHONPATH=. python3 bench/plan/sharded_door.py --door-only --door-workers 2 --out /tmp/door  # any machine

Models are built as users build them: Hugging Face decoders from config files (Llama, GPT-2, a
Qwen2-style 152k vocabulary, Mistral; `config.save_pretrained(DIR)`, the door given `hf:DIR`,
the measured side `AutoModelForCausalLM.from_config`), torchvision's ViT-B/16 and ResNet-50. Each
is wrapped as users wrap it: `fully_shard` on every module of its block class (Hugging Face's
`_no_split_modules`, what `transformer_layer_cls_to_wrap` defaults to; torchvision's
`EncoderBlock` / `Bottleneck`), then the root; FSDP2 in float32 and with
`MixedPrecisionPolicy(param_dtype=torch.bfloat16)`; ZeRO-1 (`ZeroRedundancyOptimizer`) and ZeRO-2
(ZeRO-1 with the gradients of other ranks' parameters freed once accumulated, as DeepSpeed stage 2
keeps only its partition's). Under the bf16 policy a BatchNorm module gets its own `fully_shard`
with no mixed precision first, as FSDP1's `MixedPrecision` does by default
(`_module_classes_to_ignore`): FSDP2 would cast its weight to bf16 while its running statistics
stay float32, which cuDNN's batch norm refuses ("Expected running_mean to have type BFloat16");
kept float32 it takes the block's bf16 input and returns bf16. The door prices the whole model in
`param_dtype`: the BatchNorm weights (under 0.1% of ResNet-50's parameters) are then counted at
half their bytes, what they keep and output is the same bf16 tensors. AdamW; the loop keeps its output to the update (`out = model(x); loss =
crit(out); loss.backward(); opt.step()`), the loss cross-entropy over the logits in float32 (as
Hugging Face's loss upcasts them; the door's default loss). Rank 0 of N = 2, 8, 64 through torch's
fake process group (collectives return at once, every allocation real), three steps,
`torch.cuda.max_memory_allocated`. Every case is measured in a process of its own (spawned, one
case each; several share the GPU, each capped by its own memory fraction): what one case leaves
allocated (the first run measured one case after another in one process: GPT-2's ZeRO-1 after its
bf16 FSDP2 case held 46-185 MiB more than its ZeRO-2 case) cannot enter the next one's peak;
each row says what was allocated before its model was built (`allocated_at_start`, 0 in a fresh
process). The door is asked per case, as a user would (`--estimate model`: the dry
run's answer, the same on a laptop), with no `--units`: its default (the model's repeated block)
is what is checked against the wrapping above.

Data-dependent models: a top-2 mixture-of-experts LM (`torch.where(chosen == e)`, `index_add_`)
and a model selecting rows with a boolean mask, built on the GPU in this process first (as a
script does), then `distmem.estimate(model, example_input=..., method="auto")`: the meta device
cannot run them, so the door's measured path answers (a spawned child, the inputs as given); held
against the same step measured here at the target batch, after the previous model and everything
the estimate left in reference cycles were collected (`gc.collect()`: the first run did not, and
the masked model's reference held the MoE's 0.93 GiB of parameters beside its own step).

`--cases` measures some cases only ("MODELS=MODES[@WORLDS]" groups); `--door` asks the door about
more cases than those measured (the same groups, or `all`; `none`: measure only): the cases whose
plan the code may now answer differently, so that a merge holds the door's current answer beside
each measured peak. `--door-only` asks the door and measures nothing (no GPU needed: the door's
answer is the dry run's; torch's own version still enters it where the estimator asks the torch
installed, as for grouped K/V attention). The plan prices the estimate's high figure (its modelled
bound, a share of the rank's peak, booked as `estimate uncertainty`): each row holds the demand
(`door`, `error_pct`) and the point figure beneath it (`door_point`, `point_error_pct`). `--merge NEW
--into RESULTS` puts NEW's lines over RESULTS' (a case's door answer, its measured peak when NEW
measured it), recomputes the errors and the summary, and says per row which run each figure came
from (`door_run`, `measured_run`).

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
    # the plan prices the estimate's high figure: its point figure is the demand less that part
    margin = sum(int(v) for k, v in a0["breakdown"].items() if k.startswith("estimate_uncertainty"))
    return {"door": int(a0["demand_bytes"]), "door_point": int(a0["demand_bytes"]) - margin,
            "door_parts": {k: v for k, v in a0["breakdown"].items()},
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


def measure_case(name: str, spec: str, n: int, mode: str, dry: bool, fraction: float) -> Dict[str, Any]:
    """One case in this (spawned, one-case) process: rank 0 of N, three steps."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    device = "cpu" if dry else "cuda"
    if not dry:
        torch.cuda.set_device(0)
        torch.cuda.set_per_process_memory_fraction(fraction)
    batch, size = shape_of(name, dry)
    row: Dict[str, Any] = {"model": name, "mode": mode, "world_size": n, "batch": batch,
                           "allocated_at_start": 0 if dry else int(torch.cuda.memory_allocated())}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        row.update(_one(name, spec, mode, batch, size, device, dry))
    except Exception as exc:  # the case failing says so
        row["measure_error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        dist.destroy_process_group()
    return row


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
        norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)] \
            if mode == "fsdp2_bf16" else []
        for m in norms:  # float32, as FSDP1's MixedPrecision keeps them (see the module docstring)
            fully_shard(m, mp_policy=MixedPrecisionPolicy())
        for u in units:
            fully_shard(u, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters())
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        units, norms = [], []
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
    text = f"{len(units)} x {wrapped}" if units else ""
    if mode.startswith("fsdp2") and norms:
        text += f"; {len(norms)} x {type(norms[0]).__name__} in float32 (own fully_shard)"
    return {"measured": int(peak), "measured_reserved": reserved, "wrapped": text,
            "measure_seconds": round(time.time() - t, 1)}


# ------------------------------------------------------------------ data-dependent models

def data_dependent(dry: bool) -> List[Dict[str, Any]]:
    """The measured path of ``distmem.estimate`` on the MoE and masked models (this process has
    started CUDA first, as a script that built its model on the GPU has)."""
    import gc
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
            # what the previous model and this estimate left unreachable (reference cycles) goes first
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            row["allocated_before"] = int(torch.cuda.memory_allocated())  # this model, its batch, workspaces
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
        del model, example
        opt = est = None
        gc.collect()
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


#: a case's fields that come from the door, and from the measured side
DOOR_FIELDS = ("door", "door_point", "door_parts", "door_units", "door_seconds", "door_error", "command")
MEASURED_FIELDS = ("measured", "measured_reserved", "wrapped", "measure_seconds", "measure_error", "batch",
                   "allocated_at_start")


def point_of(r: Dict[str, Any]) -> Optional[int]:
    """The door's point figure: its demand less the estimate's uncertainty it priced (rows of runs
    before the plan priced it hold the point figure as their demand)."""
    if r.get("door_point") is not None:
        return int(r["door_point"])
    if not r.get("door"):
        return None
    return int(r["door"]) - sum(int(v) for k, v in (r.get("door_parts") or {}).items()
                                if k.startswith("estimate_uncertainty"))


def parse_cases(text: Optional[str], models: List[str], worlds: List[int]) -> List[Tuple[str, str, int]]:
    """``"MODELS=MODES[@WORLDS] ..."`` (groups apart by spaces or ';', lists by ',') as (model, mode, N)
    in the table's order; None or "all": every model x mode x N."""
    if not text or text == "all":
        return [(m, mode, n) for m in models for n in worlds for mode in MODES]
    picked = set()
    for group in text.replace(";", " ").split():
        if "=" not in group:
            raise SystemExit(f"--cases {group!r}: give MODELS=MODES[@WORLDS], e.g. llama,gpt2=fsdp2,zero1@2,8")
        ms, rest = group.split("=", 1)
        modes, _, ns = rest.partition("@")
        for m in ms.split(","):
            if m not in MODELS:
                raise SystemExit(f"--cases: unknown model {m!r}; one of {', '.join(MODELS)}")
            for mode in modes.split(","):
                if mode not in MODES:
                    raise SystemExit(f"--cases: unknown mode {mode!r}; one of {', '.join(MODES)}")
                for n in ([int(x) for x in ns.split(",")] if ns else worlds):
                    picked.add((m, mode, n))
    return [(m, mode, n) for m in MODELS for n in sorted({c[2] for c in picked}) for mode in MODES
            if (m, mode, n) in picked]


def summarize(rows: List[Dict[str, Any]], dd_rows: List[Dict[str, Any]], dev: str, dry: bool,
              seconds: float) -> Dict[str, Any]:
    errs = [r["error_pct"] for r in rows if r.get("error_pct") is not None]
    points = [r["point_error_pct"] for r in rows if r.get("point_error_pct") is not None]
    dd_errs = [r["error_pct"] for r in dd_rows if r.get("error_pct") is not None]
    return {"case": "summary", "device": dev, "dry": dry, "seconds": round(seconds, 1),
            "sharded": {"cases": len(rows), "compared": len(errs),
                        "failures": sum(1 for r in rows if "door_error" in r or "measure_error" in r),
                        "max_abs_pct": max((abs(e) for e in errs), default=None),
                        "worst_under_pct": min(errs, default=None),
                        "within_3pct_none_under_1pct": sum(1 for e in errs if -1.0 <= e <= 3.0),
                        # the plan's demand prices the estimate's high figure (its bound); the point
                        # figure is the demand less that part (``door_point``)
                        "point_compared": len(points),
                        "point_max_abs_pct": max((abs(e) for e in points), default=None),
                        "point_worst_under_pct": min(points, default=None),
                        "point_within_3pct_none_under_1pct": sum(1 for e in points if -1.0 <= e <= 3.0),
                        "demand_under_measured": sum(1 for e in errs if e < 0)},
            "data_dependent": {"cases": len(dd_rows), "errors_pct": dd_errs,
                               "within_5pct": sum(1 for e in dd_errs if abs(e) <= 5.0)}}


def write_results(path: str, head: List[Dict[str, Any]], rows: List[Dict[str, Any]],
                  dd_rows: List[Dict[str, Any]], summary: Dict[str, Any]) -> None:
    """``path`` (.jsonl: one line each) and the same stem's .json (the summary, the rows)."""
    with open(path, "w") as out:
        for r in (*head, *rows, *dd_rows, summary):
            out.write(json.dumps(r, sort_keys=True, default=str) + "\n")
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({"summary": summary, "sharded": rows, "data_dependent": dd_rows}, f, indent=1, sort_keys=True,
                  default=str)


def print_table(rows: List[Dict[str, Any]], dd_rows: List[Dict[str, Any]], summary: Dict[str, Any]) -> None:
    print("\nmodel        mode        N    door MiB  measured MiB   error   point  units (door) | wrapped")
    for r in rows:
        d, m = r.get("door"), r.get("measured")
        print(f"{r['model']:<12} {r['mode']:<11} {r['world_size']:<3} {d / MiB if d else float('nan'):>9.1f} "
              f"{m / MiB if m else float('nan'):>12.1f} {r['error_pct'] if r['error_pct'] is not None else '-':>7}"
              f" {r.get('point_error_pct') if r.get('point_error_pct') is not None else '-':>7}"
              f"  {(r.get('door_units') or r.get('door_error') or '')[:40]} | "
              f"{r.get('wrapped') or r.get('measure_error', '')[:40]}")
    for r in dd_rows:
        print(f"{r['model']:<12} estimate({r.get('method') or '-'}, rule {r.get('rule')}) "
              f"{(r.get('estimate') or 0) / MiB:.1f} MiB vs measured {(r.get('measured') or 0) / MiB:.1f} MiB: "
              f"{r.get('error_pct')}% {r.get('estimate_error') or r.get('fallback') or ''}"[:200])
    print(f"sharded: {summary['sharded']}\ndata-dependent: {summary['data_dependent']}")


def merge(new_path: str, into: str) -> int:
    """``new_path``'s lines put over ``into``'s (see the module docstring); both files rewritten
    at ``into`` (.jsonl and .json)."""
    def read(path: str) -> List[Dict[str, Any]]:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    old, new = read(into), read(new_path)
    devices = {r.get("device") for r in (*old, *new) if r.get("case") == "device"}
    if len(devices) > 1:
        raise SystemExit(f"--merge: {new_path} was measured on {', '.join(sorted(map(str, devices)))}: the lines of "
                         f"one device only go into {into}")
    old_run = next((r.get("run") for r in old if r.get("case") == "summary"), None) or "first"
    new_run = os.path.basename(os.path.dirname(os.path.abspath(new_path))) or "new"
    key = lambda r: (r["model"], r["mode"], r["world_size"])  # noqa: E731
    merged: Dict[Tuple[str, str, int], Dict[str, Any]] = {}
    for r in old:
        if r.get("case") == "sharded":
            merged[key(r)] = dict(r, door_run=r.get("door_run", old_run), measured_run=r.get("measured_run", old_run))
    for r in new:
        if r.get("case") != "sharded":
            continue
        row = merged.setdefault(key(r), {"case": "sharded", "model": r["model"], "mode": r["mode"],
                                         "world_size": r["world_size"]})
        if "door" in r or "door_error" in r:
            for k in DOOR_FIELDS:
                row.pop(k, None)
            row.update({k: r[k] for k in DOOR_FIELDS if k in r}, door_run=new_run)
        if "measured" in r or "measure_error" in r:
            for k in MEASURED_FIELDS:
                row.pop(k, None)
            row.update({k: r[k] for k in MEASURED_FIELDS if k in r}, measured_run=new_run)
    order = {(m, mode, n): i for i, (m, mode, n) in enumerate(
        (m, mode, n) for m in MODELS for n in sorted({k[2] for k in merged}) for mode in MODES)}
    rows = sorted(merged.values(), key=lambda r: order.get(key(r), len(order)))
    for r in rows:
        r["error_pct"] = err(r.get("door"), r.get("measured"))
        r["point_error_pct"] = err(point_of(r), r.get("measured"))
    dd = {r["model"]: dict(r, run=r.get("run", old_run)) for r in old if r.get("case") == "data_dependent"}
    dd.update({r["model"]: dict(r, run=new_run) for r in new if r.get("case") == "data_dependent"})
    dd_rows = list(dd.values())
    for r in dd_rows:
        r["error_pct"] = err(r.get("estimate"), r.get("measured"))
    kinds = ("device", "door_host", "versions", "heldout_measured_path")
    head = [dict(r, run=r.get("run", old_run)) for r in old if r.get("case") in kinds]
    head += [dict(r, run=new_run) for r in new if r.get("case") in kinds]
    dev = next((r.get("device") for r in reversed(head) if r.get("case") == "device"), "?")
    summary = summarize(rows, dd_rows, dev, False, sum(float(r.get("seconds") or 0) for r in (*old, *new)
                                                         if r.get("case") == "summary"))
    summary["run"] = f"{old_run} + {new_run}"
    summary["runs"] = {old_run: os.path.relpath(into, ROOT) if into.startswith(ROOT) else into,
                       new_run: new_path}
    write_results(into, head, rows, dd_rows, summary)
    print_table(rows, dd_rows, summary)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="tiny configs on CPU (the plumbing; figures not comparable)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for sharded_door.jsonl/.json")
    ap.add_argument("--models", default=None, help=f"default {','.join(MODELS)} (--dry: llama,qwen2_152k)")
    ap.add_argument("--worlds", default=None, help="default 2,8,64 (--dry: 2,8)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cases", default=None, help="measure only these: 'MODELS=MODES[@WORLDS] ...' (default: "
                                                  "--models x --modes x --worlds)")
    ap.add_argument("--door", default="cases", help="cases the door is asked about: 'cases' (those measured), "
                                                    "'all' (--models x --modes x --worlds), 'none' or "
                                                    "'MODELS=MODES ...' beside the measured ones")
    ap.add_argument("--workers", type=int, default=4, help="measuring processes sharing the GPU (one case each)")
    ap.add_argument("--door-workers", type=int, default=max(1, (os.cpu_count() or 2) - 4))
    ap.add_argument("--budget-s", type=float, default=460.0, help="cases not started by then are skipped")
    ap.add_argument("--no-data-dependent", action="store_true")
    ap.add_argument("--heldout-s", type=float, default=300.0,
                    help="seconds for the measured path on the held-out torch zoo beside the rest "
                         "(estimate_measured_path.py: distmem.estimate(method='measure') per case; 0: skip)")
    ap.add_argument("--door-only", action="store_true",
                    help="ask the door about the cases and measure nothing (any machine: the door's answer is the "
                         "dry run's); its lines --merge into a results file as door answers")
    ap.add_argument("--merge", default=None, metavar="NEW.jsonl", help="put NEW's lines over --into's and stop")
    ap.add_argument("--into", default=os.path.join(ROOT, "bench", "results", "sharded_door_h200.jsonl"))
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.into)
    os.makedirs(args.out, exist_ok=True)
    out = open(os.path.join(args.out, "sharded_door.jsonl"), "w")
    import torch
    if args.door_only:  # no device measured: no "device" line, which a merge would take as the measuring one
        args.no_data_dependent, args.heldout_s = True, 0.0
        dev = "none (door only)"
        emit({"case": "door_host", "torch": torch.__version__, "cuda": torch.cuda.is_available()}, out)
    else:
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
    grid = [(m, mode, n) for m in names for n in worlds for mode in modes]
    to_measure = [c for c in parse_cases(args.cases, names, worlds) if c[0] in names] if args.cases else grid
    if args.door_only:
        to_measure, args.door = [], (args.cases or "all")
    if args.door == "cases":
        to_ask = list(to_measure)
    elif args.door == "none":  # measured only: a merge keeps the door's answers of the results file
        to_ask = []
    elif args.door == "all":
        to_ask = list(grid)
    else:
        extra = [c for c in parse_cases(args.door, names, worlds) if c[0] in names]
        to_ask = [c for c in grid if c in set(to_measure) | set(extra)]
    keys = [c for c in grid if c in set(to_measure) | set(to_ask)] + \
        [c for c in to_measure if c not in grid] + [c for c in to_ask if c not in grid and c not in to_measure]
    folder = os.path.join(args.out, "models")
    used = sorted({c[0] for c in keys}, key=list(MODELS).index)
    specs = {m: ("hf:" + write_config(m, folder, args.dry)) if MODELS[m][0] == "hf" else f"torchvision:{MODELS[m][1]['name']}"
             for m in used}
    cases = {c: {"model": c[0], "mode": c[1], "world_size": c[2], "command": door_command(c[0], specs[c[0]], c[1],
                                                                                           c[2], args.dry)}
             for c in keys}
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
    with cf.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx, max_tasks_per_child=1) as gpu, \
            cf.ThreadPoolExecutor(max_workers=args.door_workers) as cpu:
        dd_q = ctx.Queue()
        dd = None if args.no_data_dependent else ctx.Process(target=_data_dependent_child, args=(args.dry, dd_q))
        if dd is not None:
            dd.start()
        meas_f = {gpu.submit(measure_case, c[0], specs[c[0]], c[2], c[1], args.dry, fraction): c for c in to_measure}
        door_f = {cpu.submit(ask_door, cases[c], max(60.0, args.budget_s - (time.time() - T0))): c for c in to_ask}
        for f in cf.as_completed(list(meas_f)):
            c = meas_f[f]
            try:
                measured[c] = f.result()
                log(f"measured {c[0]} {c[1]} N={c[2]}: {measured[c].get('measured', measured[c].get('measure_error'))}")
            except Exception as exc:  # a worker that died: its case says so
                measured[c] = {"measure_error": f"the measuring process died: {exc}"[:300]}
                log(f"measuring {c} failed: {exc}")
        for f in cf.as_completed(list(door_f)):
            c = door_f[f]
            cases[c].update(f.result())
            log(f"door {c[0]} {c[1]} N={c[2]}: {cases[c].get('door', cases[c].get('door_error'))}")
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
    for c in keys:
        r = dict(measured.get(c, {}), **{k: v for k, v in cases[c].items() if k != "command"})
        r.update(case="sharded", model=c[0], mode=c[1], world_size=c[2])
        if c in to_ask:
            r["command"] = " ".join(x if not x.startswith(ROOT) else os.path.relpath(x, ROOT)
                                    for x in cases[c]["command"][1:])
        r["error_pct"] = err(r.get("door"), r.get("measured"))
        r["point_error_pct"] = err(point_of(r), r.get("measured"))
        rows.append(r)
        emit(r, out)
    for r in dd_rows:
        r["case"] = "data_dependent"
        r["error_pct"] = err(r.get("estimate"), r.get("measured"))
        emit(r, out)
    summary = summarize(rows, dd_rows, dev, args.dry, time.time() - T0)
    emit(summary, out)
    with open(os.path.join(args.out, "sharded_door.json"), "w") as f:
        json.dump({"summary": summary, "sharded": rows, "data_dependent": dd_rows}, f, indent=1, sort_keys=True,
                  default=str)
    print_table(rows, dd_rows, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
