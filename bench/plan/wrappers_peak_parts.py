"""What is alive at a wrapper's peak, from the CUDA allocator's own trace (a diagnostic beside
``bench/plan/wrappers_measure.py``, on a GPU):

    PYTHONPATH=. python bench/plan/wrappers_peak_parts.py --cases gpt-12l-1024:fsdp2:64,vit_b_16:ddp:1 --out FILE

Each case trains the model of ``wrappers_measure.py`` for three steps with
``torch.cuda.memory._record_memory_history`` on; the third step's trace is replayed to the
moment of its peak and the blocks alive then are summed by who made them: the first frame
inside ``torch/distributed`` (FSDP2's all-gather, its reduce-scatter, DDP's buckets), the
optimizer, autograd's backward, else the model's own frame. One JSON line per case: the peak,
the phase it fell in and the largest groups.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

MiB = 1024 ** 2


def who(frames: List[Dict[str, Any]]) -> str:
    """The allocation's maker, from its Python frames (innermost first)."""
    names = [(f.get("filename", ""), f.get("name", ""), f.get("line", 0)) for f in frames]
    for fn, name, line in names:
        if "torch/distributed" in fn:
            return f"dist:{os.path.basename(fn)}:{name}"
    for fn, name, line in names:
        if "torch/optim" in fn:
            return f"optim:{name}"
    for fn, name, line in names:
        if fn.endswith(("wrappers_measure.py", "fit.py", "wrappers_peak_parts.py")) or "site-packages" not in fn \
                and "torch/" not in fn and fn.endswith(".py"):
            return f"{os.path.basename(fn)}:{name}:{line}"
    for fn, name, line in names:
        if "transformers" in fn or "torchvision" in fn:
            return f"{os.path.basename(fn)}:{name}:{line}"
    return "other:" + (names[0][1] if names else "?")


def peak_parts(trace: List[Dict[str, Any]], start: int) -> Dict[str, Any]:
    """Replay ``trace`` from index ``start`` (the last step) to its peak: the blocks alive then."""
    live: Dict[int, Dict[str, Any]] = {}
    cur = peak = 0
    at_peak: Dict[int, Dict[str, Any]] = {}
    last: Dict[str, Any] = {}
    for ev in trace[start:]:
        a = ev.get("action")
        if a == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at_peak, last = cur, dict(live), ev
        elif a == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    groups: Dict[str, int] = defaultdict(int)
    for ev in at_peak.values():
        groups[who(ev.get("frames", []))] += ev["size"]
    where = [f"{os.path.basename(f.get('filename', ''))}:{f.get('name', '')}:{f.get('line', 0)}"
             for f in last.get("frames", []) if f.get("filename", "").endswith(".py")][:8]
    return {"trace_peak_delta": peak, "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1])[:25]),
            "peak_allocation": {"bytes": last.get("size"), "by": who(last.get("frames", [])), "frames": where}}


def run(case: str) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from bench.plan import wrappers_measure as wm

    name, kind, n = case.split(":")
    n = int(n)
    torch.manual_seed(0)
    if kind == "ddp":
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1)
    elif kind != "plain":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        model, units, inputs = wm.build(name, "cuda", False)
        model.train()
        b = wm.MODELS[name][0]
        if kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for u in units:
                fully_shard(u)
            fully_shard(model)
        elif kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = DDP(model)
        if kind in ("zero1", "zero2"):
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
        else:
            opt = torch.optim.AdamW(model.parameters())
        marks: Dict[str, int] = {}
        for step in range(3):
            last = step == 2
            if last:
                torch.cuda.synchronize()
                torch.cuda.memory._record_memory_history(max_entries=2_000_000)
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            args, kwargs = inputs(b, "cuda")
            out = model(*args, **kwargs)
            loss = wm.cross_entropy(out)
            if last:
                torch.cuda.synchronize()
                marks["forward"] = int(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            loss.backward()
            if last:
                torch.cuda.synchronize()
                marks["backward"] = int(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            opt.step()
            if last:
                torch.cuda.synchronize()
                marks["update"] = int(torch.cuda.max_memory_allocated())
            opt.zero_grad(set_to_none=True)
            del out, loss, args, kwargs
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][0]
        res = peak_parts(trace, 0)
        # the bytes alive before the step, grouped the same way (the state the step starts with)
        before: Dict[str, int] = defaultdict(int)
        for seg in snap["segments"]:
            for blk in seg["blocks"]:
                if blk["state"] == "active_allocated":
                    before[who(blk.get("frames", []))] += blk["size"]
        return dict(case=case, base=int(base), phases=marks, peak=max(marks.values()), **res,
                    alive_after_step=dict(sorted(before.items(), key=lambda kv: -kv[1])[:15]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch
    torch.cuda.set_device(0)
    out = open(a.out, "w") if a.out else None
    for case in a.cases.split(","):
        try:
            row = run(case)
        except Exception as exc:
            row = {"case": case, "error": f"{type(exc).__name__}: {exc}"[:400]}
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
