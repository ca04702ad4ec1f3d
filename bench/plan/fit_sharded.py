"""``distmem fit`` with sharded data parallel, proven on one GPU: its "yes" runs, its "no" runs out.

    PYTHONPATH=. python bench/plan/fit_sharded.py gpu --out bench/results/fit_sharded_h200.json   # on a GPU
    PYTHONPATH=. python bench/plan/fit_sharded.py gpu --dry                                      # the solver only (CPU)

For each (model, global batch, fleet) pair, ``distmem.fit`` searches data parallel with replicated
and sharded state (ZeRO-1, ZeRO-2, FSDP2 resharding after the forward or keeping units gathered)
x micro-batch x precision x ranks per GPU, one stage (``pipelines=[1]``: the sharded search on its
own). The chosen layout's rank 0 then trains for three real steps on this GPU as rank 0 of N
through PyTorch's fake process group (``fake_pg``: every allocation real, collectives return at
once) under its planned limit (``torch.cuda.set_per_process_memory_fraction``: the GPU emulated
smaller); the best rejected layout's binding rank trains under the most its GPU could give it.
FSDP2: ``fully_shard`` on each of the model's blocks (its top-level children) and on the root,
the parameters materialised only as shards; ZeRO-1: ``ZeroRedundancyOptimizer`` over Adam; ZeRO-2:
the same plus the gradients of parameters another rank owns freed once reduced. Each run is a fresh
process. One JSON line per pair, then the summary line: OOMs of chosen layouts (target 0), the
smallest allocated peak / limit over them (target >= 0.85) and rejected layouts that ran out of
memory (target: all), beside the OOM rate of the baseline (what a search without the memory check
runs whenever the rejected layout ranks first).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line
from bench.plan import fit as fitbench  # noqa: E402  the models, their inputs and weight init
from bench.plan import wrappers_measure  # noqa: E402  ZeRO as that bench builds it

ROOT = runner.ROOT

MiB, GiB = 1024 ** 2, 1024 ** 3


def log(msg: str) -> None:
    print(f"[fit-sharded] {msg}", file=sys.stderr, flush=True)


#: (model, global batch, fleet per host, precision): fleets too small for replicated state at the
#: batch, so the search has to weigh the shardings
PAIRS = [
    ("gpt-1b", 64, "8x16GiB", "float32"),
    ("gpt-1b", 32, "8x12GiB", "auto"),
    ("gpt-1b", 128, "8x24GiB", "mixed_bfloat16"),
    ("gpt-1b", 16, "4x16GiB", "float32"),
    ("gpt-350m", 64, "8x6GiB", "float32"),
    ("gpt-350m", 128, "4x12GiB", "auto"),
    ("gpt-350m", 32, "2x8GiB", "float32"),
    ("vgg16", 256, "8x4GiB", "float32"),
    ("vgg16", 128, "4x5GiB", "mixed_bfloat16"),
    ("gpt-350m", 64, "8x5GiB", "mixed_bfloat16"),
]


def worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Rank 0 of ``world`` under ``shard`` for ``steps`` steps under ``limit_bytes``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    name, mb, m = spec["model"], int(spec["micro_batch"]), int(spec["micro_batches"])
    shard, world = spec["shard"], int(spec["world"])
    mixed = spec["precision"] != "float32"
    cdt = torch.bfloat16 if spec["precision"] == "mixed_bfloat16" else torch.float16
    torch.cuda.set_device(0)
    total = torch.cuda.get_device_properties(0).total_memory
    if world > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    limit = spec.get("limit_bytes")
    if limit:
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
    peaks: List[int] = []
    traced: Optional[Dict[str, Any]] = None
    oom, err = False, None
    t0 = time.time()
    try:
        if shard.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard
            model = fitbench.build(name, "meta")
            for child in model.children():
                fully_shard(child, reshard_after_forward=shard == "fsdp2")
            fully_shard(model)
            model.to_empty(device="cuda")
            with torch.no_grad():  # each rank initialises its own shards
                for pname, prm in model.named_parameters():
                    local = prm.to_local() if hasattr(prm, "to_local") else prm
                    if local.dim() > 1:
                        local.normal_(0.0, 0.02)
                    elif pname.endswith("weight"):
                        local.fill_(1.0)
                    else:
                        local.zero_()
                for bname, buf in model.named_buffers():
                    buf.fill_(1.0) if "running_var" in bname else buf.zero_()
        else:
            model = fitbench.build(name, "cuda")
            fitbench.init_weights(model)
        model.train()
        if shard in ("zero1", "zero2"):
            opt = wrappers_measure.zero_optimizer(model, shard, torch.optim.Adam)
        else:
            opt = torch.optim.Adam(model.parameters())
        gpt = fitbench.MODELS[name][0] == "gpt"
        steps = int(spec.get("steps", 3))
        for step in range(steps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if spec.get("trace") and step == steps - 1:  # the last step's allocator trace (diagnosis)
                base = int(torch.cuda.memory_allocated())
                torch.cuda.memory._record_memory_history(max_entries=2_000_000)
            for _ in range(m):
                x, y = fitbench.sample_input(name, mb, "cuda")
                with torch.autocast("cuda", dtype=cdt, enabled=mixed):
                    out = model(x)
                loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1)) if gpt \
                    else F.cross_entropy(out.float(), y)
                loss.backward()
                del out, loss, x, y
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            peaks.append(int(torch.cuda.max_memory_allocated()))
        if spec.get("trace"):
            from bench.plan import wrappers_peak_parts

            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            traced = dict(wrappers_peak_parts.peak_parts(snap["device_traces"][0], 0), base=base)
    except torch.cuda.OutOfMemoryError as exc:
        oom, err = True, str(exc).split("\n")[0][:300]
        peaks.append(int(torch.cuda.max_memory_allocated()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"oom": oom, "error": err, "peak_allocated": max(peaks) if peaks else None, "steps_allocated": peaks,
            "limit_bytes": limit, "seconds": round(time.time() - t0, 2), "torch": torch.__version__,
            **({"trace": traced} if traced else {})}


def run_worker(spec: Dict[str, Any], timeout: int = 300) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if spec.get("expandable_segments"):  # as fit advised for this pair (FitResult.expandable_segments)
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        cp = subprocess.run([sys.executable, __file__, "worker", json.dumps(spec)], capture_output=True, text=True,
                            timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"oom": None, "error": f"worker ran past {timeout} s"}
    lines = [line for line in cp.stdout.strip().splitlines() if line.startswith("{")]
    if cp.returncode != 0 or not lines:
        return {"oom": None, "error": f"worker exit {cp.returncode}: {cp.stderr[-1500:]}"}
    return json.loads(lines[-1])


def spec_of(name: str, cand: Any, limit: int, expandable: bool = False) -> Dict[str, Any]:
    lay = cand.layout
    return {"model": name, "micro_batch": lay.micro_batch, "micro_batches": lay.accumulation,
            "precision": lay.precision, "shard": lay.shard, "world": lay.data_parallel,
            "limit_bytes": int(limit), "steps": 3, "expandable_segments": bool(expandable)}


def run_gpu(out: Optional[str], pairs: List[Tuple[Any, ...]], parallel: int, dry: bool) -> Dict[str, Any]:
    import torch

    import distmem

    t_all = time.time()
    rows: List[Dict[str, Any]] = []
    jobs: List[Tuple[int, str, Dict[str, Any]]] = []
    tables: List[str] = []
    for idx, (name, B, fleet, precision) in enumerate(pairs):
        precs = ["float32", "mixed_bfloat16"] if precision == "auto" else [precision]
        t = time.time()
        model = fitbench.build(name, "meta")
        # the door, as a user asks it; FSDP2 units said as the worker wraps them (every top-level child)
        res = distmem.fit(model, global_batch_size=B, gpus=fleet, precision=precision, optimizer=torch.optim.Adam,
                          input_shape=fitbench.input_shape(name) if fitbench.MODELS[name][0] != "gpt" else None,
                          estimate_batch_size=2, device="cuda", estimate="model", name=name, pipelines=[1],
                          shardings="auto", units=[n for n, _ in model.named_children()], top=3, rejected=8)
        tables.append(res.table())
        row: Dict[str, Any] = {"model": name, "global_batch_size": B, "fleet": fleet, "precision": precision,
                               "fit_seconds": round(time.time() - t, 2), "searched": res.searched,
                               "evaluated": res.evaluated, "expandable_segments": res.expandable_segments}
        xs = res.expandable_segments  # every run of the pair as fit advised (the rejected ones too)
        if res.chosen is not None:
            ch, h = res.chosen, res.chosen.heaviest
            row["chosen"] = {"layout": ch.layout.describe(), "shard": ch.layout.shard or None,
                             "estimated_peak": h.allocator_bytes, "limit": h.planned_bytes, "share": h.share_bytes}
            jobs.append((idx, "chosen", spec_of(name, ch, h.planned_bytes, xs)))
            jobs.append((idx, "unlimited", dict(spec_of(name, ch, h.planned_bytes, xs), limit_bytes=0)))
        if res.rejected:
            rj = next((r for r in res.rejected if r.layout.ranks_per_gpu == 1), res.rejected[0])
            b = rj.binding
            row["rejected"] = {"layout": rj.layout.describe(), "shard": rj.layout.shard or None,
                               "estimated_peak": b.allocator_bytes, "needs": b.planned_bytes, "share": b.share_bytes}
            if b.share_bytes > 0:
                jobs.append((idx, "rejected", spec_of(name, rj, b.share_bytes, xs)))
            # the best rejected sharded layout too: the sharding's rule is tight, not only safe
            rs = next((r for r in res.rejected if r.layout.shard and r.layout.ranks_per_gpu == 1
                       and r.layout != rj.layout), None)
            if rs is not None and rs.binding.share_bytes > 0:
                row["rejected_sharded"] = {"layout": rs.layout.describe(), "shard": rs.layout.shard,
                                           "estimated_peak": rs.binding.allocator_bytes,
                                           "needs": rs.binding.planned_bytes, "share": rs.binding.share_bytes}
                jobs.append((idx, "rejected_sharded", spec_of(name, rs, rs.binding.share_bytes, xs)))
        log(f"{name} B={B} {fleet} {precision}: chosen {row.get('chosen', {}).get('layout')}; "
            f"rejected {row.get('rejected', {}).get('layout')} ({row['fit_seconds']} s)")
        rows.append(row)
    if dry:
        for t in tables:
            print(t)
        jobs = []

    fitbench.run_jobs(rows, jobs, run_worker, parallel,
                      describe=lambda spec: (f" B={spec['micro_batch'] * spec['micro_batches'] * spec['world']} "
                                             f"({spec['shard'] or 'replicated'} over {spec['world']}, micro-batch "
                                             f"{spec['micro_batch']} x {spec['micro_batches']})"))
    summary = fitbench.summarize(rows, time.time() - t_all, torch)
    sharded_rejected = [r["runs"]["rejected_sharded"] for r in rows if "rejected_sharded" in r.get("runs", {})]
    summary.update(bench="fit_sharded", chosen_sharded=sum(1 for r in rows if r.get("chosen", {}).get("shard")),
                   rejected_sharded_runs=len(sharded_rejected),
                   rejected_sharded_ooms=sum(1 for r in sharded_rejected if r.get("oom")),
                   search="data parallel x {replicated, zero1, zero2, fsdp2, fsdp2_keep} x micro-batch x precision "
                          "x ranks per GPU (pipelines=[1])")
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(summary))
    if out:
        with open(out, "w") as f:
            json.dump({"summary": summary, "pairs": rows, "tables": tables}, f, indent=1)
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["gpu", "worker", "trace"],
                    help="gpu: the proof; worker SPEC: one run; trace SPEC...: runs with the last step's "
                         "allocator trace replayed to its peak (what is alive there, by maker)")
    ap.add_argument("args", nargs="*")
    ap.add_argument("--out", default=None)
    ap.add_argument("--parallel", type=int, default=3, help="workers at once on the one GPU")
    ap.add_argument("--dry", action="store_true", help="fit only, train nothing (runs on CPU)")
    ap.add_argument("--pairs", default=None, help="comma-separated indices into PAIRS")
    a = ap.parse_args(argv)
    if a.mode == "worker":
        print(json.dumps(worker(json.loads(a.args[0]))))
        return 0
    if a.mode == "trace":
        for text in a.args:
            spec = json.loads(text)
            line = json.dumps(dict(spec=spec, **run_worker(dict(spec, trace=True))))
            print(line)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(line + "\n")
        return 0
    pairs = PAIRS if not a.pairs else [PAIRS[int(i)] for i in a.pairs.split(",")]
    run_gpu(a.out, pairs, a.parallel, a.dry)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
