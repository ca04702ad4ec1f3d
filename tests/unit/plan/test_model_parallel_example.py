"""examples/model_parallel.py's plan against what TensorFlow holds when the example's model trains.

One process (no launcher, no Horovod: the wrapper's buffers are tested with the launch, in
tests/horovod/test_examples_own_plan.py), the example's own layer costs and model under
``init(strategy="model")`` over two logical CPU devices, Keras's Adam as the example compiles it, in
a fresh interpreter (TensorFlow's BFC CPU allocator keeps the statistics): the step's allocator
peak must stay within the plan's demand. The rule before (a group's state and activations, no
backward in flight, no update beside it) planned 55 MiB where TensorFlow peaked at 62-67 MiB.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = r'''
import importlib.util, json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
spec = importlib.util.spec_from_file_location("model_parallel_example", sys.argv[1])
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
import distmem
B = 64
plan = distmem.init(strategy="model", layers=ex.layer_costs(B), gpus_per_rank=2, batch_size=B,
                    input_bytes=4 * B * ex.INPUT, verbose=False)
import numpy as np, tensorflow as tf
from distmem.apply import placement
with placement.placement_scope(plan):
    model = ex.build()
model.compile(optimizer=tf.keras.optimizers.Adam(1e-3),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(7).random((B * 8, ex.INPUT), dtype=np.float32)
model.fit(x, x[:, :10].argmax(axis=1).astype("int64"), batch_size=B, epochs=1, verbose=0)
print(json.dumps({"demand": plan.mine.demand_bytes, "planned": plan.mine.breakdown["planned_bytes"],
                  "peak": tf.config.experimental.get_memory_info("CPU:0")["peak"]}))
'''


def test_the_examples_plan_holds_its_training_step():
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPU_ALLOCATOR_USE_BFC="true", DISTMEM_QUIET="1")
    env.pop("DISTMEM_FLEET", None)
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.join(ROOT, "examples", "model_parallel.py")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["peak"] <= got["demand"] <= got["planned"], got
