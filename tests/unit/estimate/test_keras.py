"""The Keras estimator's arithmetic on small models whose numbers can be worked out by hand."""
import warnings

import pytest

tf = pytest.importorskip("tensorflow")
K = tf.keras

from distmem.errors import ConfigError  # noqa: E402
from distmem.estimate import estimate_keras  # noqa: E402
from distmem.estimate.optimizers import keras_optimizer  # noqa: E402

KERAS3 = int(str(getattr(K, "__version__", "2")).split(".")[0]) >= 3
#: Keras 2's SGD creates a momentum slot even at momentum=0 (and it is real memory); Keras 3's does not
SGD_SLOTS = 0 if KERAS3 else 1


def rows(est):
    return {r.name: r for r in est.layers}


def test_dense_stack():
    inp = K.Input((8,), name="x")
    h = K.layers.Dense(16, activation="relu", name="d1")(inp)
    out = K.layers.Dense(4, name="d2")(h)
    est = estimate_keras(K.Model(inp, out), batch_size=10, optimizer="adam")
    r = rows(est)
    assert (r["d1"].params, r["d2"].params) == (8 * 16 + 16, 16 * 4 + 4)
    assert r["d1"].param_bytes == r["d1"].grad_bytes == 144 * 4
    assert r["d1"].optimizer_bytes == 2 * 144 * 4  # Adam: m and v
    # d1 keeps its ReLU output (its gradient reads it); d2 keeps the same tensor as its input: counted once,
    # on the earlier layer. The model input is the caller's and not counted.
    assert r["d1"].activation_bytes_per_sample == 16 * 4
    # the loss keeps two output-sized fp32 tensors, carried by the last layer
    assert r["d2"].activation_bytes_per_sample == 2 * 4 * 4
    assert r["d1"].output_bytes_per_sample == 16 * 4
    assert est.activation_bytes() == 10 * (64 + 32)
    costs = est.layer_costs()
    assert costs[0].state_bytes == 144 * 4 * 4 and costs[0].activation_bytes == 640


def test_conv2d_relu_flatten():
    inp = K.Input((8, 8, 3))
    h = K.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(inp)
    h = K.layers.Flatten(name="flat")(h)
    out = K.layers.Dense(2, name="head")(h)
    est = estimate_keras(K.Model(inp, out), batch_size=4, optimizer="sgd")
    r = rows(est)
    assert r["conv"].params == 3 * 3 * 3 * 4 + 4
    assert r["conv"].optimizer_bytes == SGD_SLOTS * r["conv"].param_bytes
    # the ReLU output (8x8x4 fp32) is kept; Flatten is a view of it, which the head also keeps: once
    assert r["conv"].activation_bytes_per_sample == 8 * 8 * 4 * 4
    assert r["flat"].activation_bytes_per_sample == 0 and r["flat"].output_bytes_per_sample == 0
    assert r["conv"].workspace_bytes_per_sample == 8 * 8 * 4 * 4  # the pre-activation


def test_lstm_keeps_per_timestep_state():
    inp = K.Input((5, 3))
    h = K.layers.LSTM(4, name="lstm")(inp)
    out = K.layers.Dense(2, name="head")(h)
    est = estimate_keras(K.Model(inp, out), batch_size=2, optimizer=K.optimizers.SGD(momentum=0.9))
    r = rows(est)
    assert r["lstm"].params == 4 * 4 * (3 + 4 + 1)
    assert r["lstm"].optimizer_bytes == r["lstm"].param_bytes  # one momentum slot
    # per step: the step input (3) and seven hidden-sized tensors (h, c, i, f, o, tanh(g), tanh(c))
    assert r["lstm"].activation_bytes_per_sample == 5 * (3 + 7 * 4) * 4


def test_embedding_gradient_is_batch_sized():
    inp = K.Input((6,), dtype="int32")
    h = K.layers.Embedding(100, 8, name="emb")(inp)
    h = K.layers.Flatten()(h)
    out = K.layers.Dense(2, name="head")(h)
    est = estimate_keras(K.Model(inp, out), batch_size=3, optimizer="adagrad")
    r = rows(est)
    assert r["emb"].params == 800 and r["emb"].optimizer_bytes == 800 * 4  # one accumulator
    assert r["emb"].activation_bytes_per_sample == 0  # the lookup keeps only the (caller's) indices
    assert r["head"].activation_bytes_per_sample == 6 * 8 * 4 + 2 * 2 * 4  # its input + the loss


def test_mixed_precision_halves_activations_and_keeps_fp32_state():
    inp = K.Input((8,))
    h = K.layers.Dense(16, activation="relu", name="d1")(inp)
    out = K.layers.Dense(4, name="d2")(h)
    model = K.Model(inp, out)
    fp32 = rows(estimate_keras(model, batch_size=2, optimizer="adam"))
    mixed_est = estimate_keras(model, batch_size=2, optimizer="adam", precision="mixed_float16")
    mixed = rows(mixed_est)
    assert mixed["d1"].activation_bytes_per_sample == 16 * 2
    assert mixed["d1"].param_bytes == fp32["d1"].param_bytes  # fp32 master weights
    assert mixed["d1"].optimizer_bytes == fp32["d1"].optimizer_bytes
    # each layer reads its weights through an fp16 cast that it keeps for the input gradient
    assert mixed["d1"].activation_fixed_bytes == 144 * 2
    assert mixed_est.precision == "mixed_float16"


