"""Where the analytic Keras model and TensorFlow's allocator disagree on one case of
``keras_models.py``, buffer by buffer (a diagnostic for fitting the model path's rules on the fit
half; it reads the estimator's internals — its replay graph — which is why it quotes no product
figure: the README quotes ``keras_heldout.py`` only).

distmem-bench: internal - it sets the analytic model's own replay (its graph, the BFC model) beside
TensorFlow's allocator log, buffer by buffer, to find what a rule misses.

A child process trains the case for a few steps with TensorFlow's BFC allocator logging every
request (``TF_CPP_VMODULE=bfc_allocator=3``); the live buffers at the worst step's peak are set
beside those of the estimate's own replay at its peak, by size: what TensorFlow held that the
estimate did not (with the estimate's tensors of that size, to name it), and the reverse.

    python bench/estimate/keras_trace.py MiniXception [--steps 3] [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (ROOT, HERE, os.path.join(ROOT, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import keras_models as M  # noqa: E402

MARK = "=== keras_trace step"


def _child(c, steps):
    import tensorflow as tf
    model, make = M.build(c)
    x, y = make(c["batch"])
    conv = (lambda v: {k: tf.constant(a) for k, a in v.items()} if isinstance(v, dict) else
            [tf.constant(a) for a in v] if isinstance(v, list) else tf.constant(v))
    x, y = conv(x), conv(y)
    for s in range(steps):
        print(f"{MARK} {s}", file=sys.stderr, flush=True)
        tf.config.experimental.reset_memory_stats("CPU:0")
        model.train_on_batch(x, y)
        print(f"{MARK} end {s} peak {tf.config.experimental.get_memory_info('CPU:0')['peak']}", file=sys.stderr,
              flush=True)


def estimated_live(c):
    """The estimate's replay at its peak: (peak, live requested sizes, labels by size, tensors by size)."""
    import warnings
    import tensorflow as tf
    from distmem.estimate.allocators import BFCAllocator
    from distmem.estimate.keras import estimate as from_keras
    from distmem.estimate.liveness import replay
    model, _ = M.build(c)
    opt = M._optimizer(c["optimizer"], tf.keras)
    captured = {}
    real = from_keras.replay

    def spy(g, *a, **kw):
        captured.setdefault("g", g)
        captured.setdefault("held", kw.get("grads_held"))
        return real(g, *a, **kw)
    from_keras.replay = spy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = from_keras.estimate_keras(model, c["batch"], opt, device="cpu")
        peak = est.peak_bytes
    from_keras.replay = real
    g, b = captured["g"], c["batch"]
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
    replay(g, b, grads_held=captured["held"], allocator=Spy(0), steps=2)
    live = collections.Counter()
    labels = collections.defaultdict(list)
    for key, size in Spy.best[1].items():
        live[size] += 1
        if isinstance(key, tuple) and key[0] in ("g", "g+"):
            lab = "grad of " + names.get(key[1], "?")
        else:
            lab = names.get(key, str(key))
        labels[size].append(lab)
    by_size = collections.defaultdict(list)
    for t, name in names.items():
        if isinstance(t, int):
            by_size[g.tensors[t].at(b)].append(name)
    return peak, live, labels, by_size


def main(argv=None):
    from estimate_keras_trace import measured_live
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    c = next(c for c in M.CASES if c["model"] == a.model)
    if a.child:
        _child(c, a.steps)
        return 0
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="bfc_allocator=3", TF_CPU_ALLOCATOR_USE_BFC="true",
               PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), a.model, "--steps", str(a.steps), "--child"],
                          capture_output=True, text=True, env=env, timeout=1800)
    import estimate_keras_trace as old
    old.MARK = MARK
    mpeak, step, mreq, mlive = measured_live(proc.stderr)
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    epeak, elive, labels, by_size = estimated_live(c)
    print(json.dumps({"case": M.case_id(c), "measured_peak": mpeak, "measured_requested_at_peak": mreq,
                      "worst_step": step, "estimate_peak": epeak,
                      "estimate_requested_at_peak": sum(k * v for k, v in elive.items())}))
    more, less = mlive - elive, elive - mlive
    print(f"alive in TensorFlow's peak, not in the estimate's: {sum(k * v for k, v in more.items()) / 2**20:.1f} MiB")
    for size, n in sorted(more.items(), key=lambda kv: -kv[0] * kv[1])[:a.top]:
        print(f"  {n:3d} x {size:>11,}  {sorted(set(by_size.get(size, [])))[:4]}")
    print(f"alive in the estimate's peak, not in TensorFlow's: {sum(k * v for k, v in less.items()) / 2**20:.1f} MiB")
    for size, n in sorted(less.items(), key=lambda kv: -kv[0] * kv[1])[:a.top]:
        print(f"  {n:3d} x {size:>11,}  {sorted(set(labels.get(size, [])))[:4]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
