"""Where a Keras estimate and TensorFlow's CPU allocator disagree, buffer by buffer.

Runs one zoo case (``bench/estimate/estimate_zoo.py``) for a few training steps in a subprocess with
TensorFlow's BFC allocator logging every request (``TF_CPP_VMODULE=bfc_allocator=3``), finds the
moment of the largest in-use total of the worst step and the buffers alive then (by requested
size), replays the estimate's own step the same way, and prints both live sets side by side:
sizes alive in TensorFlow's peak and not in the estimate's (with the layer tensors of that size,
so the missing buffer can be named), and the reverse. Frees are logged without an address, so the
live set is matched by size; for exact lifetimes and the op that made each buffer use TensorFlow's
profiler memory trace (``tf.profiler.experimental.start``: MemoryAllocation events carry the address,
requested and chunk bytes and ``tf_op``), which is how the update-temporary causes were found.

distmem-bench: internal - it replays the Keras estimate's own step (liveness, the BFC model) buffer
by buffer beside TensorFlow's log to name what the estimate misses; a diagnosis, no product figure.

    python bench/estimate/estimate_keras_trace.py MobileNet 64 16 rmsprop float32 [--steps 3] [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

_ALLOC = re.compile(r"AllocateRaw \S+\s+(\d+) 0x")
_FREE = re.compile(r"DeallocateRaw \S+ (\d+)")
MARK = "=== estimate_keras_trace step"


def _child(case, steps):
    from bench.estimate import estimate_zoo_keras as zk
    tf, model, x, y = zk.keras_compiled(case)
    for s in range(steps):
        print(f"{MARK} {s}", file=sys.stderr, flush=True)
        tf.config.experimental.reset_memory_stats("CPU:0")
        model.train_on_batch(x, y)
        print(f"{MARK} end {s} peak {tf.config.experimental.get_memory_info('CPU:0')['peak']}", file=sys.stderr,
              flush=True)


_PEAK = re.compile(r"New Peak memory usage of (\d+) bytes")


def measured_live(log: str):
    """For the step whose allocator peak (chunks in use, as ``get_memory_info`` reports it) is
    largest: (that peak, the step, the bytes requested by the buffers alive then, a Counter of
    their sizes). Frees are logged without an address, so a free takes one buffer of its size."""
    cur: list = []
    steps = [cur]  # what is allocated before the first traced step (weights, slots, the batch) stays live
    for line in log.splitlines():
        if MARK in line:
            if " end " in line:
                cur = None  # between steps: nothing of interest is logged
            else:
                cur = []
                steps.append(cur)
            continue
        if cur is None:
            continue
        m = _ALLOC.search(line)
        if m:
            cur.append(("a", int(m.group(1))))
            continue
        m = _FREE.search(line)
        if m:
            cur.append(("f", int(m.group(1))))
            continue
        m = _PEAK.search(line)
        if m:
            cur.append(("p", int(m.group(1))))
    best = (0, -1, 0, None)
    live: collections.Counter = collections.Counter()  # alive across steps too
    used = 0
    for i, ev in enumerate(steps):
        for kind, n in ev:
            if kind == "a":
                live[n] += 1
                used += n
            elif kind == "f" and live[n] > 0:
                live[n] -= 1
                used -= n
            elif kind == "p" and i > 0 and n >= best[0]:
                best = (n, i - 1, used, +live)
    return best


def estimated_live(case):
    from bench.estimate import estimate_zoo_keras as zk
    from distmem.estimate.keras import estimate as from_keras
    zk.keras_ns()
    model, _ = zk.keras_build(case)
    return live_at_estimate_peak(model, case["batch"], zk.keras_optimizer(case["optimizer"]),
                                 floor=from_keras.tf_cpu_uncounted_below())


def live_at_estimate_peak(model, batch, opt, floor=0):
    """The Keras estimate's own replay at its peak, buffer by buffer: (the estimate's peak, the replay's
    in-use bytes at that moment, the requested sizes alive then, their labels by size, every graph
    tensor by size). ``floor``: requests below it are not counted (TensorFlow's CPU allocator)."""
    import warnings
    from distmem.estimate.allocators import BFCAllocator
    from distmem.estimate.keras import estimate as from_keras
    from distmem.estimate.liveness import replay
    captured = {}
    real_replay = from_keras.replay

    def spy(g, *a, **kw):
        captured.setdefault("g", g)
        captured.setdefault("held", kw.get("grads_held"))
        return real_replay(g, *a, **kw)
    from_keras.replay = spy
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = from_keras.estimate_keras(model, batch, opt, device="cpu")
            peak = est.peak_bytes
    finally:
        from_keras.replay = real_replay
    g, b = captured["g"], batch
    names = {}
    for k, n in enumerate(g.nodes):
        row = est.layers[n.row].name if n.row < len(est.layers) else "loss"
        for t in n.outputs:
            names.setdefault(g.root(t), f"{row}:out")
        for t in n.temps:
            names.setdefault(g.root(t), f"{row}:{'kept' if t in n.saved else 'temp'}")
        for j, _ in enumerate(n.backward_temps):
            names[("bt", k, j)] = f"{row}:bwd-temp"
        for j, _ in enumerate(n.grads):
            names[("wg", k, j)] = f"{row}:wgrad"
        for j, _ in enumerate(n.update_temps):
            names[("ut", k, j)] = f"{row}:update-temp"
    for t in g.inputs:
        names[t] = "input"

    class Spy(BFCAllocator):
        best = (0, {})

        def _count(self, key, size, chunk, part):
            super()._count(key, size, chunk, part)
            if self.in_use >= Spy.best[0]:
                Spy.best = (self.in_use, dict(self.req))

        def alloc(self, key, size, part="temporaries"):
            self.req = getattr(self, "req", {})
            if size > 0 and size >= self.min_alloc:
                self.req[key] = size
            super().alloc(key, size, part)

        def free(self, key):
            getattr(self, "req", {}).pop(key, None)
            super().free(key)
    replay(g, b, grads_held=captured["held"], allocator=Spy(floor), steps=2)
    live = collections.Counter()
    labels = collections.defaultdict(list)
    for key, size in Spy.best[1].items():
        live[size] += 1
        if isinstance(key, tuple) and key[0] in ("g", "g+"):
            lab = "grad of " + names.get(key[1], "?")
        elif isinstance(key, tuple) and key[0] == "w":
            lab = "weight/slot"
        else:
            lab = names.get(key, str(key))
        labels[size].append(lab)
    by_size = collections.defaultdict(list)  # every graph tensor by size, to name a measured buffer
    for t, name in names.items():
        if isinstance(t, int):
            by_size[g.tensors[t].at(b)].append(name)
    return peak, Spy.best[0], live, labels, by_size


def print_difference(mlive, elive, labels, by_size, top):
    """The requested sizes alive at TensorFlow's peak and not at the estimate's (named by the graph's
    tensors of that size), and the reverse (named by the estimate's labels), largest totals first."""
    more, less = mlive - elive, elive - mlive
    print(f"alive in TensorFlow's peak, not in the estimate's: {sum(k * v for k, v in more.items()) / 2**20:.1f} MiB")
    for size, n in sorted(more.items(), key=lambda kv: -kv[0] * kv[1])[:top]:
        print(f"  {n:3d} x {size:>11,}  {sorted(set(by_size.get(size, [])))[:4]}")
    print(f"alive in the estimate's peak, not in TensorFlow's: {sum(k * v for k, v in less.items()) / 2**20:.1f} MiB")
    for size, n in sorted(less.items(), key=lambda kv: -kv[0] * kv[1])[:top]:
        print(f"  {n:3d} x {size:>11,}  {sorted(set(labels.get(size, [])))[:4]}")


def main(argv=None):
    from bench.estimate import estimate_zoo as z
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    z.add_case_arguments(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    case = z.case_of(a)
    if a.child:
        _child(case, a.steps)
        return 0
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="bfc_allocator=3",
               TF_CPU_ALLOCATOR_USE_BFC="true", TF_ENABLE_ONEDNN_OPTS=os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1"))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *map(str, (a.model, a.size, a.batch,
                           a.optimizer, a.precision)), "--steps", str(a.steps), "--child"],
                          capture_output=True, text=True, env=env, timeout=900)
    mpeak, step, mreq, mlive = measured_live(proc.stderr)
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    epeak, ebfc, elive, labels, by_size = estimated_live(case)
    print(json.dumps({"case": case, "measured_peak": mpeak, "measured_requested_at_peak": mreq, "worst_step": step,
                      "estimate_peak": epeak, "estimate_requested_at_peak": sum(k * v for k, v in elive.items())}))
    print_difference(mlive, elive, labels, by_size, a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
