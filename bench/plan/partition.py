"""Partition benchmark: the largest stage of distmem's exact, schedule-aware partition beside peers'.

One JSON line per (setting, model, stage count): ``figure`` is distmem's largest stage (bytes),
``peers`` each peer's largest stage evaluated with the same cost formula, ``ratios`` peer / ours.

Settings:
  plain   per-layer memory = state + activations at the batch, summed per stage (the peers' own
          cost model: "4 x parameter bytes + activations at batch 32"); ours is the exact optimum.
  1f1b    true stage demand under 1F1B with m = 2p micro-batches: state + min(p - s, m) x
          (activations + stage input); "plain-sum cut" is the optimum of the plain setting
          evaluated here: the gap is what the schedule-aware cut saves.
  gpipe   likewise with every stage holding all m micro-batches.

Peers, imported from their packages when importable (``--peers /tmp/peers`` adds that venv's
site-packages), else a faithful re-implementation labelled ``reimplementation``:
  deepspeed.parameters   deepspeed.runtime.utils.partition_balanced over per-layer parameter counts
                         (PipelineModule's default partition_method="parameters")
  deepspeed.uniform      deepspeed.runtime.utils.partition_uniform (partition_method="uniform")
  deepspeed.balanced     partition_balanced over the true per-layer costs (the best DeepSpeed can do)
  torchgpipe             torchgpipe.balance.blockpartition.solve over the per-layer costs

Per-layer costs: ``distmem.estimate`` when it imports; else Keras models measured directly (params
and output shapes; needs TensorFlow); else analytic layer lists. The ``source`` field says which.

Speed: one partition of 2,000 layers into 64 stages and one pipeline plan for 10,000 ranks.

Run (main environment for TensorFlow, peers from a throwaway venv):
    python3 -m venv /tmp/peers && DS_BUILD_OPS=0 /tmp/peers/bin/pip install torch==2.13.0 torchgpipe deepspeed==0.19.8
    $(scripts/env.sh main | tail -1)/python bench/plan/partition.py --peers /tmp/peers --out bench/results/partition.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

from distmem.costs import LayerCost  # noqa: E402
from distmem.discover.gpus import fleet_inventory  # noqa: E402
from distmem.plan import make_plan  # noqa: E402
from distmem.plan.partition import bounds_from_cuts, lower_bound, partition_pipeline, partition_plain, stage_demands
from distmem.discover.identity import Topology  # noqa: E402

BATCH = 32
FP32 = 4
Bounds = List[Tuple[int, int]]


# --------------------------------------------------------------------------------------------- peers

def _add_peers(venv: Optional[str]) -> None:
    if not venv:
        return
    for site in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages")):
        if site not in sys.path:
            sys.path.append(site)  # after ours: the main environment's packages win


def _reimpl_partition_uniform(num_items: int, num_parts: int) -> List[int]:
    """Re-implementation of deepspeed.runtime.utils.partition_uniform (0.19.8)."""
    parts = [0] * (num_parts + 1)
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk = num_items // num_parts
    residual = num_items - chunk * num_parts
    parts = list(range(0, (num_parts + 1) * chunk, chunk))
    for i in range(residual):
        for k in range(i + 1, len(parts)):
            parts[k] += 1
    return parts


def _reimpl_partition_balanced(weights: Sequence[float], num_parts: int) -> List[int]:
    """Re-implementation of deepspeed.runtime.utils.partition_balanced (0.19.8): a DP minimising
    max - min of part sums (not the max), ties to the last split point found."""
    n, m = len(weights), num_parts
    if n <= m:
        return _reimpl_partition_uniform(n, m)
    inf = float("inf")
    dp_max = np.full((n + 1, m + 1), inf)
    dp_min = np.full((n + 1, m + 1), inf)
    dp_cost = np.full((n + 1, m + 1), inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max[0, 0] = 0
    dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                max_sum = max(dp_max[k, j - 1], prefix[i] - prefix[k])
                min_sum = min(dp_min[k, j - 1], prefix[i] - prefix[k])
                cost = max_sum - min_sum
                if dp_cost[i, j] >= cost:
                    dp_cost[i, j], dp_max[i, j], dp_min[i, j], position[i, j] = cost, max_sum, min_sum, k
    parts = [n]
    for i in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], i]))
    return list(reversed(parts))


def _reimpl_blockpartition(sequence: List[float], partitions: int) -> List[List[float]]:
    """Re-implementation of torchgpipe.balance.blockpartition.solve (0.0.7), Bárány et al."""
    n = len(sequence)
    minimum = min(sequence)
    maximum = max(sequence) - minimum
    normal = [0.0 for _ in sequence] if maximum == 0 else [(x - minimum) / maximum for x in sequence]
    splits = [n // partitions * (x + 1) for x in range(partitions - 1)] + [n]

    def block_size(i: int) -> float:
        return sum(normal[(splits[i - 1] if i > 0 else 0):splits[i]])

    while True:
        max_size, p = max((block_size(i), i) for i in range(partitions))
        while True:
            min_size, q = min((block_size(i), i) for i in range(partitions))
            if max_size <= min_size + 1:
                return [sequence[i:j] for i, j in zip([0] + splits[:-1], splits)]
            if p < q:
                h = q - 1
                splits[h] -= 1
            else:
                h = q + 1
                splits[q] += 1
            if p == h:
                break


def load_peers() -> Dict[str, Tuple[Callable[..., Any], str]]:
    """name -> (function, "real <module>" | "reimplementation")."""
    peers: Dict[str, Tuple[Callable[..., Any], str]] = {}
    try:
        import logging

        import contextlib

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs its accelerator choice to stdout
            from deepspeed.runtime.utils import partition_balanced, partition_uniform

            import deepspeed
        impl = f"real deepspeed {deepspeed.__version__}"
        peers["uniform"], peers["balanced"] = (partition_uniform, impl), (partition_balanced, impl)
    except Exception as exc:  # noqa: BLE001 - any import failure means: use the re-implementation
        impl = f"reimplementation of deepspeed 0.19.8 ({type(exc).__name__})"
        peers["uniform"], peers["balanced"] = (_reimpl_partition_uniform, impl), (_reimpl_partition_balanced, impl)
    try:
        from torchgpipe.balance.blockpartition import solve

        import torchgpipe
        peers["blockpartition"] = (solve, f"real torchgpipe {torchgpipe.__version__}")
    except Exception as exc:  # noqa: BLE001
        peers["blockpartition"] = (_reimpl_blockpartition, f"reimplementation of torchgpipe 0.0.7 ({type(exc).__name__})")
    return peers


# --------------------------------------------------------------------------------------------- costs

def keras_direct(name: str, size: int) -> List[LayerCost]:
    """Per-layer costs measured from a Keras application: state = 4 x parameter bytes (fp32 weights,
    gradients, two Adam slots), activations = output bytes at batch 32 (fp32)."""
    import tensorflow as tf

    tf.keras.backend.clear_session()
    model = getattr(tf.keras.applications, name)(weights=None, input_shape=(size, size, 3))
    out = []
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.InputLayer):
            continue
        shapes = layer.output_shape if isinstance(layer.output_shape, list) else [layer.output_shape]
        elems = sum(int(np.prod([d for d in s[1:]])) for s in shapes)
        params = int(layer.count_params())
        out.append(LayerCost(layer.name, 4 * FP32 * params, BATCH * elems * FP32, BATCH * elems * FP32, params,
                             type(layer).__name__))
    return out


def estimator_costs(name: str, size: int) -> Optional[List[LayerCost]]:
    try:
        from distmem.plan.layers import layers_from_model
        import distmem.estimate  # noqa: F401
    except ImportError:
        return None
    return layers_from_model(f"keras:{name}", batch_size=BATCH, optimizer="adam", input_shape=(size, size, 3))


def gpt_stack(layers: int = 24, d: int = 1024, vocab: int = 50257, seq: int = 1024) -> List[LayerCost]:
    """Analytic GPT-style stack, fp32 + Adam, batch 32 (per-micro-batch activations use batch 32 too):
    a token + position embedding (vocab x d, the heaviest state), blocks of 12 d^2 parameters whose
    saved activations are 34 x seq x d bytes per sample in 16-bit (Korthikanti et al., attention
    scores not stored, as with flash attention), doubled for fp32; a final norm and an untied LM head."""
    tok = BATCH * seq * d * FP32
    out = [LayerCost("embedding", 4 * FP32 * (vocab + seq) * d, tok, tok, (vocab + seq) * d, "Embedding")]
    for k in range(layers):
        params = 12 * d * d + 13 * d
        out.append(LayerCost(f"block{k}", 4 * FP32 * params, 2 * 34 * BATCH * seq * d, tok,
                             params, "TransformerBlock"))
    out.append(LayerCost("final_norm", 4 * FP32 * 2 * d, tok, tok, 2 * d, "LayerNorm"))
    logits = BATCH * seq * vocab * FP32
    out.append(LayerCost("lm_head", 4 * FP32 * vocab * d, logits, logits, vocab * d, "Dense"))
    return out


def uneven_list(n: int = 40, seed: int = 11) -> List[LayerCost]:
    """A hand-made uneven list: activation-heavy stem, a few parameter-heavy layers, a long tail."""
    rng = random.Random(seed)
    mib = 1024**2
    out = []
    for k in range(n):
        if k < 6:
            state, act = rng.randint(1, 4) * mib, rng.randint(600, 1200) * mib
        elif k in (14, 23, 31):
            state, act = rng.randint(3000, 6000) * mib, rng.randint(10, 40) * mib
        else:
            state, act = rng.randint(20, 300) * mib, rng.randint(20, 300) * mib
        out.append(LayerCost(f"u{k}", state, act, act // 4, state // 16, "hand-made"))
    return out


def analytic_cnn(name: str) -> List[LayerCost]:
    """Analytic stand-in for a CNN when TensorFlow is missing: ResNet-50-like conv stages at 224 px."""
    out, hw, ch = [], 112, 64
    out.append(LayerCost("stem", 4 * FP32 * 9408, BATCH * hw * hw * ch * FP32, BATCH * hw * hw * ch * FP32, 9408))
    hw = 56
    for stage, (blocks, width) in enumerate(((3, 256), (4, 512), (6, 1024), (3, 2048))):
        for b in range(blocks):
            params = width * width // 2 + 9 * (width // 4) ** 2
            act = BATCH * hw * hw * width * FP32 * 3
            out.append(LayerCost(f"s{stage}b{b}", 4 * FP32 * params, act, BATCH * hw * hw * width * FP32, params))
        hw = max(hw // 2, 7)
    out.append(LayerCost("fc", 4 * FP32 * 2048 * 1000, BATCH * 1000 * FP32, BATCH * 1000 * FP32, 2048 * 1000))
    return out


def models(source: str, size: int) -> List[Tuple[str, str, List[LayerCost]]]:
    out = []
    for name in ("MobileNetV2", "ResNet50", "DenseNet121"):
        costs, src = None, source
        if source in ("auto", "estimator"):
            try:
                costs, src = estimator_costs(name, size), "estimator"
            except Exception as exc:  # noqa: BLE001 - the estimator is optional here
                print(f"# estimator unavailable for {name}: {exc}", file=sys.stderr)
                costs = None
        if costs is None and source in ("auto", "keras"):
            try:
                costs, src = keras_direct(name, size), f"keras-direct {size}px: 4 x param bytes + outputs at batch 32"
            except ImportError:
                costs = None
        if costs is None:
            costs, src = analytic_cnn(name), "analytic (ResNet-50-like; TensorFlow missing)"
            name = f"analytic-{name}"
        out.append((name, src, costs))
    out.append(("GPT-24x1024", "analytic: embedding + 24 blocks (12 d^2 params, 34 s d activations) + LM head",
                gpt_stack()))
    out.append(("uneven-40", "hand-made uneven list", uneven_list()))
    return out


# --------------------------------------------------------------------------------------------- run

def _reference_optimum(costs: List[LayerCost], p: int, a: Sequence[int], b: Sequence[int]) -> int:
    """An independent O(p n^2) DP over layers x stages (numpy per stop), to check the solver."""
    n = len(costs)
    s = np.concatenate(([0], np.cumsum([c.state_bytes for c in costs]))).astype(np.float64)
    act = np.concatenate(([0], np.cumsum([c.activation_bytes for c in costs]))).astype(np.float64)
    bnd = np.array([0] + [c.output_bytes for c in costs[:-1]], dtype=np.float64)
    dp = np.full(n + 1, np.inf)
    dp[0] = 0
    for k in range(p):
        new = np.full(n + 1, np.inf)
        for j in range(1, n + 1):
            i = np.arange(j)
            cost = s[j] - s[i] + a[k] * (act[j] - act[i]) + b[k] * bnd[i]
            new[j] = np.min(np.maximum(dp[:j], cost))
        dp = new
    return int(dp[n])


def _peer_bounds(peers: Dict[str, Tuple[Callable[..., Any], str]], costs: List[LayerCost], p: int) -> Dict[str, Bounds]:
    n = len(costs)
    plain = [c.state_bytes + c.activation_bytes for c in costs]
    uniform, balanced = peers["uniform"][0], peers["balanced"][0]
    out = {
        "deepspeed.parameters": bounds_from_cuts(list(balanced([c.params for c in costs], p)), n),
        "deepspeed.uniform": bounds_from_cuts(list(uniform(n, p)), n),
        "deepspeed.balanced(true costs)": bounds_from_cuts(list(balanced(plain, p)), n),
    }
    blocks = peers["blockpartition"][0](plain, p)
    edges, at = [0], 0
    for blk in blocks:
        at += len(blk)
        edges.append(at)
    out["torchgpipe.blockpartition"] = bounds_from_cuts(edges, n)
    return out


def _largest(costs: List[LayerCost], bounds: Bounds, **setting: Any) -> int:
    bounds = [(i, j) for i, j in bounds if j > i]  # a peer may leave a stage empty
    return max(s.total_bytes for s in stage_demands(costs, bounds, **setting))


def run_partitions(peers: Dict[str, Tuple[Callable[..., Any], str]], source: str, size: int,
                   stage_counts: Sequence[int], emit: Callable[[Dict[str, Any]], None]) -> List[Dict[str, Any]]:
    rows = []
    impl = {"deepspeed.parameters": peers["balanced"][1], "deepspeed.uniform": peers["uniform"][1],
            "deepspeed.balanced(true costs)": peers["balanced"][1],
            "torchgpipe.blockpartition": peers["blockpartition"][1]}
    for name, src, costs in models(source, size):
        for p in stage_counts:
            if len(costs) < p:
                continue
            t0 = time.perf_counter()
            peer_bounds = _peer_bounds(peers, costs, p)
            peer_s = time.perf_counter() - t0
            plain = partition_plain(costs, p)
            ref = _reference_optimum(costs, p, [1] * p, [0] * p)
            settings = [("plain", dict(kind="plain"), plain)]
            m = 2 * p
            for sched in ("1f1b", "gpipe"):
                t1 = time.perf_counter()
                ours = partition_pipeline(costs, p, num_micro_batches=m, schedule=sched)
                settings.append((sched, dict(kind="pipeline", schedule=sched, num_micro_batches=m), ours))
            for setting, kw, ours in settings:
                figure = ours.max_bytes
                peers_bytes = {k: _largest(costs, b, **kw) for k, b in peer_bounds.items()}
                if setting != "plain":
                    peers_bytes["plain-sum cut (distmem, schedule-blind)"] = _largest(costs, plain.bounds, **kw)
                row = {"bench": "partition", "setting": setting, "model": name, "source": src, "layers": len(costs),
                       "stages": p, "micro_batches": None if setting == "plain" else m, "figure": figure,
                       "figure_gib": round(figure / 1024**3, 3),
                       "lower_bound": lower_bound(costs, p, **kw),
                       "peers": peers_bytes, "ratios": {k: round(v / figure, 3) for k, v in peers_bytes.items()},
                       "impl": impl, "peer_seconds": round(peer_s, 3)}
                if setting == "plain":
                    row["optimum_check"] = {"reference_dp": ref, "equal": ref == figure}
                rows.append(row)
                emit(row)
    return rows


def run_speed(emit: Callable[[Dict[str, Any]], None]) -> None:
    rng = random.Random(5)
    costs = [LayerCost(f"l{k}", rng.randint(1, 2**27), rng.randint(1, 2**27), rng.randint(1, 2**24))
             for k in range(2000)]
    def timed(fn: Callable[[], Any]) -> Tuple[Any, List[float]]:
        times, out = [], None
        for _ in range(3):
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
        return out, times

    part, times = timed(lambda: partition_pipeline(costs, 64, num_micro_batches=128, schedule="1f1b"))
    emit({"bench": "partition.speed", "what": "partition 2000 layers into 64 stages (1f1b, m=128)",
          "figure": round(sorted(times)[1], 4), "unit": "s (median of 3 runs)", "runs": [round(x, 4) for x in times],
          "peer_name": "target (issue #4)", "peer": 1.0, "ratio": round(sorted(times)[1] / 1.0, 4),
          "largest_stage": part.max_bytes})
    topo = Topology(rank=0, size=10000, local_size=8, local_rank=0, host="n0", source="bench")
    inv = fleet_inventory("8x80GiB")
    for strategy, kw in (("data", {}), ("pipeline", dict(layers=[LayerCost(c.name, c.state_bytes // 64,
                                                                            c.activation_bytes // 256,
                                                                            c.output_bytes // 256) for c in costs],
                                                         num_micro_batches=16))):
        plan, times = timed(lambda: make_plan(strategy, topo, inv, **kw))  # noqa: B023
        dt = sorted(times)[1]
        emit({"bench": "partition.speed", "what": f"{strategy} plan for 10000 ranks (8 per node, 8x80GiB)"
              + (", 2000 layers into 8 stages" if strategy == "pipeline" else ""),
              "figure": round(dt, 4), "unit": "s (median of 3 runs)", "runs": [round(x, 4) for x in times],
              "peer_name": "target (issue #4)", "peer": 1.0,
              "ratio": round(dt / 1.0, 4),
              "allocations": len(plan.allocations)})


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=os.environ.get("DISTMEM_PEERS_VENV"),
                    help="a venv holding deepspeed and torchgpipe (its site-packages are appended to sys.path)")
    ap.add_argument("--source", choices=["auto", "estimator", "keras", "analytic"], default="auto")
    ap.add_argument("--size", type=int, default=224, help="input size of the Keras CNNs (pixels)")
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--out", default=None, help="also write the JSON lines here")
    ap.add_argument("--no-speed", action="store_true")
    args = ap.parse_args(argv)
    _add_peers(args.peers)
    peers = load_peers()
    lines: List[str] = []

    def emit(row: Dict[str, Any]) -> None:
        line = json.dumps(row, default=str)
        lines.append(line)
        print(line, flush=True)

    rows = run_partitions(peers, args.source, args.size, [int(x) for x in args.stages.split(",")], emit)
    summary: Dict[str, Any] = {"bench": "partition.summary"}
    for setting in ("plain", "1f1b", "gpipe"):
        worst: Dict[str, Any] = {}
        for r in rows:
            if r["setting"] != setting:
                continue
            for k, v in r["ratios"].items():
                if k not in worst or v > worst[k]["ratio"]:
                    worst[k] = {"ratio": v, "model": r["model"], "stages": r["stages"]}
        summary[setting] = worst
    summary["optimum_checks_equal"] = all(r["optimum_check"]["equal"] for r in rows if "optimum_check" in r)
    emit(summary)
    if not args.no_speed:
        run_speed(emit)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
