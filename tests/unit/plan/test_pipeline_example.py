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

CHILD = r'''
import importlib.util, json, os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
spec = importlib.util.spec_from_file_location("pipeline_example", sys.argv[1])
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
import tensorflow as tf

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


def _held(micro_batch: int, micro_batches: int, scale: float = 1.0, start: int = 0) -> dict:
    cp = subprocess.run([sys.executable, "-c", CHILD, EXAMPLE, str(micro_batch), str(micro_batches), str(scale),
                         str(start)], capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=ROOT))
    assert cp.returncode == 0, cp.stderr[-3000:]
    return json.loads(cp.stdout.strip().splitlines()[-1])


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
