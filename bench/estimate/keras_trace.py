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
    import tensorflow as tf
    from estimate_keras_trace import live_at_estimate_peak
    model, _ = M.build(c)
    peak, _, live, labels, by_size = live_at_estimate_peak(model, c["batch"], M._optimizer(c["optimizer"], tf.keras))
    return peak, live, labels, by_size


def main(argv=None):
    from estimate_keras_trace import measured_live, print_difference
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
    print_difference(mlive, elive, labels, by_size, a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
