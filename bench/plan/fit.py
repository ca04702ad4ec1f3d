"""``distmem fit``'s proof: the solver's "yes" runs and its "no" runs out of memory.

    python bench/plan/fit.py outside --out bench/results/outside_allocator_h200.json   # on a GPU: memory outside torch
    python bench/plan/fit.py gpu --out bench/results/fit_h200.json                     # on a GPU: >= 8 (model, fleet) pairs
    python bench/plan/fit.py cpu --out bench/results/fit_cpu.json                      # Keras path + solver speed, on CPU

``gpu``: for each (model, global batch, fleet) pair, ``distmem.fit`` picks the best layout that
fits; the heaviest rank of that layout then trains for a few real steps on this GPU under its
planned limit (``torch.cuda.set_per_process_memory_fraction``: the GPU emulated smaller), and
the best rejected layout's binding rank trains under the most its GPU could give it. A pipeline
stage runs alone: its slice of the model's blocks with the micro-batches its schedule keeps in
flight (1F1B: forward ``in_flight``, then one backward per forward). Each run is a fresh
process. One JSON line per pair, then a summary line: OOMs of chosen layouts (target 0), the
smallest allocated-peak / limit over them (target >= 0.85) and rejected layouts that ran out of
memory.

``outside``: NVML's memory for this process minus torch's reserved bytes, for a bare CUDA
context, after a matmul (cuBLAS), after a convolution forward + backward (cuDNN), and with a
one-rank NCCL process group of 1, 2 and 3 communicators, at the default NCCL_BUFFSIZE and at
2 MiB. Each case runs in a fresh process.

``cpu``: the Keras path (TensorFlow's CPU allocator peak of the chosen layout's training step
against its planned limit, and of the best rejected one against its share), and the solver's
speed on a 200-layer model over 64 and 1,024 GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT

MiB = 1024 ** 2
GiB = 1024 ** 3


def log(msg: str) -> None:
    print(f"[fit-bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ models: nn.Sequential of blocks

#: name -> (kind, options)
MODELS = {
    "resnet50": ("resnet", {"depth": 50}),
    "resnet18": ("resnet", {"depth": 18}),
    "vgg16": ("vgg", {}),
    "gpt-350m": ("gpt", {"d": 1024, "layers": 24, "heads": 16, "seq": 1024, "vocab": 32768}),
    "gpt-1b": ("gpt", {"d": 1600, "layers": 32, "heads": 25, "seq": 1024, "vocab": 32768}),
}


def classes(name: str) -> int:
    kind, opts = MODELS[name]
    return opts["vocab"] if kind == "gpt" else 1000


def sample_input(name: str, batch: int, device: str):
    """A batch of inputs and targets for ``name`` on ``device``."""
    import torch

    kind, opts = MODELS[name]
    if kind == "gpt":
        x = torch.randint(0, opts["vocab"], (batch, opts["seq"]), device=device)
        return x, torch.randint(0, opts["vocab"], (batch, opts["seq"]), device=device)
    return torch.randn(batch, 3, 224, 224, device=device), torch.randint(0, 1000, (batch,), device=device)


def _resnet(depth: int):
    import torch.nn as nn
    import torchvision

    tv = getattr(torchvision.models, f"resnet{depth}")(weights=None)
    parts: "OrderedDict[str, Any]" = OrderedDict()
    parts["stem"] = nn.Sequential(tv.conv1, tv.bn1, tv.relu, tv.maxpool)
    for li in range(1, 5):
        for bi, block in enumerate(getattr(tv, f"layer{li}")):
            parts[f"layer{li}_{bi}"] = block
    parts["pool"] = nn.Sequential(tv.avgpool, nn.Flatten())
    parts["fc"] = tv.fc
    return nn.Sequential(parts)


def _vgg():
    import torch.nn as nn
    import torchvision

    tv = torchvision.models.vgg16(weights=None)
    parts: "OrderedDict[str, Any]" = OrderedDict()
    convs = list(tv.features)
    k = 0
    # one block per conv (+ its ReLU, + a following pool), so cuts fall between convolutions
    i = 0
    while i < len(convs):
        group = [convs[i]]
        i += 1
        while i < len(convs) and not isinstance(convs[i], nn.Conv2d):
            group.append(convs[i])
            i += 1
        parts[f"conv{k}"] = nn.Sequential(*group)
        k += 1
    parts["pool"] = nn.Sequential(tv.avgpool, nn.Flatten())
    cls = list(tv.classifier)
    parts["fc0"] = nn.Sequential(*cls[0:3])
    parts["fc1"] = nn.Sequential(*cls[3:6])
    parts["fc2"] = cls[6]
    return nn.Sequential(parts)


def _gpt(d: int, layers: int, heads: int, seq: int, vocab: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            return self.tok(idx) + self.pos(pos)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.out = nn.Linear(d, vocab, bias=False)

        def forward(self, x):
            return self.out(self.ln(x))

    class GPT(nn.Sequential):
        def example_input(self, batch):  # the estimator's hook: token ids
            return torch.zeros((batch, seq), dtype=torch.long)

    parts: "OrderedDict[str, Any]" = OrderedDict()
    parts["embed"] = Embed()
    for i in range(layers):
        parts[f"block{i}"] = Block()
    parts["head"] = Head()
    return GPT(parts)


def build(name: str, device: str = "meta"):
    """The model ``name`` built on ``device`` (``meta``: no memory, for the estimator)."""
    import torch

    kind, opts = MODELS[name]
    with torch.device(device):
        if kind == "resnet":
            return _resnet(opts["depth"])
        if kind == "vgg":
            return _vgg()
        return _gpt(**opts)


def input_shape(name: str) -> Tuple[int, ...]:
    kind, opts = MODELS[name]
    return (opts["seq"],) if kind == "gpt" else (3, 224, 224)


# ------------------------------------------------------------------ memory outside the allocator

def outside_case(buffsize: Optional[int]) -> Dict[str, Any]:
    """One fresh process: NVML's figures after each step, minus torch's reserved bytes."""
    if buffsize:
        os.environ["NCCL_BUFFSIZE"] = str(buffsize)
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def device_used() -> int:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)

    def process_used() -> Optional[int]:
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
        return None

    base = device_used()
    import torch
    import torch.distributed as dist

    rows: List[Dict[str, Any]] = []

    def record(stage: str) -> None:
        torch.cuda.synchronize()
        time.sleep(0.3)  # NVML's per-process figure lags the allocation a little
        used, proc, reserved = device_used(), process_used(), int(torch.cuda.memory_reserved())
        rows.append({"stage": stage, "device_used_delta": used - base, "process_used": proc,
                     "torch_reserved": reserved, "outside_bytes": (proc if proc is not None else used - base) - reserved,
                     "outside_device_delta_bytes": used - base - reserved})
        log(f"outside buffsize={buffsize}: {stage}: {rows[-1]['outside_bytes'] / MiB:.0f} MiB outside the allocator")

    torch.cuda.init()
    x = torch.ones(1, device="cuda")
    record("cuda_context")
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum().item()
    record("after_cublas")
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
    inp = torch.randn(8, 64, 56, 56, device="cuda", requires_grad=True)
    conv(inp).sum().backward()
    record("after_cudnn")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    record("nccl_1_communicator")
    groups = []
    for n in (2, 3):
        g = dist.new_group([0])
        groups.append(g)
        dist.all_reduce(t, group=g)
        record(f"nccl_{n}_communicators")
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
            "driver": pynvml.nvmlSystemGetDriverVersion(), "nccl_buffsize": buffsize}
    dist.destroy_process_group()
    del x, a, conv, inp, t
    return {"env": info, "rows": rows}


def run_outside(out: Optional[str]) -> Dict[str, Any]:
    cases = []
    for buffsize in (None, 2097152):
        for rep in range(2):
            cp = subprocess.run([sys.executable, __file__, "outside-case", "--buffsize", str(buffsize or 0)],
                                capture_output=True, text=True, timeout=180)
            if cp.returncode != 0:
                raise SystemExit(f"outside case failed: {cp.stderr[-2000:]}")
            case = json.loads(cp.stdout.strip().splitlines()[-1])
            case["repeat"] = rep
            cases.append(case)
    by = {}
    for c in cases:
        key = c["env"]["nccl_buffsize"] or "default"
        for r in c["rows"]:
            by.setdefault(f"{key}:{r['stage']}", []).append(r["outside_bytes"])
    med = {k: max(v) for k, v in by.items()}  # the larger of the repeats: a plan must cover it
    d = "default:"
    summary = {
        "context_bytes": med[d + "cuda_context"],
        "cublas_bytes": med[d + "after_cublas"] - med[d + "cuda_context"],
        "cudnn_bytes": med[d + "after_cudnn"] - med[d + "after_cublas"],
        "nccl_first_bytes": med[d + "nccl_1_communicator"] - med[d + "after_cudnn"],
        "nccl_next_bytes": max(med[d + "nccl_2_communicators"] - med[d + "nccl_1_communicator"],
                               med[d + "nccl_3_communicators"] - med[d + "nccl_2_communicators"]),
        "nccl_first_bytes_buffsize_2MiB": med["2097152:nccl_1_communicator"] - med["2097152:after_cudnn"],
        "nccl_next_bytes_buffsize_2MiB": max(
            med["2097152:nccl_2_communicators"] - med["2097152:nccl_1_communicator"],
            med["2097152:nccl_3_communicators"] - med["2097152:nccl_2_communicators"]),
    }
    summary["without_nccl_bytes"] = med[d + "after_cudnn"]
    summary["with_3_communicators_bytes"] = med[d + "nccl_3_communicators"]
    result = {"bench": "outside_allocator", "measured": "NVML per-process used memory minus "
              "torch.cuda.memory_reserved(), each case a fresh process, larger of 2 repeats",
              "env": cases[0]["env"], "summary": summary, "summary_mib": {k: round(v / MiB, 1) for k, v in summary.items()},
              "note": "one GPU: a one-rank NCCL group has no peers, so buffers towards peers (NCCL_BUFFSIZE x "
                      "channels x peers) are not in these figures; they need two GPUs (issue 19)",
              "cases": cases}
    print(json.dumps({k: result[k] for k in ("bench", "summary_mib", "env")}))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


# ------------------------------------------------------------------ one rank's training steps

def init_weights(module) -> None:
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
        for name, b in module.named_buffers():
            if "running_var" in name:
                b.fill_(1.0)
            else:
                b.zero_()


def worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Train one rank (a stage: blocks [start, stop)) for ``steps`` steps under ``limit_bytes``."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    name, mb = spec["model"], int(spec["micro_batch"])
    start, stop = int(spec["start"]), int(spec["stop"])
    in_flight, m = int(spec["in_flight"]), int(spec["micro_batches"])
    mixed = spec["precision"] != "float32"
    cdt = torch.bfloat16 if spec["precision"] == "mixed_bfloat16" else torch.float16
    dev = spec.get("device", "cuda")
    cuda = dev == "cuda"
    total = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    meta = build(name, "meta")
    children = list(meta.children())
    last = stop == len(children)
    # the stage's input shape from a forward of the blocks before it on the meta device
    x_meta, _ = sample_input(name, mb, "meta")
    with torch.no_grad():
        h = x_meta
        for c in children[:start]:
            h = c(h)
    in_shape, in_dtype = tuple(h.shape), h.dtype
    if start > 0 and mixed:
        # what dtype the stage receives under autocast: run the blocks before it once, for real, at
        # micro-batch 1, before any limit is set (the meta device does not autocast)
        prefix = build(name, dev)
        init_weights(prefix)
        with torch.no_grad(), torch.autocast(dev, dtype=cdt):
            hh = sample_input(name, 1, dev)[0]
            for c in list(prefix.children())[:start]:
                hh = c(hh)
        in_dtype = hh.dtype
        del prefix, hh
        if cuda:
            torch.cuda.empty_cache()
    stage = nn.Sequential(*children[start:stop])
    stage.to_empty(device=dev)
    init_weights(stage)
    stage.train()
    opt = torch.optim.Adam(stage.parameters())
    limit = spec.get("limit_bytes")
    if limit and cuda:
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
    n_classes = classes(name)

    def make_input():
        if start == 0:
            x, y = sample_input(name, mb, dev)
            return x, y
        x = torch.randn(in_shape, device=dev, dtype=in_dtype).requires_grad_(True)
        y = torch.randint(0, n_classes, (mb,) if MODELS[name][0] != "gpt" else (mb, MODELS[name][1]["seq"]),
                          device=dev)
        return x, y

    def forward(x):
        with torch.autocast(dev, dtype=cdt, enabled=mixed):
            if spec.get("recompute"):
                return checkpoint(stage, x, use_reentrant=False)
            return stage(x)

    def backward(out, y):
        if last:
            loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
        else:
            out.backward(torch.randn_like(out))

    peaks, reserved, oom, err = [], [], False, None
    t0 = time.time()
    try:
        for _ in range(int(spec.get("steps", 3))):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            pending = []
            for i in range(m):
                x, y = make_input()
                pending.append((x, forward(x), y))
                if len(pending) == in_flight:
                    xx, out, yy = pending.pop(0)
                    backward(out, yy)
                    del xx, out, yy
            while pending:
                xx, out, yy = pending.pop(0)
                backward(out, yy)
                del xx, out, yy
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            peaks.append(int(torch.cuda.max_memory_allocated()) if cuda else 0)
            reserved.append(int(torch.cuda.max_memory_reserved()) if cuda else 0)
    except torch.cuda.OutOfMemoryError as exc:
        oom, err = True, str(exc).split("\n")[0][:300]
        peaks.append(int(torch.cuda.max_memory_allocated()))
        reserved.append(int(torch.cuda.max_memory_reserved()))
    return {"oom": oom, "error": err, "peak_allocated": max(peaks) if peaks else None,
            "peak_reserved": max(reserved) if reserved else None, "steps_allocated": peaks,
            "limit_bytes": limit, "seconds": round(time.time() - t0, 2), "torch": torch.__version__}


def run_worker(spec: Dict[str, Any], timeout: int = 240) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cp = subprocess.run([sys.executable, __file__, "worker", json.dumps(spec)], capture_output=True, text=True,
                        timeout=timeout, env=env)
    lines = [l for l in cp.stdout.strip().splitlines() if l.startswith("{")]
    if cp.returncode != 0 or not lines:
        return {"oom": None, "error": f"worker exit {cp.returncode}: {cp.stderr[-1500:]}"}
    return json.loads(lines[-1])


# ------------------------------------------------------------------ the pairs

#: (model, global batch, fleet per host, hosts, precision)
PAIRS = [
    ("resnet50", 512, "4x12GiB", 1, "float32"),
    ("resnet50", 256, "8x6GiB", 1, "auto"),
    ("resnet18", 1024, "4x16GiB", 1, "auto"),
    ("vgg16", 256, "4x16GiB", 1, "float32"),
    ("gpt-350m", 64, "4x16GiB", 1, "float32"),
    ("gpt-350m", 128, "8x24GiB", 1, "auto"),
    ("gpt-1b", 32, "4x16GiB", 1, "float32"),
    ("gpt-1b", 64, "8x24GiB", 1, "auto"),
    ("gpt-1b", 32, "8x12GiB", 1, "mixed_bfloat16"),
    ("gpt-1b", 16, "8x8GiB", 1, "float32"),
    ("resnet50", 128, "2x6GiB", 1, "float32"),
]


def stage_spec(name: str, cand: Any, stage: Any, limit: int, costs: Any) -> Dict[str, Any]:
    lay = cand.layout
    spec = {"model": name, "micro_batch": lay.micro_batch, "start": stage.first_block, "stop": stage.stop_block,
            "in_flight": stage.in_flight if lay.pipeline > 1 else 1, "micro_batches": lay.accumulation,
            "precision": lay.precision, "recompute": bool(lay.recompute), "limit_bytes": int(limit), "steps": 3}
    return spec


def summarize(rows: List[Dict[str, Any]], seconds: float, torch: Any) -> Dict[str, Any]:
    """The bench's summary line over every pair's runs."""
    chosen_runs = [r["runs"]["chosen"] for r in rows if "chosen" in r.get("runs", {})]
    unlimited = [r["runs"]["unlimited"] for r in rows if "estimate_error" in r.get("runs", {}).get("unlimited", {})]
    rejected_runs = [r["runs"]["rejected"] for r in rows if "rejected" in r.get("runs", {})]
    summary = {
        "bench": "fit", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "pairs": len(rows), "chosen_runs": len(chosen_runs),
        "chosen_ooms": sum(1 for r in chosen_runs if r.get("oom") is not False),
        "min_peak_over_limit": min((r.get("peak_over_limit", 0) for r in chosen_runs), default=None),
        "mean_peak_over_limit": round(sum(r.get("peak_over_limit", 0) for r in chosen_runs) / max(len(chosen_runs), 1), 4),
        "pairs_passing": sum(1 for r in rows if r.get("runs", {}).get("chosen", {}).get("oom") is False
                             and r["runs"]["chosen"].get("peak_over_limit", 0) >= 0.85
                             and r["runs"].get("rejected", {}).get("oom")),
        "failed_pairs": [f"{r['model']} B={r['global_batch_size']} {r['fleet']}: chosen rank "
                         + ("ran out of memory" if r.get("runs", {}).get("chosen", {}).get("oom") else "passed")
                         + ("" if r.get("runs", {}).get("rejected", {}).get("oom") else ", rejected rank did not")
                         for r in rows if not (r.get("runs", {}).get("chosen", {}).get("oom") is False
                                               and r["runs"].get("rejected", {}).get("oom"))],
        "rejected_runs": len(rejected_runs), "rejected_ooms": sum(1 for r in rejected_runs if r.get("oom")),
        "estimate_error_unlimited": {"mean_abs": round(sum(abs(r["estimate_error"]) for r in unlimited)
                                                       / max(len(unlimited), 1), 4),
                                     "worst_under": min((r["estimate_error"] for r in unlimited), default=None)},
        "sweep": "each chosen rank also ran under its estimated peak alone (sweep_1.00): an OOM there shows the "
                 "headroom is needed",
        "sweep_ooms": sum(1 for r in rows if r.get("runs", {}).get("sweep_1.00", {}).get("oom")),
        "targets": {"chosen_ooms": 0, "min_peak_over_limit": 0.85},
        "baseline": "the best rejected layout's binding rank under its GPU's share (the 'rejected' run): what a "
                    "search without the memory check runs whenever that layout ranks above the chosen one",
        "ours_oom_rate": round(sum(1 for r in chosen_runs if r.get("oom") is not False) / max(len(chosen_runs), 1), 4),
        "baseline_oom_rate": round(sum(1 for r in rejected_runs if r.get("oom")) / max(len(rejected_runs), 1), 4),
        "seconds": round(seconds, 1),
    }
    return summary


def run_jobs(rows: List[Dict[str, Any]], jobs: List[Tuple[int, str, Dict[str, Any]]], runner: Any, parallel: int,
             describe: Any = None) -> None:
    """Run every ``(pair, what, spec)`` job, ``parallel`` at once on the GPU, and book each result in
    ``rows[pair]["runs"][what]``: the result with its spec, the allocated peak over the limit (a
    limited run), and the error of the estimate booked under ``rows[pair]["chosen"]`` (or under
    ``what`` itself for a ``rejected*`` run) where the run did not run out of memory.
    ``describe(spec)``: more words for the progress line."""
    def go(job):
        idx, what, spec = job
        r = runner(spec)
        if os.environ.get("FIT_RUNS_LOG"):  # every run as it ends, so a killed bench still leaves its data
            with open(os.environ["FIT_RUNS_LOG"], "a") as f:
                f.write(json.dumps({"pair": idx, "what": what, "spec": spec, "result": r}) + "\n")
        log(f"  {rows[idx]['model']} {what}{describe(spec) if describe else ''}: oom={r.get('oom')} "
            f"peak={(r.get('peak_allocated') or 0) / GiB:.2f} GiB limit={spec['limit_bytes'] / GiB:.2f} GiB "
            f"{r.get('error') or ''}")
        return idx, what, spec, r

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for idx, what, spec, r in pool.map(go, jobs):
            rec = dict(r, spec=spec)
            if r.get("peak_allocated") and spec["limit_bytes"]:  # an unlimited run (limit 0) has no ratio
                rec["peak_over_limit"] = round(r["peak_allocated"] / spec["limit_bytes"], 4)
            est = rows[idx].get(what if what.startswith("rejected") else "chosen", {}).get("estimated_peak")
            if est and r.get("peak_allocated") and not r.get("oom"):
                rec["estimate_error"] = round(est / r["peak_allocated"] - 1, 4)
            rows[idx].setdefault("runs", {})[what] = rec


def run_gpu(out: Optional[str], pairs: List[Tuple[Any, ...]], sweep: bool, parallel: int,
            dry: bool = False, merge: Optional[str] = None) -> Dict[str, Any]:
    import distmem
    import torch

    t_all = time.time()
    rows: List[Dict[str, Any]] = []
    jobs: List[Tuple[int, str, Dict[str, Any]]] = []
    fits = []
    for idx, (name, B, fleet, hosts, precision) in enumerate(pairs):
        precs = ["float32", "mixed_bfloat16"] if precision == "auto" else [precision]
        t = time.time()
        model = build(name, "meta")
        n_children = len(list(model.children()))
        res = distmem.fit(model, global_batch_size=B, gpus=fleet, hosts=hosts, precision=precision,
                          optimizer=torch.optim.Adam, input_shape=input_shape(name) if MODELS[name][0] != "gpt" else None,
                          estimate_batch_size=2, device="cuda", estimate="model", name=name, top=3, rejected=8)
        costs = res.costs
        nblocks = len(costs[precs[0]].block_names)
        fit_s = time.time() - t
        log(f"{name} B={B} {hosts}x{fleet}: {nblocks} blocks ({n_children} children), fit in {fit_s:.1f} s; "
            f"chosen {res.chosen.layout.describe() if res.chosen else None}")
        if nblocks != n_children:
            raise SystemExit(f"{name}: {nblocks} blocks but {n_children} top-level children; cuts would not match")
        row = {"model": name, "global_batch_size": B, "fleet": fleet, "hosts": hosts, "precision": precision,
               "fit_seconds": round(fit_s, 2), "searched": res.searched, "evaluated": res.evaluated}
        fits.append((res, costs))
        if res.chosen is not None:
            ch = res.chosen
            h = ch.heaviest
            row["chosen"] = {"layout": ch.layout.describe(), "stage": h.stage, "blocks": [h.first_block, h.stop_block],
                             "in_flight": h.in_flight, "estimated_peak": h.allocator_bytes, "limit": h.planned_bytes,
                             "share": h.share_bytes}
            jobs.append((idx, "chosen", stage_spec(name, ch, h, h.planned_bytes, costs)))
            # the same rank with no limit: its true allocator peak, to score the estimate
            jobs.append((idx, "unlimited", dict(stage_spec(name, ch, h, h.planned_bytes, costs), limit_bytes=0)))
            if sweep:
                for f in (1.0,):
                    lim = int(-(-int(h.allocator_bytes * f) // MiB) * MiB)
                    jobs.append((idx, f"sweep_{f:.2f}", stage_spec(name, ch, h, lim, costs)))
        if res.rejected:
            # the best rejected layout with one rank per GPU (a shared GPU's tiny share fails trivially)
            rj = next((r for r in res.rejected if r.layout.ranks_per_gpu == 1), res.rejected[0])
            b = rj.binding
            row["rejected"] = {"layout": rj.layout.describe(), "stage": b.stage, "blocks": [b.first_block, b.stop_block],
                               "in_flight": b.in_flight, "estimated_peak": b.allocator_bytes,
                               "needs": b.planned_bytes, "share": b.share_bytes}
            if b.share_bytes > 0:
                jobs.append((idx, "rejected", stage_spec(name, rj, b, b.share_bytes, costs)))
        rows.append(row)

    if dry:  # the solver's side only (CPU): choices and timings, no training
        for res, _ in fits:
            print(res.table())
        jobs = []

    run_jobs(rows, jobs, run_worker, parallel)
    tables = [res.table() for res, _ in fits]
    if merge:
        # re-ran pairs replace theirs in an earlier result; the others stay as they were measured
        with open(merge) as f:
            old = json.load(f)
        keep = {(p["model"], p["global_batch_size"], p["fleet"]): (p, t) for p, t in zip(old["pairs"], old["tables"])}
        for r, t in zip(rows, tables):
            keep[(r["model"], r["global_batch_size"], r["fleet"])] = (dict(r, rerun=True), t)
        order = [(p[0], p[1], p[2]) for p in PAIRS]
        rows = [keep[k][0] for k in order if k in keep]
        tables = [keep[k][1] for k in order if k in keep]
    summary = summarize(rows, time.time() - t_all, torch)
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(summary))
    if out:
        with open(out, "w") as f:
            json.dump({"summary": summary, "pairs": rows, "tables": tables}, f, indent=1)
    return summary


# ------------------------------------------------------------------ CPU: the Keras path and the solver's speed

KERAS_PAIRS = [("MobileNetV2", 256, "4x700MiB"), ("TransformerEncoder", 512, "4x2GiB"), ("MLP", 16384, "8x256MiB")]


def keras_measure(name: str, batch: int) -> Dict[str, Any]:
    # TensorFlow keeps CPU allocator statistics only with its BFC allocator on CPU (read at start)
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    from bench.estimate import estimate_accuracy as ea  # the accuracy bench's zoo and its CPU allocator measurement

    r = ea.tf_measure(name, batch, 3)
    return {"peak": max(r["peaks"]), "peaks": r["peaks"]}


def run_keras(pairs: List[Tuple[str, int, str]]) -> List[Dict[str, Any]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # the calibration step reads CPU allocator stats
    from bench.estimate import estimate_accuracy as ea
    import tensorflow as tf
    import distmem

    rows = []
    for name, B, fleet in pairs:
        model, _ = ea.tf_model(name)
        # the door as a user asks it on this machine: its default estimate (measured where it can:
        # on the CPU, TensorFlow's CPU allocator). On CPU nothing lives outside TensorFlow's
        # allocator and no reserve is kept: the limit is the allocator peak plus TensorFlow's 10%
        # headroom, held against the declared share.
        res = distmem.fit(model, global_batch_size=B, gpus=fleet, precision="float32",
                          optimizer=tf.keras.optimizers.Adam(), estimate_batch_size=8, device="cpu",
                          name=f"keras:{name}", framework="tensorflow", overhead=0, reserve=0, pipelines=[1],
                          ranks_per_gpu=[1], micro_batches=None, top=3, rejected=3)
        row: Dict[str, Any] = {"model": f"keras:{name}", "global_batch_size": B, "fleet": fleet,
                               "device": "cpu (TensorFlow CPU allocator)"}
        ch = res.chosen
        if ch is not None:
            h = ch.heaviest
            cp = subprocess.run([sys.executable, __file__, "keras-worker", name, str(ch.layout.micro_batch)],
                                capture_output=True, text=True, timeout=600)
            m = json.loads(cp.stdout.strip().splitlines()[-1])
            # one micro-step is measured; accumulation adds the gradients kept between micro-steps
            acc = h.breakdown.get("accumulated gradients", 0)
            measured = m["peak"] + acc
            row["chosen"] = {"layout": ch.layout.describe(), "estimated_peak": h.allocator_bytes,
                             "limit": h.planned_bytes, "measured_peak": measured, "measured_micro_step_peak": m["peak"],
                             "accumulated_gradients_added": acc,
                             "peak_over_limit": round(measured / h.planned_bytes, 4),
                             "would_oom": measured > h.planned_bytes}
        if res.rejected:
            rj = res.rejected[0]
            b = rj.binding
            cp = subprocess.run([sys.executable, __file__, "keras-worker", name, str(rj.layout.micro_batch)],
                                capture_output=True, text=True, timeout=600)
            m = json.loads(cp.stdout.strip().splitlines()[-1])
            acc = b.breakdown.get("accumulated gradients", 0)
            measured = m["peak"] + acc
            row["rejected"] = {"layout": rj.layout.describe(), "estimated_peak": b.allocator_bytes,
                               "share": b.share_bytes, "measured_peak": measured,
                               "measured_over_share": round(measured / max(b.share_bytes, 1), 4),
                               "would_oom": measured > b.share_bytes}
        row["table"] = res.table()
        log(f"keras {name}: chosen {row.get('chosen')}, rejected {row.get('rejected')}")
        rows.append(row)
    return rows


def synthetic_layers(n: int = 200):
    """A 200-layer model: transformer-like blocks of varying width (bytes at batch 1), as the JSON
    rows ``fit(layers=...)`` and ``distmem fit --layers FILE`` take."""
    out = []
    for i in range(n):
        w = 1 + (i % 5)
        out.append({"name": f"l{i}", "state_bytes": w * 256 * MiB, "activation_bytes": w * 24 * MiB,
                    "output_bytes": 8 * MiB})
    return out


def run_speed() -> List[Dict[str, Any]]:
    from distmem import fit

    layers = synthetic_layers(200)
    rows = []
    for gpus, hosts, B, target in (("8x80GiB", 8, 2048, 2.0), ("8x80GiB", 128, 8192, 10.0)):
        t = time.perf_counter()
        res = fit(layers=layers, layers_batch_size=1, global_batch_size=B, gpus=gpus, hosts=hosts,
                  precision="float32")
        ours = time.perf_counter() - t
        row = {"bench": "fit_speed", "layers": 200, "gpus": 8 * hosts, "global_batch_size": B,
               "seconds": round(ours, 3), "target_seconds": target, "searched": res.searched,
               "evaluated": res.evaluated, "chosen": res.chosen.layout.describe() if res.chosen else None}
        if hosts == 8:
            # the peer: price every layout (no best-first stop), as an exhaustive search would
            t = time.perf_counter()
            full = fit(layers=layers, layers_batch_size=1, global_batch_size=B, gpus=gpus, hosts=hosts,
                       precision="float32", top=10 ** 9, rejected=10 ** 9)
            row["exhaustive_seconds"] = round(time.perf_counter() - t, 3)
            row["exhaustive_evaluated"] = full.evaluated
            row["speedup"] = round(row["exhaustive_seconds"] / max(ours, 1e-9), 2)
            row["same_choice"] = (full.chosen.layout == res.chosen.layout) if full.chosen and res.chosen else None
        print(json.dumps(row))
        rows.append(row)
    return rows


def run_cpu(out: Optional[str]) -> None:
    speed = run_speed()
    keras = run_keras(KERAS_PAIRS)
    for r in keras:
        print(json.dumps({k: v for k, v in r.items() if k != "table"}))
    summary = {"bench": "fit_cpu", "keras_pairs": len(keras),
               "keras_chosen_within_limit": sum(1 for r in keras if r.get("chosen") and not r["chosen"]["would_oom"]),
               "keras_min_peak_over_limit": min((r["chosen"]["peak_over_limit"] for r in keras if r.get("chosen")),
                                                default=None),
               "keras_rejected_over_share": sum(1 for r in keras if r.get("rejected") and r["rejected"]["would_oom"]),
               "speed": [{k: r[k] for k in ("gpus", "seconds", "target_seconds")} for r in speed],
               "python": platform.python_version()}
    print(json.dumps(summary))
    if out:
        with open(out, "w") as f:
            json.dump({"summary": summary, "speed": speed, "keras": keras}, f, indent=1)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["outside", "outside-case", "worker", "gpu", "cpu", "keras-worker", "speed",
                                       "resummarize"])
    ap.add_argument("args", nargs="*")
    ap.add_argument("--out", default=None)
    ap.add_argument("--buffsize", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="gpu: also run each chosen rank under its estimated peak alone (no headroom)")
    ap.add_argument("--parallel", type=int, default=3, help="gpu: workers at once on the one GPU")
    ap.add_argument("--merge", default=None, help="gpu: an earlier result whose other pairs to keep")
    ap.add_argument("--dry", action="store_true", help="gpu: fit only, train nothing (runs on CPU)")
    ap.add_argument("--pairs", default=None, help="gpu: comma-separated indices into PAIRS")
    a = ap.parse_args(argv)
    if a.mode == "outside":
        run_outside(a.out)
    elif a.mode == "outside-case":
        print(json.dumps(outside_case(a.buffsize or None)))
    elif a.mode == "worker":
        print(json.dumps(worker(json.loads(a.args[0]))))
    elif a.mode == "keras-worker":
        print(json.dumps(keras_measure(a.args[0], int(a.args[1]))))
    elif a.mode == "gpu":
        pairs = PAIRS if not a.pairs else [PAIRS[int(i)] for i in a.pairs.split(",")]
        run_gpu(a.out, pairs, a.sweep, a.parallel, a.dry, a.merge)
    elif a.mode == "resummarize":  # the summary of a saved result again (after the summary changed)
        import torch

        with open(a.args[0]) as f:
            saved = json.load(f)
        old = saved["summary"]
        saved["summary"] = dict(summarize(saved["pairs"], old.get("seconds", 0), torch),
                                device=old.get("device"), torch=old.get("torch"))
        with open(a.args[0], "w") as f:
            json.dump(saved, f, indent=1)
        print(json.dumps(saved["summary"]))
    elif a.mode == "speed":
        run_speed()
    else:
        run_cpu(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
