"""No figure without a bound (DESIGN.md): a carry the measured points cannot hold is refused, loudly,
with both figures; every estimate says where its figure comes from and how far the real peak can
be; the target batch is measured where it fits; ``fit`` never plans below the model's state. The
three-layer MLP of issue 37 (estimated at 2.1 TiB with exit 0) is checked against a reference
measured in a fresh process, through ``distmem estimate`` and ``distmem fit`` as a user runs them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from distmem.errors import ConfigError
from distmem.estimate.measure.extrapolate import Ladder, physical_interval
from distmem.estimate.table import Estimate, LayerEstimate

MiB = 1024 ** 2

MLP = textwrap.dedent("""
    import tensorflow as tf
    def build(input_shape=(128,)):
        inp = tf.keras.Input(input_shape)
        h = tf.keras.layers.Dense(256, activation="relu")(inp)
        h = tf.keras.layers.Dense(128, activation="relu")(h)
        return tf.keras.Model(inp, tf.keras.layers.Dense(10)(h))
""")

#: a fresh process trains the MLP as its user would and reports the worst step's peak (the reference):
#: of six steps, as the estimate's figure is — a 1.3 MB model's steps alternate between 1.29 and
#: 1.43 MB (a 131 KB kernel-sized buffer more or less at the peak), which three steps may miss
REFERENCE = textwrap.dedent("""
    import json, os, sys
    import numpy as np, tensorflow as tf
    sys.path.insert(0, sys.argv[2])
    from mlp_issue37 import build
    b = int(sys.argv[1])
    m = build()
    m.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = tf.constant(np.random.rand(b, 128).astype("float32")), tf.constant(np.random.randint(0, 10, b))
    peaks = []
    for _ in range(6):
        tf.config.experimental.reset_memory_stats("CPU:0")
        m.train_on_batch(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    # and six steps of fit on a dataset batched as users batch one: the second trace a job makes (the
    # batch dimension open), which the measured path measures too (bench/estimate/keras_heldout.py's
    # reference, the same two traces)
    class Peaks(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_end(self, batch, logs=None):
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    ds = tf.data.Dataset.from_tensors((x, y)).unbatch().batch(b).repeat()
    m.fit(ds, epochs=1, steps_per_epoch=6, verbose=0, callbacks=[Peaks()])
    print(json.dumps(max(peaks)))
""")


def _env(tmp_path, reference=False):
    """A user's shell (TensorFlow's default CPU allocator, as issue 37 ran it); the reference trains
    under the BFC allocator distmem's TensorFlow adapter installs."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", DISTMEM_MEASURE_CACHE="off",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    if reference:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    return env


def _distmem(args, tmp_path, timeout=600):
    return subprocess.run([sys.executable, "-m", "distmem", *args], capture_output=True, text=True,
                          env=_env(tmp_path), cwd=tmp_path, timeout=timeout)


# ------------------------------------------------------------------ pure rules

def test_physical_interval_is_what_an_affine_peak_allows():
    pts = [(4, 1200), (8, 1400)]
    lo, hi = physical_interval(pts, 16, floor=1000, tolerance=0.0)
    assert (lo, hi) == (1400, 2800)  # at least the larger batch's peak, at most it x 16 / 8
    lo, hi = physical_interval(pts, 2, floor=1000, tolerance=0.0)
    assert (lo, hi) == (1000, 1200)  # at most the smaller batch's peak, never below the state
    lo, hi = physical_interval(pts, 8, tolerance=0.1)
    assert lo == int(1400 * 0.9) and hi == int(1400 * 1.1)


def test_the_ladder_measures_the_target_first_where_it_fits():
    lad = Ladder(16, memory_bytes=10 * MiB, predict_high=lambda b: b * 100_000)
    order = []
    while (b := lad.next()) is not None:
        order.append(b)
        lad.record(b, b * 90_000)
    assert order == [16, 4, 8] and lad.summary()["measured"] == [4, 8, 16]


def test_the_ladder_climbs_to_what_fits_and_keeps_three_points():
    # the model says 1 MiB per sample: batch 64 and 32 do not fit 20 MiB, 16 does; the steps take half
    # that, so the measured peaks let it climb to 32, and predict 64 over the memory at hand
    lad = Ladder(64, memory_bytes=20 * MiB, predict_high=lambda b: b * MiB)
    order = []
    while (b := lad.next()) is not None:
        order.append(b)
        lad.record(b, b * MiB // 2)
    assert order == [4, 8, 16, 32] and set(lad.refused) == {64} and "predicted" in lad.refused[64]
    # a batch that runs out of memory ends the climb; smaller ones are added below
    lad = Ladder(16, memory_bytes=10 ** 12, predict_high=lambda b: 0)
    assert lad.next() == 16
    lad.failed(16, "out of memory")
    order = []
    while (b := lad.next()) is not None:
        order.append(b)
        lad.record(b, 1000 * b)
    assert order == [2, 4, 8] and "out of memory" in lad.refused[16]


def test_a_cheap_target_is_drawn_again_in_fresh_traces(monkeypatch):
    """The target batch's steps go on in fresh traces while they are cheap (the executor's order is
    drawn again with each trace; its high mode is what a limit must hold), its peak the worst of all;
    the other batches of the ladder, and a target whose first steps took the budget, run once."""
    tf = pytest.importorskip("tensorflow")
    import numpy as np
    from distmem.estimate.measure import keras_steps as S
    calls = []

    def step(xs, ys, n, dev, other, fresh=False):
        calls.append((int(xs[0].shape[0]), n, fresh))
        return [1000 * len(calls)] * n

    def run():
        calls.clear()
        peaks, per = {}, {}
        S._run(step, [([4], "float32")], None, Ladder(16, memory_bytes=10 ** 12, predict_high=lambda b: 0), None,
               S.OTHER_STEPS, S.TARGET_STEPS, "CPU:0", 0, peaks, per, np, tf)
        return peaks, per
    peaks, per = run()
    at16 = [c for c in calls if c[0] == 16]
    assert at16[0] == (16, S.TARGET_STEPS, False) and len(at16) == S.TARGET_TRACES
    assert all(c == (16, S.TRACE_STEPS, True) for c in at16[1:])
    assert [c for c in calls if c[0] != 16] == [(4, S.OTHER_STEPS, False), (8, S.OTHER_STEPS, False)]
    assert peaks[16] == 1000 * S.TARGET_TRACES and len(per[16]) == S.TARGET_STEPS + S.TRACE_STEPS * (S.TARGET_TRACES - 1)
    monkeypatch.setattr(S, "TARGET_SECONDS", 0.0)  # the first steps took the budget
    peaks, per = run()
    assert [c[0] for c in calls] == [16, 4, 8] and len(per[16]) == S.TARGET_STEPS


def _table(peak_fn, framework="keras"):
    rows = [LayerEstimate("d", "Dense", params=100, param_bytes=400, grad_bytes=400, optimizer_bytes=800,
                          activation_bytes_per_sample=10, output_bytes_per_sample=4)]
    return Estimate(framework, "m", 16, "float32", {"name": "Adam"}, rows, "analytic", device="cpu",
                    _peak_fn=lambda b, train: {"peak": peak_fn(b), "phase": "backward"},
                    _parts_fn=lambda b: {"weights": 400, "optimizer state": 800, "activations": peak_fn(b) - 1200})


def test_a_carry_the_measured_points_cannot_hold_is_refused_with_both_figures():
    """Issue 37's MLP: the model counted nearly nothing at the small batches (a prior of 1 byte where
    1.4 MiB was measured), so the 'scale' rule carried a ratio of ~10^6 to the target: 2.1 TiB."""
    from distmem.estimate.measure.carry import with_measurement
    prior = _table(lambda b: 1 if b < 16 else 1_600_000)
    got = {"device": "CPU:0", "points": [[4, 1_250_000], [8, 1_450_000]], "steps": {}, "floor": 0}
    with pytest.warns(UserWarning, match="refused"):
        est = with_measurement(prior, prior, got)
    lo, hi = physical_interval([(4, 1_250_000), (8, 1_450_000)], 16, prior.state_floor)
    assert lo <= est.peak_bytes <= hi and est.peak_bytes < 4 * MiB
    note = next(w for w in est.warnings if "refused" in w)
    assert "TiB" in note and "MiB" in note  # the refused figure and the one used, both named
    assert est.measurement["refused"] == note and est.bound().source == "carried"
    assert sum(est.breakdown().values()) == est.peak_bytes


def test_every_estimate_carries_its_bound_and_a_measured_one_is_never_below_the_state():
    from distmem.estimate.measure.carry import with_measurement
    model = _table(lambda b: 1200 + 100 * b)
    got = {"device": "CPU:0", "points": [[4, 1000], [8, 1100], [16, 1300]], "steps": {}, "floor": 0}
    est = with_measurement(model, model, got)
    bd = est.bound()
    assert bd.source == "measured" and est.peak_bytes == 1300 + 0 or est.peak_bytes >= est.state_floor
    assert est.peak_bytes >= est.state_floor == 1200
    assert bd.low_bytes >= est.state_floor and bd.high_bytes > est.peak_bytes
    assert est.bound(32).source == "carried" and est.bound(32).high_bytes > est.bound(32).low_bytes
    d = est.to_dict(per_layer=False)
    assert d["bound"]["source"] == "measured" and d["bound"]["high_bytes"] == bd.high_bytes
    # a model figure far from the measured one is said, with both figures
    far = with_measurement(_table(lambda b: 10_000 * b + 1200), _table(lambda b: 10_000 * b + 1200), got)
    assert any("x the model's" in w for w in far.warnings)


# ------------------------------------------------------------------ issue 37's MLP, as a user runs it

@pytest.fixture
def mlp(tmp_path):
    pytest.importorskip("tensorflow")
    (tmp_path / "mlp_issue37.py").write_text(MLP)
    return tmp_path


def _reference(tmp_path, batch):
    (tmp_path / "reference_issue37.py").write_text(REFERENCE)
    done = subprocess.run([sys.executable, str(tmp_path / "reference_issue37.py"), str(batch), str(tmp_path)],
                          capture_output=True, text=True, env=_env(tmp_path, reference=True), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1])


def test_the_three_layer_mlp_is_estimated_within_25_percent(mlp):
    done = _distmem(["estimate", "--model", "mlp_issue37:build", "--input-shape", "128", "--batch-size", "16",
                     "--json", "--device", "cpu"], mlp)
    assert done.returncode == 0, done.stderr[-2000:]
    est = json.loads(done.stdout)
    assert est["params"] == 67_210
    ref = _reference(mlp, 16)
    assert 0.75 <= est["peak_bytes"] / ref <= 1.25, (est["peak_bytes"], ref)
    assert est["bound"]["source"] == "measured" and est["bound"]["low_bytes"] <= ref <= est["bound"]["high_bytes"]
    assert est["measurement"]["at_target"] and est["measurement"]["seconds"] > 0
    table = _distmem(["estimate", "--model", "mlp_issue37:build", "--input-shape", "128", "--batch-size", "16"], mlp)
    assert table.returncode == 0 and "measured at the target batch" in table.stdout and "cost" in table.stdout


def test_fit_never_plans_below_the_models_state(mlp):
    done = _distmem(["fit", "--model", "mlp_issue37:build", "--input-shape", "128", "--global-batch-size", "16",
                     "--gpus", "2x16GiB", "--json"], mlp)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    state = 67_210 * 4 * 3  # weights and Adam's two slots, whole where nothing shards or splits them
    whole = [s for c in result["fits"] if not c["layout"].get("shard") and c["layout"]["pipeline"] == 1
             for s in c["stages"]]
    assert whole and all(s["planned_bytes"] >= state and s["allocator_bytes"] >= state for s in whole)
    assert all(s["planned_bytes"] >= 1024 ** 2 for c in result["fits"] for s in c["stages"])


# ------------------------------------------------------------------ any argument reaches the child

def test_an_optimizer_object_reaches_the_measuring_child_as_its_configuration(mlp, monkeypatch):
    """docs/estimate.md's estimate("keras:...", optimizer=tf.keras.optimizers.Adam()) failed with
    "cannot pickle 'weakref.ReferenceType'": the live optimizer was handed to the child."""
    import tensorflow as tf
    from distmem.estimate import estimate
    from distmem.estimate.measure.portable import portable, rebuild
    monkeypatch.syspath_prepend(str(mlp))
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
    opt = tf.keras.optimizers.Adam(learning_rate=0.01, amsgrad=True)
    again = rebuild(portable(opt, "optimizer"))
    assert type(again) is type(opt) and again.get_config()["amsgrad"] and again is not opt
    est = estimate("mlp_issue37:build", batch_size=8, optimizer=opt, input_shape=(128,), method="measure",
                   device="cpu")
    assert est.method == "measured" and est.optimizer["slots_per_weight"] == 3
    assert "child process" in est.measurement["how"]
    with pytest.raises(ConfigError, match="loss=.*cannot be sent"):
        portable(lambda y, p: y, "loss")


# ------------------------------------------------------------------ what cannot be measured is carried

def _convnet(K):
    L = K.layers
    inp = K.Input((32, 32, 3))
    h = L.Conv2D(32, 3, padding="same", activation="relu")(inp)
    h = L.Conv2D(32, 3, padding="same", activation="relu")(h)
    model = K.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(h)))
    model.compile("adam", K.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_target_that_does_not_fit_is_carried_from_three_batches_that_do(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    from distmem.estimate import estimate
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
    model = _convnet(tf.keras)
    at_target = estimate(model, 32, "adam", method="measure", device="cpu")
    peak32 = at_target.peak_bytes
    assert at_target.bound().source == "measured" and at_target.measurement["at_target"]
    # the memory at hand is 70% of what batch 32 takes, read from the half batch the target's
    # measurement also ran where batch 32's worst step read far above twice it (on a loaded CI core,
    # one step's executor order): 70% of such a figure can exceed what the smaller batches predict for
    # batch 32, and the target would fit the memory at hand and run
    half = dict(at_target.measurement["points"]).get(16)
    memory = int(0.7 * min(peak32, 2 * half if half else peak32))
    carried = estimate(model, 32, "adam", method="measure", device="cpu", memory_at_hand=memory)
    m = carried.measurement
    assert not m["at_target"] and carried.bound().source == "carried" and len(m["points"]) >= 3, \
        (memory, peak32, at_target.measurement["points"], m["points"], m["ladder"])
    assert "32" in m["ladder"]["not_run"] and max(b for b, _ in m["points"]) < 32
    assert all(y <= memory * 1.25 for _, y in m["points"])  # nothing ran beyond the memory at hand
    # the carry is never an absurd figure (within 0.5x-2x of the figure measured at the target), and its
    # bound is the carried path's, around the carried figure, saying what it rests on. How often the
    # bound covers the target is the benchmark's figure, not this test's: the carry's spread from a few
    # small batches on this case ran from -14.9% (a fresh-clone run: 14.42 MB measured, carried bound
    # up to 14.11 MB) to +56% of the target's figure from run to run on 2 loaded cores, the fit half's
    # from -12.4% to +78%, and the held-out half's references fall inside the carried bound in 13 of 16
    # (bench/results/estimate_keras_heldout_tf215.json)
    assert 0.5 <= carried.peak_bytes / peak32 <= 2.0
    bd = carried.bound()
    assert bd.source == "carried" and bd.low_bytes < carried.peak_bytes < bd.high_bytes
    assert "estimate_keras_heldout" in bd.basis and "fit half" in bd.basis


def test_a_subclassed_model_is_measured_without_a_layer_graph(monkeypatch):
    """No layer graph to model: the table has its weights, the figure is measured."""
    tf = pytest.importorskip("tensorflow")
    from distmem.estimate import estimate
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
    K, L = tf.keras, tf.keras.layers

    class Net(K.Model):
        def __init__(self):
            super().__init__()
            self.c = L.Conv2D(16, 3, padding="same", activation="relu")
            self.pool = L.GlobalAveragePooling2D()
            self.head = L.Dense(4)

        def call(self, x, training=False):
            return self.head(self.pool(self.c(x)))
    net = Net()
    net(tf.zeros((1, 16, 16, 3)))
    net.compile("sgd", "mse")
    est = estimate(net, 8, "sgd", method="measure", device="cpu", input_shape=(16, 16, 3))
    assert est.method == "measured" and est.bound().source == "measured"
    assert est.params == 3 * 3 * 3 * 16 + 16 + 16 * 4 + 4
    assert est.peak_bytes > est.state_floor and est.measurement["loss"].startswith("compiled")
    with pytest.raises(ConfigError):
        estimate(net, 8, "sgd", method="model", device="cpu")
