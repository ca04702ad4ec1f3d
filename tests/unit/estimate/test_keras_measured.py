"""Keras estimates against TensorFlow's own CPU allocator, for effects no layer's arithmetic shows:
the dense filter XLA's CPU backend builds for a depthwise-style grouped convolution's gradient,
and the variable copies decoupled weight decay makes at the step's start.

Each model is trained for a few steps in a fresh interpreter with the BFC CPU allocator
(``TF_CPU_ALLOCATOR_USE_BFC=true``, which must be set before TensorFlow starts), and the largest
``get_memory_info('CPU:0')['peak']`` of the steps is compared with the estimate; then the rule is
switched off to show the same comparison fails without it.
"""
import json
import os
import subprocess
import sys

import pytest

tf = pytest.importorskip("tensorflow")
K = tf.keras

from distmem.estimate import estimate_keras  # noqa: E402
from distmem.estimate import optimizers  # noqa: E402
from distmem.estimate.keras import estimate as keras_estimate, kernels, rules  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: the models, as source both this process and the measuring child build from
MODELS = r'''
import tensorflow as tf
K = tf.keras
def grouped():
    # a depthwise-style grouped convolution (one input channel per group, ConvNeXt's kind) between
    # two trainable convolutions, on a 2x2 map: the XLA temporary (2 x 7x7x256x256 fp32 = 24.5 MiB)
    # dwarfs every activation
    inp = K.Input((2, 2, 16))
    h = K.layers.Conv2D(256, 1, name="expand")(inp)
    h = K.layers.Conv2D(256, 7, padding="same", groups=256, name="dw")(h)
    h = K.layers.GlobalAveragePooling2D()(h)
    return K.Model(inp, K.layers.Dense(10, name="head")(h))
def dense_stack():
    # large kernels behind a trainable first layer: each is read back by its input gradient
    inp = K.Input((64,))
    h = K.layers.Dense(1024, name="d0")(inp)
    for i in range(1, 9):
        h = K.layers.Dense(1024, activation="relu", name=f"d{i}")(h)
    return K.Model(inp, K.layers.Dense(10, name="head")(h))
'''

CHILD = r'''
import json, sys
import numpy as np
exec(sys.argv[1])
import tensorflow as tf
model = globals()[sys.argv[2]]()
opt = {"adamw": lambda: tf.keras.optimizers.AdamW(1e-3), "adam": lambda: tf.keras.optimizers.Adam(1e-3),
       "sgd": lambda: tf.keras.optimizers.SGD(1e-3)}[sys.argv[3]]()
model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
batch = int(sys.argv[4])
x = tf.constant(np.random.default_rng(0).random((batch, *model.input_shape[1:]), dtype=np.float32))
y = tf.constant(np.zeros((batch,), dtype=np.int64))
peaks = []
for _ in range(4):
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_on_batch(x, y)
    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
print(json.dumps(peaks))
'''


