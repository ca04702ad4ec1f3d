"""What ``distmem.keras.MemoryReport`` costs on a training batch where it does not report.

    python bench/report/keras_hook_cost.py [--calls 200000] [--repeats 5] [--out bench/results/keras_hook_cost.json]

One process, a declared fleet (no GPU needed), TensorFlow's Keras. Three figures per call, each the
median over the repeats of ``calls`` calls:

- ``hook_ns``: ``MemoryReport.on_train_batch_end`` alone, on batches between two reports;
- ``noop_hook_ns``: the same call on a callback whose ``on_train_batch_end`` does nothing (the
  floor: a Python method call);
- ``callback_list_ns`` / ``callback_list_noop_ns``: Keras's ``CallbackList.on_train_batch_end``
  with that callback, what ``model.fit`` runs after every batch (and what Keras times for its
  "Callback method `on_train_batch_end` is slow compared to the batch time" warning).

Prints one JSON line (and writes it to ``--out``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("DISTMEM_QUIET", "1")


def _per_call(fn, calls: int, repeats: int) -> float:
    """Median nanoseconds per call of ``fn(batch)`` over ``repeats`` runs of ``calls`` batches."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for b in range(calls):
            fn(b)
        runs.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import distmem

    distmem.init(fleet="1x16GiB", verbose=False)
    import tensorflow as tf
    from distmem.keras import MemoryReport

    class Noop(tf.keras.callbacks.Callback):
        _supports_tf_logs = True

        def on_train_batch_end(self, batch, logs=None):
            pass

    steps = args.calls + 1  # one epoch longer than every run: no report, no epoch end inside
    params = {"steps": steps, "epochs": 1, "verbose": 0}
    ours = MemoryReport(every_n_batches=10 ** 9, final=False)
    noop = Noop()
    for cb in (ours, noop):
        cb.set_params(params)
    ours.on_train_begin()
    ours.on_epoch_begin(0)
    lists = {}
    for name, cb in (("ours", ours), ("noop", noop)):
        cl = tf.keras.callbacks.CallbackList([cb], add_history=False, add_progbar=False, **params)
        cl._check_timing = False  # Keras times only its first batches; time the steady state
        lists[name] = cl
    logs = {"loss": 0.5}
    out = {
        "bench": "keras_hook_cost", "tensorflow": tf.__version__, "calls": args.calls, "repeats": args.repeats,
        "hook_ns": round(_per_call(ours.on_train_batch_end, args.calls, args.repeats), 1),
        "noop_hook_ns": round(_per_call(noop.on_train_batch_end, args.calls, args.repeats), 1),
        "callback_list_ns": round(_per_call(lambda b: lists["ours"].on_train_batch_end(b, logs), args.calls,
                                            args.repeats), 1),
        "callback_list_noop_ns": round(_per_call(lambda b: lists["noop"].on_train_batch_end(b, logs), args.calls,
                                                 args.repeats), 1),
        "gathers": ours.every.gathers,
    }
    assert out["gathers"] == 0, "the bench must time batches between reports only"
    runner.emit(out, args.out, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
