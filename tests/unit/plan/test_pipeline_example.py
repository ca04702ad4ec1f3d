"""examples/pipeline.py's per-layer costs against what TensorFlow keeps for the backward.

The example hands the plan one LayerCost per layer (``layer_costs``); a stage holds, for every
micro-batch in flight, its layers' ``activation_bytes``. Here a stage of the example's own layers
(built by its ``build_stage``) runs the forward of ``m`` micro-batches, each under its own gradient
tape as the example runs them, in a fresh interpreter with the BFC CPU allocator
(``TF_CPU_ALLOCATOR_USE_BFC=true``, set before TensorFlow starts). The allocator first gets one
large region, as a GPU's has under a limit, so that it splits chunks and counts what is held rather
than whole chunks. Each micro-batch's forward must add the stage's ``activation_bytes`` to what
TensorFlow holds (the median of the ``m`` increments, so that a one-off chunk the allocator leaves
unsplit does not decide); a rule that counts a fused ReLU's pre-activation as well (which
TensorFlow does not keep: ReLU's gradient reads its output) fails.
"""
import json
import os
import statistics
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(ROOT, "examples", "pipeline.py")

# the example as a module, in a child whose CPU allocator keeps statistics (BFC, set before TensorFlow)
LOAD = r'''
import importlib.util, json, os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
spec = importlib.util.spec_from_file_location("pipeline_example", sys.argv[1])
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
'''

CHILD = LOAD + r'''import tensorflow as tf

mb, m, scale, start = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
kw = {} if scale == 1 else {"layers": ex.scaled(scale)}
layers = kw.get("layers", ex.LAYERS)
names = [name for name, _, _ in layers]
costs = ex.layer_costs(mb, **kw)
tf.zeros([256 << 18])  # one 256 MiB region, freed at once: every later chunk is split from it
whole = ex.build_stage(names, (mb,) + ex.INPUT, **kw)
shape = (mb,) + (ex.INPUT if start == 0 else tuple(whole.get_layer(names[start - 1]).output.shape[1:]))
stage = ex.build_stage(names[start:], shape, **kw)
xs = [tf.random.uniform(shape, seed=k) for k in range(m)]
stage(xs[0], training=True)
current = lambda: tf.config.experimental.get_memory_info("CPU:0")["current"]
held, after = [], [current()]
for x in xs:
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = stage(x, training=True)
    held.append((tape, y))
    after.append(current())
print(json.dumps({"each": [b - a for a, b in zip(after, after[1:])],
                  "costed": sum(c.activation_bytes for c in costs[start:]), "layers": names[start:]}))
'''


