"""The measured Keras path runs what the user's compiled model runs: Keras's own train function, in
both the traces a job's training makes of it — ``train_on_batch`` (the batch dimension known when
traced) and ``fit`` on a ``tf.data`` dataset batched without ``drop_remainder`` (the batch dimension
open) — not a step function of distmem's own traced with the batch open, which only the second
runs. Each trace's worst step is checked against the same trace run by a user in a fresh process
(TensorFlow's BFC CPU allocator, as distmem's TensorFlow adapter sets it up); a recurrent tagger
plans the two 30-45% apart."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

tf = pytest.importorskip("tensorflow")

TAGGER = textwrap.dedent("""
    import tensorflow as tf
    K, L = tf.keras, tf.keras.layers
    def build():
        inp = K.Input((80,), dtype="int32")
        h = L.Embedding(8000, 96, mask_zero=True)(inp)
        h = L.Bidirectional(L.GRU(96, return_sequences=True))(h)
        h = L.Bidirectional(L.GRU(48, return_sequences=True))(h)
        m = K.Model(inp, L.Dense(20)(h))
        m.compile(K.optimizers.RMSprop(1e-3), K.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m
""")

#: a user's six train_on_batch steps, then six steps of fit on a batched dataset, in a fresh process;
#: prints [worst static, worst open] (the estimate runs the same steps on labels of its own making)
USER = textwrap.dedent("""
    import json, sys
    import numpy as np, tensorflow as tf
    sys.path.insert(0, sys.argv[1])
    from tagger_own_training import build
    m, b = build(), 16
    info = tf.config.experimental.get_memory_info
    x = tf.constant(np.random.default_rng(0).integers(1, 8000, (b, 80)).astype("int32"))
    y = tf.constant(np.random.default_rng(1).integers(0, 20, (b, 80)))
    static, opened = [], []
    for _ in range(6):
        tf.config.experimental.reset_memory_stats("CPU:0")
        m.train_on_batch(x, y)
        static.append(info("CPU:0")["peak"])
    class Peaks(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, i, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")
        def on_train_batch_end(self, i, logs=None):
            opened.append(info("CPU:0")["peak"])
    ds = tf.data.Dataset.from_tensors((x, y)).unbatch().batch(b).repeat()
    m.fit(ds, epochs=1, steps_per_epoch=6, verbose=0, callbacks=[Peaks()])
    print(json.dumps([max(static), max(opened)]))
""")

MEASURE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from tagger_own_training import build
    from distmem.estimate.measure.keras_steps import keras_step_peaks
    m = build()
    got = keras_step_peaks(m, [16], "rmsprop", steps=6)
    steps = got["steps"][16]
    print(json.dumps({"static": max(steps[:6]), "open": max(steps[6:] or [0]), "n": len(steps), "peak": got["peaks"][16],
                      "loss": got["loss"], "train_function": m.train_function is None}))
""")


def _env(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true", DISTMEM_MEASURE_CACHE="off")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), str(tmp_path), os.environ.get("PYTHONPATH", "")])
    return env


def _fresh(tmp_path, name, code):
    (tmp_path / "tagger_own_training.py").write_text(TAGGER)
    (tmp_path / name).write_text(code)
    done = subprocess.run([sys.executable, str(tmp_path / name), str(tmp_path)], capture_output=True, text=True,
                          env=_env(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_each_trace_the_job_makes_is_measured_as_the_job_runs_it(tmp_path):
    static, opened = _fresh(tmp_path, "user_steps.py", USER)
    got = _fresh(tmp_path, "measure_steps.py", MEASURE)
    # the two traces are planned apart (the bug measured only the open one, by a step of its own); where this
    # TensorFlow plans them within 20% of each other, the 15% tolerance below cannot tell one from the other
    if opened <= 1.2 * static:
        import tensorflow as tf

        pytest.skip(f"TensorFlow {tf.__version__} plans the two traces of this model within 20% of each other "
                    f"({static:,} and {opened:,} B): the test cannot tell which one was measured")
    # each trace measured apart, as the user's process plans them apart: the bug's two figures were one
    # trace's (a ratio near 1); here they are 1.42-1.49 apart, the user's more than 1.2
    assert got["open"] >= 1.1 * got["static"], (got["static"], got["open"], static, opened)
    # and each near the user's own: a process's level of this model moves from process to process (its
    # known-batch trace read 33.4-39.2 MB over eight processes, the open one 47.6-50.4 MB), so one process
    # is held to another within that spread, not within the 15% two draws of one level keep
    assert 0.75 <= got["static"] / static <= 1.3, (got["static"], static)
    assert 0.75 <= got["open"] / opened <= 1.3, (got["open"], opened)
    assert got["n"] == 12 and got["loss"] == "compiled" and got["peak"] == max(got["static"], got["open"])
    assert got["train_function"], "the model's own train function (none built yet) was not put back"


def test_a_step_that_needs_its_batch_known_is_measured_as_train_on_batch_runs_it(monkeypatch):
    """A step that reshapes by the static batch size traces only with the batch dimension known: the
    job trains it by train_on_batch (or a dataset batched with drop_remainder), and so is it
    measured, saying that the open trace failed."""
    from distmem.estimate.measure.keras_steps import keras_step_peaks
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
    K, L = tf.keras, tf.keras.layers

    class Flat(L.Layer):
        def call(self, x):
            return tf.reshape(x, (x.shape[0], -1))
    class Net(K.Model):
        def __init__(self):
            super().__init__()
            self.c, self.f, self.d = L.Conv2D(8, 3, padding="same"), Flat(), L.Dense(4)

        def call(self, x, training=False):
            return self.d(self.f(self.c(x)))
    model = Net()
    model(tf.zeros((2, 8, 8, 3)))
    model.compile("sgd", "mse")
    model.train_on_batch(tf.zeros((4, 8, 8, 3)), tf.zeros((4, 4)))  # the job's own step runs
    got = keras_step_peaks(model, [4], "sgd", steps=2, input_shape=(8, 8, 3))
    assert got["peaks"][4] > 0 and got["loss"].startswith("compiled")
    assert "batch dimension known only" in got["loss"], got["loss"]


def test_the_open_trace_is_a_second_trace_of_the_static_ones_function(monkeypatch):
    """A job that runs ``train_on_batch`` and then ``fit`` holds both traces of one train function,
    and its ``fit`` steps read higher than a fresh function's (the held-out VAE of
    bench/estimate/keras_heldout.py at batch 32: 24.5-25.4 MB with a 29.2 MB step, against 23.1-24.9
    MB), so each fresh trace's ``fit`` runs on the function its ``train_on_batch`` steps built; the
    bug handed ``fit`` a fresh function and read the lower level."""
    from distmem.estimate.measure.keras_steps import keras_step_peaks
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
    K, L = tf.keras, tf.keras.layers
    seen = []

    class Recorded(K.Model):
        def train_on_batch(self, *args, **kwargs):
            out = super().train_on_batch(*args, **kwargs)
            seen.append(("train_on_batch", self.train_function))
            return out

        def fit(self, *args, **kwargs):
            seen.append(("fit", self.train_function))
            return super().fit(*args, **kwargs)

    inp = K.Input((16,))
    model = Recorded(inp, L.Dense(4)(L.Dense(32, activation="relu")(inp)))
    model.compile("sgd", "mse")
    got = keras_step_peaks(model, [8], "sgd", steps=2)
    assert got["peaks"][8] > 0 and got["loss"].startswith("compiled"), got
    fits = [i for i, (what, _) in enumerate(seen) if what == "fit"]
    assert fits and all(i > 0 and seen[i - 1][0] == "train_on_batch" for i in fits), seen
    for i in fits:
        assert seen[i][1] is not None and seen[i][1] is seen[i - 1][1], \
            f"fit ran on a function its train_on_batch steps did not build: {seen[i - 1][1]} then {seen[i][1]}"


def test_each_fresh_trace_of_the_target_draws_the_optimizer_state_again_and_what_it_leaves_is_foreign(monkeypatch):
    """A job's first step makes the optimizer's slots; where they land in the BFC allocator is part
    of the process's level (the held-out FPNSeg at batch 8, TF 2.15: 33.5 MB in most processes,
    39-40 MB in some; with the state drawn again in each fresh trace, 7 of 8 processes' estimates
    reached the high level, against 3 of 8 with one optimizer for every trace). So every fresh
    trace of the target batch runs on a new optimizer, and the model's own is back afterwards. What
    a renewal leaves alive (TensorFlow keeps some old slots) is foreign to the later traces: here
    every old optimizer is kept alive, its slots (2 x 4 MiB of Adam moments) stay in the allocator,
    and the later traces must not read them as the step's."""
    from distmem.estimate.measure import keras_steps as ks
    from distmem.estimate.measure.extrapolate import Ladder
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
    monkeypatch.setattr(ks, "TARGET_SECONDS", 1e9)
    monkeypatch.setattr(ks, "TARGET_TRACES", 4)
    made = []  # every optimizer made for the steps, kept alive: each renewal leaks all of its slots
    real = ks._optimizer
    monkeypatch.setattr(ks, "_optimizer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    K, L = tf.keras, tf.keras.layers
    used = []

    class Recorded(K.Model):
        def train_on_batch(self, *args, **kwargs):
            used.append(self.optimizer)
            return super().train_on_batch(*args, **kwargs)

    inp = K.Input((1024,))
    model = Recorded(inp, L.Dense(8)(L.Dense(1024, use_bias=False)(inp)))
    model.compile("adam", "mse")
    own = model.optimizer
    got = ks.keras_step_peaks(model, Ladder(8, 10 ** 10, lambda b: 10 ** 6 * b), "adam")
    assert model.optimizer is own
    traces = [used[i] for i in range(len(used)) if i == 0 or used[i] is not used[i - 1]]
    # the target's four traces, then each smaller batch of the ladder, each a job's start
    assert len(traces) == 4 + len(got["steps"]) - 1 and len({id(o) for o in traces}) == len(traces), \
        f"the target's fresh traces ran on {len({id(o) for o in traces})} optimizer(s) over {len(traces)} traces"
    steps = got["steps"][8]
    first, later = max(steps[:12]), max(steps[12:])
    slots = 2 * 1024 * 1024 * 4
    assert later < first + slots / 4, \
        f"a later trace read {later} B against the first's {first} B: the old optimizers' slots ({slots} B) counted"


def test_what_the_targets_traces_leave_alive_is_foreign_to_the_batches_measured_after_it(monkeypatch):
    """Each trace leaves more alive than the old optimizer's slots (its function's and its dataset's:
    156 KB a trace for the held-out three-layer MLP), and the ladder's smaller batches run after the
    target's traces: counted, the MLP read 3.1 MB at batch 4 against 1.6 MB at batch 16, the figures
    a fit prices its micro-batches at. Here each trace keeps 4 MiB alive past its end: counted in the
    trace that made it (a job's own trace holds its own), foreign to the batches measured after."""
    from distmem.estimate.measure import keras_steps as ks
    from distmem.estimate.measure.extrapolate import Ladder
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
    monkeypatch.setattr(ks, "TARGET_SECONDS", 1e9)
    monkeypatch.setattr(ks, "TARGET_TRACES", 4)
    K, L = tf.keras, tf.keras.layers
    kept, leak = [], 4 * 1024 * 1024

    class Leaky(K.Model):
        def train_on_batch(self, *args, **kwargs):
            if self.train_function is None:  # a fresh trace: it leaves this alive, as a trace's own leaves
                kept.append(tf.ones([leak // 4], tf.float32))  # made by TensorFlow: in its allocator
            return super().train_on_batch(*args, **kwargs)

    inp = K.Input((256,))
    model = Leaky(inp, L.Dense(8)(L.Dense(256, use_bias=False)(inp)))
    model.compile("adam", "mse")
    got = ks.keras_step_peaks(model, Ladder(16, 10 ** 10, lambda b: 10 ** 6 * b), "adam")
    assert sorted(got["steps"]) == [4, 8, 16] and len(kept) >= 4 + 2, (sorted(got["steps"]), len(kept))
    first = max(got["steps"][16][:12])
    assert first >= leak, f"the first trace's own {leak} B were not counted in it: {first} B"
    for b in (4, 8):
        assert max(got["steps"][b]) < first + leak / 2, \
            f"batch {b}, measured after the target, read {max(got['steps'][b])} B against the target's first trace " \
            f"{first} B: what the target's traces left alive counted as batch {b}'s"