def _measure(model: str, optimizer: str, batch: int, runs: int = 1) -> int:
    """TensorFlow's peak over the steps of ``runs`` fresh processes: its executor orders buffers
    differently on every run (the same step's peak moved 140 -> 157 MB between two runs on a loaded
    machine), and the estimate is of the worst of them."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    peaks = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", CHILD, MODELS, model, optimizer, str(batch)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        peaks.append(max(json.loads(out.stdout.strip().splitlines()[-1])))
    return max(peaks)


def _build(model: str):
    ns: dict = {}
    exec(MODELS, ns)
    return ns[model]()


def _estimate(model: str, optimizer: str, batch: int, monkeypatch) -> int:
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    return estimate_keras(_build(model), batch_size=batch, optimizer=optimizer, device="cpu").peak_bytes


def test_depthwise_grouped_conv_gradient_holds_xla_dense_filters(monkeypatch):
    measured = _measure("grouped", "sgd", 4)
    est = _estimate("grouped", "sgd", 4, monkeypatch)
    assert abs(est / measured - 1) < 0.15, (est, measured)
    # without the rule the estimate misses the XLA temporary (it is most of this peak)
    monkeypatch.setattr(kernels, "XLA_CPU_DEPTHWISE_FILTER_COPIES", 0)
    without = _estimate("grouped", "sgd", 4, monkeypatch)
    assert without < 0.6 * measured, (without, measured)
    # GPU estimates do not carry the CPU backend's expansion
    monkeypatch.setattr(kernels, "XLA_CPU_DEPTHWISE_FILTER_COPIES", 2)
    gpu = estimate_keras(_build("grouped"), batch_size=4, optimizer="sgd", device="gpu").peak_bytes
    assert gpu < 0.6 * est


def test_decoupled_weight_decay_copies_held_kernels(monkeypatch):
    measured = _measure("dense_stack", "adamw", 8, runs=3)
    est = _estimate("dense_stack", "adamw", 8, monkeypatch)
    assert abs(est / measured - 1) < 0.10, (est, measured)
    # the copies are about as large as the weights here: without them the estimate is far low
    monkeypatch.setattr(keras_estimate, "keras_decays_weights", lambda opt: False)
    without = _estimate("dense_stack", "adamw", 8, monkeypatch)
    assert without < 0.90 * measured, (without, measured)


def test_weight_decay_is_read_from_the_optimizer():
    assert optimizers.keras_decays_weights(K.optimizers.AdamW(1e-3))
    assert not optimizers.keras_decays_weights(K.optimizers.Adam(1e-3))
    assert optimizers.keras_decays_weights(K.optimizers.Adam(1e-3, weight_decay=0.01))
    assert not optimizers.keras_decays_weights(K.optimizers.SGD(1e-3))


COL_CHILD = r'''
import os, sys
import tensorflow as tf
n, h, cin, cout, k = (int(v) for v in sys.argv[1:6])
x = tf.cast(tf.random.normal([n, h, h, cin]), tf.bfloat16)
w = tf.cast(tf.random.normal([k, k, cin, cout]), tf.bfloat16)
dy = tf.cast(tf.random.normal([n, h, h, cout]), tf.bfloat16)
f = tf.function(lambda x, dy: tf.raw_ops.Conv2DBackpropFilter(
    input=x, filter_sizes=tf.shape(w), out_backprop=dy, strides=[1, 1, 1, 1], padding="SAME"))
f(x, dy)
print("=== MARK", file=sys.stderr, flush=True)
f(x, dy)
print("=== END", file=sys.stderr, flush=True)
'''


@pytest.mark.parametrize("shape", [(16, 48, 32, 16, 1), (8, 24, 64, 64, 3), (8, 12, 128, 128, 3)])
def test_16bit_cpu_conv_gradient_column_buffer(shape):
    """The weight gradient of a 16-bit convolution on TensorFlow's own CPU kernel requests exactly
    the column buffer ``_cpu_conv_col_buffer`` sizes (largest request the BFC allocator logs)."""
    if kernels.onednn_has_16bit("bfloat16"):
        pytest.skip("oneDNN runs bfloat16 convolutions on this CPU: TensorFlow's own kernel is not used")
    import re
    n, h, cin, cout, k = shape
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="0",
               TF_CPP_VMODULE="bfc_allocator=3", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", COL_CHILD, *map(str, shape)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stderr.split("=== MARK", 1)[1].split("=== END", 1)[0]
    requests = [int(m) for m in re.findall(r"AllocateRaw \S+\s+(\d+) ", log)]
    inp = K.Input((h, h, cin))
    layer = K.layers.Conv2D(cout, k, padding="same", use_bias=False)
    K.Model(inp, layer(inp))
    node = rules.LayerNode("c", layer, [0], [0], [h * h * cin * 2], [h * h * cout * 2], [(None, h, h, cin)],
                            [(None, h, h, cout)])
    assert max(requests) == kernels.cpu_conv_col_buffer(layer, node, 2), (sorted(requests)[-3:],)


def test_bfc_model_reproduces_tensorflows_chunk_peak_in_its_own_order(monkeypatch, tmp_path):
    """TensorFlow's own allocation sequence (profiler trace of a fresh process: build, three steps),
    replayed through distmem's BFC model, peaks where TensorFlow's allocator did: the allocator's rules
    are right, so what an estimate misses in fragmentation comes from the executor's order.

    Up to three fresh traces: on a loaded machine about one trace in eight leaves TensorFlow's placement
    once where the events it recorded do not lead (the bytes in use after every event agree with the
    trace's order, yet one chunk lands elsewhere: 10% above TensorFlow's peak from there on, seen in CI).
    One trace replayed within 3% shows the rules; every trace is still held to the checks below."""
    from bench.estimate import bfc_replay
    # one inter-op and one intra-op thread: with several, two kernels allocate at once and the
    # profiler's order of their events is not always the allocator's (a fresh-clone CI run on TF 2.21
    # replayed 7% low), so the replay would test the trace's ordering, not the allocator's rules
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1")
    traces = []
    for attempt in range(3):
        logdir = tmp_path / f"trace{attempt}"
        logdir.mkdir()
        out = subprocess.run([sys.executable, "-c", bfc_replay.CHILD, ROOT, str(logdir),
                              "Conv1D", "200", "32", "momentum", "float32"], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        evs = bfc_replay.events(str(logdir))
        peaks = bfc_replay.replay(evs)
        assert peaks["tf"] == int(out.stdout.strip().splitlines()[-1])  # the trace saw TensorFlow's peak
        traces.append((evs, peaks))
        if abs(peaks["model"] / peaks["tf"] - 1) < 0.03:
            break
    assert abs(traces[-1][1]["model"] / traces[-1][1]["tf"] - 1) < 0.03, [p for _, p in traces]
    from distmem.estimate import allocators
    for evs, peaks in traces:
        # the model explains TensorFlow's chunk overhead over the bytes requested (3.6% to 18% on this
        # case from run to run): closer to TensorFlow's peak than the requests alone
        assert abs(peaks["model"] - peaks["tf"]) < abs(peaks["requested"] - peaks["tf"]), peaks
    # a model that never splits a free chunk (every request takes a whole free chunk) is far off
    monkeypatch.setattr(allocators.BFCAllocator, "_split", lambda self, chunk, rounded: False)
    for evs, peaks in traces:
        assert bfc_replay.replay(evs)["model"] > 1.1 * peaks["tf"]
