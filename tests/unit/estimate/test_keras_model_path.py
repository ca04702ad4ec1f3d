"""The analytic Keras model on what users write beyond the layer types it has rules for: a nested model
applied to several inputs (siamese towers), custom layers and ``Lambda`` (read as the layers and ops
their call applies, or from TensorFlow's traced gradient of the call), without touching the user's
model. Real TensorFlow on both Keras versions (``scripts/env.sh main`` / ``latest``)."""
from __future__ import annotations

import os
import warnings

import pytest


@pytest.fixture
def tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return pytest.importorskip("tensorflow")


def _model_figure(model, batch=8, **kw):
    from distmem.estimate import estimate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return estimate(model, batch, "sgd", method="model", device="cpu", **kw)


def test_a_tower_applied_to_two_inputs_holds_two_sets_of_activations(tf):
    K, L = tf.keras, tf.keras.layers
    tower = K.Sequential([K.Input((32, 32, 3)), L.Conv2D(16, 3, padding="same", activation="relu"),
                          L.Conv2D(16, 3, padding="same", activation="relu"), L.GlobalAveragePooling2D()])
    a, b = K.Input((32, 32, 3)), K.Input((32, 32, 3))
    twice = K.Model([a, b], L.Dense(1)(L.Concatenate()([tower(a), tower(b)])))
    c = K.Input((32, 32, 3))
    once = K.Model(c, L.Dense(1)(tower(c)))
    est2, est1 = _model_figure(twice), _model_figure(once)
    # the tower's rows are one set of weights, its kept activations two
    assert est2.params == est1.params + 16  # the head reads 32 features instead of 16
    assert est2.activation_bytes() >= 1.9 * est1.activation_bytes()


def _block_layer(K, L, tf, f):
    class Block(L.Layer):
        """conv-bn-relu-conv-bn plus the input, as a layer of its own."""

        def __init__(self, **kw):
            super().__init__(**kw)
            self.c1, self.b1 = L.Conv2D(f, 3, padding="same", use_bias=False), L.BatchNormalization()
            self.c2, self.b2 = L.Conv2D(f, 3, padding="same", use_bias=False), L.BatchNormalization()

        def call(self, x, training=None):
            h = K.activations.relu(self.b1(self.c1(x), training=training))
            return K.activations.relu(self.b2(self.c2(h), training=training) + x)
    return Block


def test_a_custom_layer_is_sized_as_the_layers_it_calls(tf):
    """A residual block written as a Layer is estimated as the same block written functionally
    (the fallback rule, which kept only its input and output, missed its inner activations)."""
    K, L = tf.keras, tf.keras.layers
    Block = _block_layer(K, L, tf, 16)
    inp = K.Input((32, 32, 16))
    x = inp
    for _ in range(3):
        x = Block()(x)
    custom = K.Model(inp, L.Dense(4)(L.GlobalAveragePooling2D()(x)))
    inp2 = K.Input((32, 32, 16))
    x = inp2
    for _ in range(3):
        h = L.Activation("relu")(L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(x)))
        x = L.Activation("relu")(L.Add()([L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(h)), x]))
    functional = K.Model(inp2, L.Dense(4)(L.GlobalAveragePooling2D()(x)))
    est_c, est_f = _model_figure(custom), _model_figure(functional)
    assert est_c.params == est_f.params
    assert 0.8 <= est_c.activation_bytes() / est_f.activation_bytes() <= 1.25
    assert 0.8 <= est_c.peak_bytes / est_f.peak_bytes <= 1.25
    assert not any("no sizing rule" in w for w in est_c.warnings)


def test_reading_a_custom_layer_leaves_the_model_as_it_was(tf):
    """The call run to read a layer adds nodes and losses to its layers; they are taken off again,
    so the model trains (and reports its losses) as before."""
    import numpy as np
    K, L = tf.keras, tf.keras.layers

    class KL(L.Layer):
        def call(self, inputs):
            mean, log_var = inputs
            self.add_loss(-0.5 * tf.reduce_mean(1 + log_var - tf.square(mean) - tf.exp(log_var)))
            return mean
    Block = _block_layer(K, L, tf, 8)
    inp = K.Input((16, 16, 8))
    h = L.Flatten()(Block()(inp))
    mean = KL()([L.Dense(4)(h), L.Dense(4)(h)])
    model = K.Model(inp, L.Dense(2)(mean))
    model.compile("adam", "mse")
    inner = [lay for lay in model.layers if type(lay).__name__ == "Block"][0]
    before = [len(getattr(s, "_inbound_nodes", [])) for s in (inner.c1, inner.b1, inner.c2, inner.b2)]
    losses = len(model.losses)
    _model_figure(model)
    assert [len(getattr(s, "_inbound_nodes", [])) for s in (inner.c1, inner.b1, inner.c2, inner.b2)] == before
    assert len(model.losses) == losses
    model.train_on_batch(np.random.rand(4, 16, 16, 8).astype("float32"), np.random.rand(4, 2).astype("float32"))


def test_a_layer_whose_call_applies_tensorflow_ops_is_read_from_its_traced_gradient(tf):
    """``traced.traced_keeps``: the forward tensors TensorFlow's own gradient reads. x * sigmoid(x)
    keeps x and sigmoid(x); exp(x) keeps its output; x + 1 keeps nothing."""
    from distmem.estimate.keras.access import node_inputs
    from distmem.estimate.keras.traced import traced_keeps
    from distmem.estimate.keras.unroll import call_arguments
    K, L = tf.keras, tf.keras.layers

    class Swish(L.Layer):
        def call(self, x):
            return x * tf.sigmoid(x)

    class Exp(L.Layer):
        def call(self, x):
            return tf.exp(x)

    class Shift(L.Layer):
        def call(self, x):
            return x + 1.0
    inp = K.Input((64,))
    outs = [Swish()(inp), Exp()(inp), Shift()(inp)]
    K.Model(inp, outs)
    got = []
    for out in outs:
        layer, node = out._keras_history[0], out._keras_history[0]._inbound_nodes[0]
        args, kwargs = call_arguments(node)
        got.append(traced_keeps(layer, args, kwargs, node_inputs(node), tf))
    swish, exp, shift = got
    assert swish["keep_in"] == [0] and swish["kept_extra"] == [64 * 4]
    assert exp["keep_out"] == [0] and not exp["keep_in"] and not exp["kept_extra"]
    assert not shift["keep_in"] and not shift["keep_out"] and not shift["kept_extra"]
