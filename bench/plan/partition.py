"""Partition benchmark: the largest stage of distmem's schedule-aware partition, asked of the door
(`distmem plan --strategy pipeline --layers FILE`), beside the partitions of DeepSpeed and torchgpipe.

Per-layer costs come from the door a user takes: `distmem estimate --model keras:NAME --per-layer
--json` for three Keras applications (batch 32, Adam, the modelled method); a GPT-style stack and
an uneven list are layer lists written as a user writes one (JSON rows: name, state_bytes,
activation_bytes, output_bytes, params). Every model's list is one file, handed unchanged to the
door and to the peers.

Settings, one row per (setting, model, stage count); ``figure`` is the largest stage the door
plans (its ``demand_bytes``), ``peers`` each peer's largest stage for the same list, ``ratios``
peer / ours (``peer``, ``ratio``: the strongest peer's):
  plain   the peers' own cost model: per-layer state + activations summed per stage (the list
          without output_bytes, one micro-batch: the door then plans exactly those sums)
  1f1b    the door's stage demand under 1F1B with m = 2p micro-batches: state + min(p - s, m) x
          (activations + stage input) + the backward's gradients in flight; "distmem-plain-cut" is
          the door's plain partition priced here: the gap is what the schedule-aware cut saves
  gpipe   likewise with every stage holding all m micro-batches

The door prices only its own cut; a peer's cut is priced by this bench's statement of the door's
stage demand (``price``), which must reproduce the door's figures on the door's own cut in every
row (``formula_check``) or the bench stops: the peers are priced by the rule the door plans by.
The plain optimum is checked against an independent DP over layers x stages (``optimum_check``).

Peers, imported from their packages when importable (``--peers /tmp/peers`` adds that venv's
site-packages), else a faithful re-implementation labelled ``reimplementation``:
  deepspeed-parameters   deepspeed.runtime.utils.partition_balanced over per-layer parameter counts
                         (PipelineModule's default partition_method="parameters")
  deepspeed-uniform      deepspeed.runtime.utils.partition_uniform (partition_method="uniform")
  deepspeed-balanced     partition_balanced over the true per-layer costs (the best DeepSpeed can do)
  torchgpipe             torchgpipe.balance.blockpartition.solve over the per-layer costs

Speed, through the same door in this process (``distmem.cli.main``, what ``distmem`` runs; median
of 3 after a warm-up) and as a user waits for it (a fresh ``distmem`` process): 2,000 layers into
64 stages, a data plan and a pipeline plan for 10,000 ranks.

Run (main environment; peers from a throwaway folder):
    pip install --target /tmp/peers/lib/python3.11/site-packages --no-deps deepspeed==0.19.8 torchgpipe==0.0.7 \
        einops hjson msgpack py-cpuinfo pydantic pydantic-core annotated-types typing-inspection tqdm
    $(scripts/env.sh main | tail -1)/python bench/plan/partition.py --peers /tmp/peers --out bench/results/partition.json
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

BATCH = 32
FP32 = 4
MODELS = ("MobileNetV2", "ResNet50", "DenseNet121")
Row = Dict[str, Any]  # one layer as the door reads it: name, state_bytes, activation_bytes, output_bytes, params
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


# --------------------------------------------------------------------------------------------- the door

def distmem(*args: str, timeout: float = 900) -> str:
    """What ``distmem ARGS`` prints (this tree's, as a user runs it); its error is this bench's."""
    env = dict(os.environ, PYTHONPATH=runner.ROOT, DISTMEM_QUIET="1", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("DISTMEM_FLEET", None)
    p = subprocess.run([sys.executable, "-m", "distmem", *args], capture_output=True, text=True, env=env,
                       cwd=runner.ROOT, timeout=timeout, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise SystemExit(f"distmem {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return p.stdout


def estimated(name: str, size: int) -> List[Row]:
    """A Keras application's per-layer costs, as `distmem estimate --per-layer --json` writes them."""
    out = json.loads(distmem("estimate", "--model", f"keras:{name}", "--input-shape", f"{size},{size},3",
                             "--batch-size", str(BATCH), "--optimizer", "adam", "--method", "model",
                             "--per-layer", "--json"))
    return out["per_layer"]


def door_plan(path: str, stages: int, micro_batches: int, schedule: str, framework: str) -> Dict[str, Any]:
    """The door's pipeline plan for the layer list at ``path`` (no headroom: demands as planned;
    GPUs large enough that every partition fits)."""
    plan = json.loads(distmem("plan", "--strategy", "pipeline", "--layers", path, "--gpus", f"{stages}x4096GiB",
                              "--ranks", str(stages), "--num-micro-batches", str(micro_batches),
                              "--schedule", schedule, "--headroom", "0", "--framework", framework,
                              "--optimizer", "adam", "--json"))
    return plan["extras"]["pipeline"]


def price(rows: Sequence[Row], bounds: Bounds, schedule: str, micro_batches: int, framework: str,
          grad_share: float = 0.25) -> List[int]:
    """Each stage's demand for ``bounds``, as the door states it (docs/pipeline_model.md): state +
    in flight x (activations + the stage's input) + the backward's gradients in flight (the received
    output gradient, the busiest layer's output and input gradients and backward bytes, and over
    several micro-batches one micro-batch's gradients until added: all of the stage's under
    TensorFlow, the largest layer's under torch; Adam's gradients are a quarter of the state)."""
    def g(r: Row, k: str) -> int:
        return int(r.get(k) or 0)
    p, n = len(bounds), len(rows)
    out = []
    for s, (i, j) in enumerate(bounds):
        flight = micro_batches if schedule == "gpipe" else min(p - s, micro_batches)
        stage = rows[i:j]
        held = sum(g(r, "state_bytes") for r in stage) + flight * (
            sum(g(r, "activation_bytes") for r in stage) + (g(rows[i - 1], "output_bytes") if i else 0))
        received = g(rows[j - 1], "output_bytes") if j < n else 0
        busiest = max(g(rows[t], "output_bytes") + (g(rows[t - 1], "output_bytes") if t else 0)
                      + g(rows[t], "backward_bytes") for t in range(i, j))
        grads = [int(g(r, "state_bytes") * grad_share) for r in stage]
        accumulating = (sum(grads) if framework == "tensorflow" else max(grads)) if micro_batches > 1 else 0
        out.append(held + received + busiest + accumulating)
    return out


def plain_rows(rows: Sequence[Row]) -> List[Row]:
    """The list as the peers cost it: state + activations, nothing crossing a cut."""
    return [dict(r, output_bytes=0, backward_bytes=0) for r in rows]


# --------------------------------------------------------------------------------------------- models

def gpt_stack(layers: int = 24, d: int = 1024, vocab: int = 50257, seq: int = 1024) -> List[Row]:
    """Analytic GPT-style stack, fp32 + Adam, batch 32: a token + position embedding (vocab x d, the
    heaviest state), blocks of 12 d^2 parameters whose saved activations are 34 x seq x d bytes per
    sample in 16-bit (Korthikanti et al., attention scores not stored, as with flash attention),
    doubled for fp32; a final norm and an untied LM head."""
    tok = BATCH * seq * d * FP32

    def row(name: str, params: int, act: int, out: int) -> Row:
        return {"name": name, "state_bytes": 4 * FP32 * params, "activation_bytes": act, "output_bytes": out,
                "params": params}
    out = [row("embedding", (vocab + seq) * d, tok, tok)]
    out += [row(f"block{k}", 12 * d * d + 13 * d, 2 * 34 * BATCH * seq * d, tok) for k in range(layers)]
    logits = BATCH * seq * vocab * FP32
    return out + [row("final_norm", 2 * d, tok, tok), row("lm_head", vocab * d, logits, logits)]


def uneven_list(n: int = 40, seed: int = 11) -> List[Row]:
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
        out.append({"name": f"u{k}", "state_bytes": state, "activation_bytes": act, "output_bytes": act // 4,
                    "params": state // 16})
    return out


def models(size: int, only: Optional[Sequence[str]]) -> List[Tuple[str, str, str, List[Row]]]:
    """(name, where its costs come from, its framework, its layer list)."""
    out = [(name, f"distmem estimate --model keras:{name} --input-shape {size},{size},3 --batch-size {BATCH} "
                  "--optimizer adam --method model --per-layer --json", "tensorflow", estimated(name, size))
           for name in MODELS if not only or name in only]
    out.append(("GPT-24x1024", "a layer list: embedding + 24 blocks (12 d^2 params, 34 s d activations) + LM head",
                "torch", gpt_stack()))
    out.append(("uneven-40", "a hand-made uneven layer list", "torch", uneven_list()))
    return out


# --------------------------------------------------------------------------------------------- run

def _reference_optimum(rows: Sequence[Row], p: int) -> int:
    """An independent O(p n^2) DP over layers x stages of plain sums, to check the door's optimum."""
    n = len(rows)
    c = np.concatenate(([0], np.cumsum([int(r["state_bytes"]) + int(r["activation_bytes"]) for r in rows])))
    dp = np.full(n + 1, np.inf)
    dp[0] = 0
    for _ in range(p):
        new = np.full(n + 1, np.inf)
        for j in range(1, n + 1):
            new[j] = np.min(np.maximum(dp[:j], c[j] - c[:j]))
        dp = new
    return int(dp[n])


def _bounds(edges: Sequence[int], n: int) -> Bounds:
    """DeepSpeed's ``parts`` (``[0, c1, ..., n]``) -> [start, stop) pairs; empty stages dropped."""
    e = list(edges)
    e = ([0] if not e or e[0] != 0 else []) + e + ([n] if e[-1:] != [n] else [])
    return [(i, j) for i, j in zip(e[:-1], e[1:]) if j > i]


def _peer_bounds(peers: Dict[str, Tuple[Callable[..., Any], str]], rows: List[Row], p: int) -> Dict[str, Bounds]:
    n = len(rows)
    plain = [int(r["state_bytes"]) + int(r["activation_bytes"]) for r in rows]
    uniform, balanced = peers["uniform"][0], peers["balanced"][0]
    out = {
        "deepspeed-parameters": _bounds(list(balanced([int(r.get("params") or 0) for r in rows], p)), n),
        "deepspeed-uniform": _bounds(list(uniform(n, p)), n),
        "deepspeed-balanced": _bounds(list(balanced(plain, p)), n),
    }
    edges, at = [0], 0
    for blk in peers["blockpartition"][0](plain, p):
        at += len(blk)
        edges.append(at)
    out["torchgpipe"] = _bounds(edges, n)
    return out


def _door_bounds(pipe: Dict[str, Any]) -> Bounds:
    return [(int(i), int(j)) for i, j in pipe["partition"]["bounds"]]


def run_partitions(peers: Dict[str, Tuple[Callable[..., Any], str]], size: int, stage_counts: Sequence[int],
                   only: Optional[Sequence[str]], folder: str) -> List[Dict[str, Any]]:
    rows_out = []
    impl = {"deepspeed-parameters": peers["balanced"][1], "deepspeed-uniform": peers["uniform"][1],
            "deepspeed-balanced": peers["balanced"][1],
            "torchgpipe": peers["blockpartition"][1]}
    for name, src, framework, rows in models(size, only):
        full, plain = os.path.join(folder, f"{name}.json"), os.path.join(folder, f"{name}-plain.json")
        for path, content in ((full, rows), (plain, plain_rows(rows))):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(content, f)
        for p in stage_counts:
            if len(rows) < p:
                continue
            peer_bounds = _peer_bounds(peers, rows, p)
            m = 2 * p
            door_plain = door_plan(plain, p, 1, "gpipe", framework)
            settings = [("plain", plain_rows(rows), "gpipe", 1, door_plain)]
            settings += [(s, rows, s, m, door_plan(full, p, m, s, framework)) for s in ("1f1b", "gpipe")]
            for setting, priced_rows, schedule, mb, pipe in settings:
                ours = _door_bounds(pipe)
                demands = [int(s["demand_bytes"]) for s in pipe["stages"]]
                figure = max(demands)
                check = price(priced_rows, ours, schedule, mb, framework)
                if check != demands:
                    raise SystemExit(f"{name}, {setting}, {p} stages: this bench prices the door's own cut {ours} "
                                     f"at {check} but the door plans {demands}; update price() to the door's "
                                     "stage demand (distmem/plan/partition.py) before comparing peers")
                cuts = dict(peer_bounds)
                if setting != "plain":
                    cuts["distmem-plain-cut"] = _door_bounds(door_plain)
                peers_bytes = {k: max(price(priced_rows, b, schedule, mb, framework)) for k, b in cuts.items()}
                strongest = min(peers_bytes.values())
                row = runner.line("partition", figure, peer=strongest, ratio=round(strongest / figure, 3),
                                  setting=setting, model=name, source=src, framework=framework, layers=len(rows),
                                  stages=p, micro_batches=None if setting == "plain" else m,
                                  figure_gib=round(figure / 1024**3, 3),
                                  lower_bound=pipe["partition"].get("lower_bound_bytes"), bounds=ours,
                                  peers=peers_bytes, ratios={k: round(v / figure, 3) for k, v in peers_bytes.items()},
                                  impl=impl, formula_check=True)
                if setting == "plain":
                    ref = _reference_optimum(rows, p)
                    row["optimum_check"] = {"reference_dp": ref, "equal": ref == figure}
                rows_out.append(runner.emit(row))
    return rows_out


def _in_process(args: Sequence[str]) -> float:
    """Seconds one ``distmem ARGS`` takes in this process (the CLI's own main; output discarded)."""
    from distmem.cli import main
    sink = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(sink):
        rc = main(list(args))
    dt = time.perf_counter() - t
    if rc:
        raise SystemExit(f"distmem {' '.join(args)} failed ({rc})")
    return dt


def run_speed(folder: str) -> List[Dict[str, Any]]:
    rng = random.Random(5)
    big = [{"name": f"l{k}", "state_bytes": rng.randint(1, 2**27), "activation_bytes": rng.randint(1, 2**27),
            "output_bytes": rng.randint(1, 2**24)} for k in range(2000)]
    small = [dict(r, state_bytes=r["state_bytes"] // 64, activation_bytes=r["activation_bytes"] // 256,
                  output_bytes=r["output_bytes"] // 256) for r in big]
    paths = {}
    for key, rows in (("big", big), ("small", small)):
        paths[key] = os.path.join(folder, f"speed-{key}.json")
        with open(paths[key], "w", encoding="utf-8") as f:
            json.dump(rows, f)
    cases = [
        ("partition_2000_layers_64_stages", "partition 2000 layers into 64 stages (1f1b, m=128)",
         ["plan", "--strategy", "pipeline", "--layers", paths["big"], "--gpus", "8x4096GiB", "--ranks", "64",
          "--ranks-per-host", "8", "--num-micro-batches", "128", "--headroom", "0", "--framework", "none", "--json"]),
        ("data_plan_10000_ranks", "data plan for 10000 ranks (8 per node, 8x80GiB)",
         ["plan", "--gpus", "8x80GiB", "--ranks", "10000", "--ranks-per-host", "8", "--framework", "none", "--json"]),
        ("pipeline_plan_10000_ranks", "pipeline plan for 10000 ranks (8 per node, 8x80GiB), 2000 layers into 8 stages",
         ["plan", "--strategy", "pipeline", "--layers", paths["small"], "--gpus", "8x80GiB", "--ranks", "10000",
          "--ranks-per-host", "8", "--num-stages", "8", "--num-micro-batches", "16", "--framework", "none",
          "--json"]),
    ]
    out = []
    for key, what, args in cases:
        _in_process(args)  # warm-up: imports and caches are not the plan's time
        runs = [_in_process(args) for _ in range(3)]
        t = time.perf_counter()
        distmem(*args)
        wall = time.perf_counter() - t
        fig = statistics.median(runs)
        out.append(runner.emit(runner.line(
            "partition.speed", round(fig, 4), peer=1.0, ratio=round(fig, 4), key=key, what=what, door="distmem " + " ".join(
                os.path.basename(a) if a.startswith(folder) else a for a in args),
            unit="s (median of 3 runs in one process)", runs=[round(x, 4) for x in runs],
            peer_name="target (issue #4)", fresh_process_seconds=round(wall, 2))))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=os.environ.get("DISTMEM_PEERS_VENV"),
                    help="a venv holding deepspeed and torchgpipe (its site-packages are appended to sys.path)")
    ap.add_argument("--size", type=int, default=224, help="input size of the Keras applications (pixels)")
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--models", default=None, help=f"only these Keras applications (default: {','.join(MODELS)})")
    runner.add_out(ap, help="write the rows, the summary and the speed lines here (one JSON object)")
    ap.add_argument("--no-speed", action="store_true")
    args = ap.parse_args(argv)
    _add_peers(args.peers)
    peers = load_peers()
    with tempfile.TemporaryDirectory(prefix="distmem-partition-") as folder:
        rows = run_partitions(peers, args.size, [int(x) for x in args.stages.split(",")],
                              args.models.split(",") if args.models else None, folder)
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
        summary["formula_checks"] = len(rows)
        runner.emit(summary)
        speed = [] if args.no_speed else run_speed(folder)
    if args.out:
        runner.write_json(args.out, {"bench": "partition", "command": " ".join(["python bench/plan/partition.py"]
                                                                            + list(argv or sys.argv[1:])),
                                     "summary": summary, "speed": {s["key"]: s for s in speed},
                                     "rows": rows})
    return 0 if summary["optimum_checks_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