@pytest.mark.parametrize("make, slots", [
    (lambda: K.optimizers.SGD(), SGD_SLOTS),
    (lambda: K.optimizers.SGD(momentum=0.9), 1),
    (lambda: K.optimizers.Adam(), 2),
    (lambda: K.optimizers.Adam(amsgrad=True), 3),
    (lambda: K.optimizers.RMSprop(), 1),
    (lambda: K.optimizers.RMSprop(momentum=0.9, centered=True), 3),
    (lambda: K.optimizers.Adagrad(), 1),
])
def test_slots_read_from_the_optimizer_object(make, slots):
    info, _ = keras_optimizer(make())
    assert info.slots_per_weight == slots


def test_unknown_layer_is_read_from_its_call_else_gets_a_fallback_and_a_warning():
    class Doubler(K.layers.Layer):
        def call(self, x):
            return x * 2.0

    class Eager(K.layers.Layer):
        """A call that needs real values: it cannot be read symbolically nor traced."""

        def call(self, x):
            return x * float(x.numpy().max() > 0)

        def compute_output_shape(self, shape):
            return shape

        def compute_output_spec(self, x):  # Keras 3 builds the graph from it
            return K.KerasTensor(x.shape, x.dtype)

    keras2 = int(str(getattr(K, "__version__", "2")).split(".")[0]) < 3
    inp = K.Input((8,))
    h = K.layers.Dense(8, name="d0")(inp)
    h = Doubler(name="twice")(h)
    h = K.layers.Dense(8, name="d1")(h)
    h = Eager(name="eager", **({"dynamic": True} if keras2 else {}))(h)
    out = K.layers.Dense(2)(h)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = estimate_keras(K.Model(inp, out), batch_size=2)
    r = rows(est)
    # x * 2.0 is read as the op it applies: its gradient reads nothing of the layer's
    assert not any("'twice'" in w_ for w_ in est.warnings)
    assert "fallback" in r["eager"].note
    assert any("'eager' (Eager)" in str(w.message) for w in caught)
    assert any("eager" in w_ for w_ in est.warnings)
    # assumed to keep its input (d1's output) and its output (which the head reads too: counted once)
    assert r["eager"].activation_bytes_per_sample == 8 * 4 + 8 * 4


def test_peak_grows_with_batch_and_cpu_mode_skips_small_buffers(monkeypatch):
    # oneDNN's CPU allocator (no TF_CPU_ALLOCATOR_USE_BFC: an earlier distmem.init() in this process
    # may have set it) skips buffers below 256 KiB in its statistics; the BFC one counts them all.
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    inp = K.Input((32, 32, 8))
    h = K.layers.Conv2D(32, 3, padding="same", activation="relu")(inp)
    h = K.layers.GlobalAveragePooling2D()(h)
    model = K.Model(inp, K.layers.Dense(10)(h))
    est = estimate_keras(model, batch_size=8)
    assert est.train_bytes(16) > est.train_bytes(8) > est.inference_bytes(8) > est.param_bytes
    cpu = estimate_keras(model, batch_size=1, device="cpu")
    # every buffer of this model at batch 1 (at most 32x32x32 fp32 = 128 KiB) is below TensorFlow's 256 KiB
    # CPU statistics threshold; at batch 2 the conv output and its pre-activation reach it
    assert cpu.peak_bytes == 0
    assert cpu.train_bytes(2) >= 2 * 256 * 1024
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    assert estimate_keras(model, batch_size=1, device="cpu").peak_bytes > 0


def test_bad_inputs_name_the_fix():
    with pytest.raises(ConfigError, match="batch_size must be a positive integer"):
        estimate_keras(K.Sequential([K.Input((2,)), K.layers.Dense(1)]), batch_size=0)
    with pytest.raises(ConfigError, match="unknown optimizer 'adamz'"):
        estimate_keras(K.Sequential([K.Input((2,)), K.layers.Dense(1)]), optimizer="adamz")
    with pytest.raises(ConfigError, match="unknown size in dimension"):
        estimate_keras(K.Sequential([K.Input((None, 4)), K.layers.Dense(1)]))


def test_layer_scale_families_have_rules():
    """ConvNeXt's LayerScale keeps its input only (x * gamma); Inception-ResNet's CustomScaleLayer
    (x + y * constant) keeps nothing: no fallback, no warning, no inputs-and-outputs guess."""
    apps = K.applications
    convnext = getattr(apps, "ConvNeXtTiny", None)
    if convnext is None:
        pytest.skip("this Keras has no ConvNeXt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = estimate_keras(convnext(weights=None, input_shape=(32, 32, 3)), batch_size=2, optimizer="sgd")
    assert not [w for w in caught if "no sizing rule" in str(w.message)]
    scales = [r for r in est.layers if r.kind == "LayerScale"]
    assert scales and all(not r.note for r in scales)
    irn = apps.InceptionResNetV2(weights=None, input_shape=(75, 75, 3))
    est = estimate_keras(irn, batch_size=2, optimizer="sgd")
    custom = [r for r in est.layers if r.kind == "CustomScaleLayer"]
    assert custom and all(r.activation_bytes(2) == 0 and not r.note for r in custom)