def _child(code: str, *args) -> dict:
    """Run ``code`` on the example with ``args``; its last line of output, as JSON."""
    cp = subprocess.run([sys.executable, "-c", code, EXAMPLE, *map(str, args)], capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert cp.returncode == 0, cp.stderr[-3000:]
    return json.loads(cp.stdout.strip().splitlines()[-1])


def _held(micro_batch: int, micro_batches: int, scale: float = 1.0, start: int = 0) -> dict:
    return _child(CHILD, micro_batch, micro_batches, scale, start)


@pytest.mark.parametrize("micro_batch, scale, start", [
    (8, 1.0, 0),   # every layer kind: conv+ReLU, max pool, global average, dense+ReLU, logits
    (16, 1.0, 2),  # a stage that starts at a pooling layer (its input is the boundary, not costed)
    (4, 2.0, 0),   # twice the widths (--width-scale 2)
])
def test_each_micro_batch_holds_what_the_layer_costs_say(micro_batch, scale, start):
    got = _held(micro_batch, 5, scale, start)
    ratio = statistics.median(got["each"]) / got["costed"]
    assert abs(ratio - 1) <= 0.02, (f"{', '.join(got['layers'])}, micro-batch {micro_batch}, widths x{scale}: "
                                    f"each micro-batch holds {got['each']} B, the costs say {got['costed']} B "
                                    f"(x{ratio:.3f})")


STAGE = LOAD + r'''import numpy as np
import tensorflow as tf
from distmem.plan.partition import stage_demands
from distmem.plan.wrappers import grad_fraction

mb, m, scale, start, stop = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
layers = ex.scaled(scale)
costs = ex.layer_costs(mb, layers=layers)
last = stop == len(layers)
shape = (mb,) + (ex.INPUT if start == 0 else ex.output_shapes(layers)[start - 1])
tf.zeros([256 << 18])  # one 256 MiB region, freed at once: every later chunk is split from it
stage = ex.build_stage([name for name, _, _ in layers[start:stop]], shape, layers)
opt = tf.keras.optimizers.Adam(1e-3)
opt.build(stage.trainable_variables)  # Adam's two slots: the state the plan counts
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
grads = [tf.Variable(tf.zeros_like(v), trainable=False) for v in stage.trainable_variables] if m > 1 else []
xs = [tf.random.uniform(shape, seed=k) for k in range(m)]  # the stage inputs it holds (or the data)
labels = [tf.random.uniform((mb,), maxval=10, dtype=tf.int32, seed=k) for k in range(m)]
tf.config.experimental.reset_memory_stats("CPU:0")
held = {}
for k in range(m):  # GPipe: every forward first, each micro-batch under its tape
    with tf.GradientTape() as tape:
        if start > 0:
            tape.watch(xs[k])
        y = stage(xs[k], training=True)
        if last:
            y = loss_fn(labels[k], y) / m
    held[k] = (tape, y)
for k in range(m):  # then every backward, with the gradient the next stage sent
    tape, y = held.pop(k)
    upstream = None if last else tf.random.uniform(y.shape, seed=100 + k)
    wrt = stage.trainable_variables if start == 0 else [xs[k]] + stage.trainable_variables
    made = tape.gradient(y, wrt, output_gradients=upstream)
    del tape, y, upstream
    dw = made if start == 0 else made[1:]
    if m > 1:
        for a, g in zip(grads, dw):
            a.assign_add(g)
    del made, dw
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
d = stage_demands(costs, [(start, stop)], kind="pipeline", schedule="gpipe", num_micro_batches=m,
                  input_bytes=4 * mb * int(np.prod(ex.INPUT)), accumulate=("tensorflow", grad_fraction("adam")))
# the count restarted with the weights, Adam's slots, the accumulators and the stage inputs held
print(json.dumps({"peak": peak,
                  "demand": d[0].total_bytes, "transient": d[0].transient_bytes,
                  "layers": [name for name, _, _ in layers[start:stop]]}))
'''


@pytest.mark.parametrize("micro_batch, micro_batches, scale, start, stop", [
    (8, 4, 1.0, 0, 2),    # the data's stage: conv1, conv2 (no input gradient)
    (32, 3, 1.0, 1, 3),   # conv2 + a max pool, at a larger micro-batch
    (8, 6, 2.0, 2, 5),    # pool1, conv3, conv4 at twice the widths, six micro-batches
    (16, 2, 1.0, 4, 11),  # conv4 to the logits: the last stage, where the loss makes the gradient
    (16, 1, 1.0, 3, 6),   # one micro-batch: nothing accumulates
    (8, 4, 2.0, 6, 11),   # conv5 to the logits at twice the widths: weights over activations
])
def test_a_stages_gpipe_peak_is_what_the_plan_demands(micro_batch, micro_batches, scale, start, stop):
    """One stage of the example (its own build_stage and layer_costs) runs a GPipe step in a fresh
    interpreter: every micro-batch's forward under its own tape, then every backward with the
    gradient the next stage would send, the gradients accumulated in place; the allocator's peak
    (the count restarted with the state and the stage inputs held) must be within 5% of the
    plan's demand for that stage. Cuts, micro-batches and widths other than the benchmark's. A plan
    without the backward's gradients in flight, or without what a micro-batch's own gradients hold
    before they are added, or without a max pool's backward_bytes, is further off than that."""
    got = _child(STAGE, micro_batch, micro_batches, scale, start, stop)
    ratio = got["peak"] / got["demand"]
    assert abs(ratio - 1) <= 0.05, (f"stage {', '.join(got['layers'])} (micro-batch {micro_batch} x {micro_batches}, "
                                    f"widths x{scale}): peak {got['peak']} B, the plan demands {got['demand']} B "
                                    f"(backward transient {got['transient']} B): x{ratio:.3f}")
