"""Keras ``model.fit`` under distmem's OOM guard with Horovod.

    horovodrun -np 4 -H localhost:4 python examples/guard_keras.py --global-batch 256 --micro-batch 64
    horovodrun -np 4 -H localhost:4 python examples/guard_keras.py --simulate-oom 1:3

``KerasGuard`` swaps in a guarded train function for the duration of ``fit``: micro-batches with
gradient accumulation, one tiny all-reduce per step telling every rank whether any ran out of memory,
and on an OOM a fallback to half the micro-batch on every rank with the global batch unchanged. The
Horovod DistributedOptimizer's all-reduce runs only after that verdict. ``--simulate-oom RANK:BATCH``
makes that rank's model fail one allocation inside TensorFlow (MemoryError in a py_function, which TF's
runtime turns into ResourceExhaustedError) because a CPU cannot run out of memory on demand.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distmem.cli.checks import at_least, parse_example, rank_step, run_example  # noqa: E402
from distmem.console import echo  # noqa: E402
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--global-batch", type=at_least(1), default=256)
    p.add_argument("--micro-batch", type=at_least(1), default=64)
    p.add_argument("--steps", type=at_least(1), default=12)
    p.add_argument("--simulate-oom", default=None, type=rank_step, metavar="RANK:BATCH")
    args = parse_example(p)
    import numpy as np  # noqa: E402 - after the arguments are checked: a bad one costs no TensorFlow import
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd
    from distmem.guard.keras import KerasGuard

    hvd.init()
    fault = args.simulate_oom
    calls = {"n": 0}

    def maybe_fail(t):
        calls["n"] += 1
        if fault and hvd.rank() == fault[0] and calls["n"] == fault[1] + 1:
            raise MemoryError("simulated allocation failure")
        return t

    class MaybeOOM(tf.keras.layers.Layer):
        def call(self, t):
            if not fault:
                return t
            out = tf.py_function(maybe_fail, [t], t.dtype)
            out.set_shape(t.shape)
            return out

    tf.keras.utils.set_random_seed(0)  # identical initial weights on every rank
    model = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(256, activation="relu"),
                                 MaybeOOM(), tf.keras.layers.Dense(10)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size())),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    local = args.global_batch // hvd.size()
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(local * args.steps, 64)).astype("float32")
    y = rng.integers(0, 10, size=(local * args.steps,))
    guard = KerasGuard(micro_batch_size=args.micro_batch, global_batch_size=args.global_batch)
    model.fit(x, y, batch_size=local, epochs=1, verbose=2 if hvd.rank() == 0 else 0, callbacks=[guard])
    if hvd.rank() == 0:
        echo(f"done: {guard.guard.describe()}; fallbacks: "
              f"{[(f.step, f.ranks, f.new_micro_batch) for f in guard.guard.fallbacks]}")


if __name__ == "__main__":
    run_example(main)
