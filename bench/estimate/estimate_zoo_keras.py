"""The Keras half of the estimator's zoo (``bench/estimate/estimate_zoo.py`` runs it): every
``keras.applications`` family at two input sizes, recurrent, convolutional, transformer,
recommender and MLP models, and the hand-written ones of ``estimate_zoo_written``; how each is
built, compiled, measured (``estimate_measure``) and estimated."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Tuple

from bench.estimate.estimate_zoo_written import KERAS_WRITTEN, keras_written

__all__ = ["KERAS_CASES", "keras_ns", "keras_optimizer", "keras_build", "keras_compiled", "keras_loss",
           "keras_measure", "keras_estimate", "COST"]


def _k(model, size, batch, optimizer, precision="float32"):
    return {"model": model, "size": size, "batch": batch, "optimizer": optimizer, "precision": precision}


#: (family model, two input sizes); sizes respect each family's minimum (Inception 75, Xception 71)
KERAS_CASES: List[Dict[str, Any]] = [
    _k("ResNet50", 64, 16, "adam"), _k("ResNet50", 96, 8, "momentum", "mixed_bfloat16"),
    _k("ResNet50V2", 64, 16, "sgd"), _k("ResNet50V2", 96, 8, "rmsprop"),
    _k("InceptionV3", 75, 16, "adamw"), _k("InceptionV3", 96, 8, "adam", "mixed_float16"),
    _k("InceptionResNetV2", 75, 8, "sgd"), _k("InceptionResNetV2", 96, 8, "adam"),
    _k("Xception", 71, 16, "rmsprop"), _k("Xception", 96, 8, "momentum"),
    _k("VGG16", 64, 16, "momentum"), _k("VGG16", 96, 8, "adamw"),
    _k("DenseNet121", 64, 16, "adam"), _k("DenseNet121", 96, 8, "sgd", "mixed_bfloat16"),
    _k("MobileNet", 64, 16, "rmsprop"), _k("MobileNet", 96, 16, "adam"),
    _k("MobileNetV2", 64, 16, "adamw"), _k("MobileNetV2", 96, 16, "momentum", "mixed_float16"),
    _k("MobileNetV3Small", 64, 16, "adam"), _k("MobileNetV3Large", 96, 16, "sgd"),
    _k("EfficientNetB0", 64, 16, "adam"), _k("EfficientNetB0", 96, 8, "rmsprop", "mixed_float16"),
    _k("EfficientNetV2B0", 64, 16, "momentum"), _k("EfficientNetV2B0", 96, 8, "adamw"),
    _k("NASNetMobile", 64, 16, "adam"), _k("NASNetMobile", 96, 8, "sgd"),
    _k("ConvNeXtTiny", 64, 8, "adamw"), _k("ConvNeXtTiny", 96, 8, "adam", "mixed_bfloat16"),
    _k("RegNetX002", 64, 16, "momentum"), _k("RegNetY002", 96, 16, "adam"),
    _k("GRU", 60, 32, "rmsprop"), _k("BiLSTM", 50, 32, "adam"), _k("LSTMText", 100, 16, "adam"),
    _k("Conv1D", 200, 32, "momentum"), _k("TransformerEncoder", 64, 16, "adamw"),
    _k("TransformerEncoder", 64, 16, "adam", "mixed_float16"), _k("Recommender", 1, 256, "adam"),
    _k("MLP", 784, 64, "sgd", "mixed_bfloat16"),
] + KERAS_WRITTEN


#: rough cost rank of measuring a Keras case on CPU (``--fast-first``)
COST = {"GRU": 0, "Conv1D": 0, "MLP": 0, "Recommender": 0, "BiLSTM": 1, "LSTMText": 1, "TransformerEncoder": 1,
         "MobileNet": 1, "MobileNetV2": 1, "MobileNetV3Small": 1, "MobileNetV3Large": 2, "RegNetX002": 2,
         "RegNetY002": 2, "EfficientNetB0": 2, "EfficientNetV2B0": 2, "NASNetMobile": 3, "DenseNet121": 3,
         "ResNet50": 4, "ResNet50V2": 4, "InceptionV3": 4, "Xception": 5, "VGG16": 5, "ConvNeXtTiny": 6,
         "InceptionResNetV2": 7}


def keras_ns():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # oneDNN kernels, as TensorFlow runs them by default on x86 Linux
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    # the CPU allocator distmem's TensorFlow adapter installs (apply.tensorflow.prepare): one BFC
    # allocator counting every buffer. oneDNN's own CPU allocator, used without it, leaves buffers
    # below 256 KiB out of get_memory_info, so its peak is not what a distmem report shows
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    import tensorflow as tf
    return tf, tf.keras


def keras_optimizer(name: str):
    _, K = keras_ns()
    o = K.optimizers
    return {"sgd": lambda: o.SGD(), "momentum": lambda: o.SGD(momentum=0.9), "rmsprop": lambda: o.RMSprop(),
            "adam": lambda: o.Adam(), "adamw": lambda: o.AdamW()}[name]()


def keras_build(c: Dict[str, Any]) -> Tuple[Any, Callable[[int], Tuple[Any, Any]]]:
    """(model, make_batch(batch) -> (x, y)) under the case's dtype policy; weights are random."""
    import numpy as np
    tf, K = keras_ns()
    K.mixed_precision.set_global_policy(c["precision"])
    rng = np.random.default_rng(0)
    name, size = c["model"], c["size"]
    L = K.layers
    if any(w["model"] == name for w in KERAS_WRITTEN):
        model, make, loss = keras_written(name, size, K)
        _LOSSES[id(model)] = loss
        return model, make
    if hasattr(K.applications, name) or name in _REGNETS:
        shape = (size, size, 3)
        if hasattr(K.applications, name):
            model = getattr(K.applications, name)(weights=None, input_shape=shape, classes=1000)
        else:  # Keras 3 has no RegNet: the same network, layer for layer, from its published config
            model = _regnet(K, name, shape)
        return model, lambda b: (rng.random((b, *shape), dtype=np.float32), rng.integers(0, 1000, b))

    return _earlier_zoo(name, size, K, L, rng)


def _earlier_zoo(name: str, size: int, K, L, rng):
    """The earlier zoo's recurrent, convolutional, transformer, recommender and MLP models."""
    import numpy as np

    def tokens(seq, vocab, classes):
        return lambda b: (rng.integers(0, vocab, (b, seq)).astype("int32"), rng.integers(0, classes, b))
    if name == "GRU":
        inp = K.Input((size,), dtype="int32")
        h = L.Embedding(5000, 64)(inp)
        h = L.GRU(160, return_sequences=True)(h)
        h = L.GRU(160)(h)
        model = K.Model(inp, L.Dense(10)(h), name="gru")
        return model, tokens(size, 5000, 10)
    if name == "BiLSTM":
        inp = K.Input((size,), dtype="int32")
        h = L.Embedding(5000, 64)(inp)
        h = L.Bidirectional(L.LSTM(96, return_sequences=True))(h)
        h = L.Bidirectional(L.LSTM(96))(h)
        model = K.Model(inp, L.Dense(10)(h), name="bilstm")
        return model, tokens(size, 5000, 10)
    if name == "LSTMText":
        inp = K.Input((size,), dtype="int32")
        h = L.Embedding(10000, 128)(inp)
        h = L.LSTM(256, return_sequences=True)(h)
        h = L.LSTM(256)(h)
        model = K.Model(inp, L.Dense(10)(h), name="lstm_text")
        return model, tokens(size, 10000, 10)
    if name == "Conv1D":
        inp = K.Input((size, 16))
        h = L.Conv1D(64, 5, activation="relu")(inp)
        h = L.MaxPooling1D(2)(h)
        h = L.Conv1D(128, 5, padding="same", activation="relu")(h)
        h = L.BatchNormalization()(h)
        h = L.Conv1D(128, 3, dilation_rate=2, activation="relu")(h)
        h = L.GlobalMaxPooling1D()(h)
        h = L.Dropout(0.3)(h)
        model = K.Model(inp, L.Dense(10)(h), name="conv1d")
        return model, lambda b: (rng.random((b, size, 16), dtype=np.float32), rng.integers(0, 10, b))
    if name == "TransformerEncoder":
        seq, vocab, d, heads, ff, blocks = size, 8000, 128, 4, 512, 3
        inp = K.Input((seq,), dtype="int32")
        h = L.Embedding(vocab, d)(inp)
        for i in range(blocks):
            a = L.MultiHeadAttention(heads, d // heads, dropout=0.1, name=f"mha{i}")(h, h)
            a = L.Dropout(0.1)(a)
            h = L.LayerNormalization()(L.Add()([h, a]))
            f = L.Dense(ff, activation="gelu")(h)
            f = L.Dense(d)(f)
            f = L.Dropout(0.1)(f)
            h = L.LayerNormalization()(L.Add()([h, f]))
        h = L.GlobalAveragePooling1D()(h)
        out = L.Dense(10, dtype="float32")(h)
        model = K.Model(inp, out, name="transformer_encoder")
        return model, tokens(seq, vocab, 10)
    if name == "Recommender":
        users, items, d = 200_000, 100_000, 32
        u_in, i_in = K.Input((1,), dtype="int32"), K.Input((1,), dtype="int32")
        u = L.Flatten()(L.Embedding(users, d)(u_in))
        v = L.Flatten()(L.Embedding(items, d)(i_in))
        h = L.Concatenate()([u, v])
        h = L.Dense(256, activation="relu")(h)
        h = L.Dense(128, activation="relu")(h)
        model = K.Model([u_in, i_in], L.Dense(2)(h), name="recommender")
        return model, lambda b: ([rng.integers(0, users, (b, 1)).astype("int32"),
                                  rng.integers(0, items, (b, 1)).astype("int32")], rng.integers(0, 2, b))
    if name == "MLP":
        inp = K.Input((size,))
        h = L.Dense(2048, activation="relu")(inp)
        h = L.Dropout(0.2)(h)
        h = L.Dense(2048, activation="relu")(h)
        h = L.Dense(1024, activation="relu")(h)
        model = K.Model(inp, L.Dense(10, dtype="float32")(h), name="mlp")
        return model, lambda b: (rng.random((b, size), dtype=np.float32), rng.integers(0, 10, b))
    raise KeyError(f"Keras zoo model {name!r} is not in this Keras's applications")


#: RegNet configs of tf.keras 2.x ``keras.applications.regnet`` (depths, widths, group width, Y: squeeze-excite)
_REGNETS = {"RegNetX002": ([1, 1, 4, 7], [24, 56, 152, 368], 8, False),
            "RegNetY002": ([1, 1, 4, 7], [24, 56, 152, 368], 8, True)}


def _regnet(K, name: str, shape):
    """tf.keras 2.x's RegNetX/Y (``keras/applications/regnet.py``) for a Keras without it (Keras 3)."""
    depths, widths, gw, se = _REGNETS[name]
    L = K.layers

    def conv_bn(x, f, k, stride=1, groups=1, relu=True):
        x = L.Conv2D(f, k, strides=stride, groups=groups, padding="same", use_bias=False,
                     kernel_initializer="he_normal")(x)
        x = L.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)
        return L.ReLU()(x) if relu else x

    def block(x, f_in, f_out, stride):
        skip = conv_bn(x, f_out, 1, stride, relu=False) if stride != 1 else x
        h = conv_bn(x, f_out, 1)
        h = conv_bn(h, f_out, 3, stride, groups=f_out // gw)
        if se:
            s = L.GlobalAveragePooling2D(keepdims=True)(h)
            s = L.Conv2D(int(f_in * 0.25), 1, activation="relu", kernel_initializer="he_normal")(s)
            s = L.Conv2D(f_out, 1, activation="sigmoid", kernel_initializer="he_normal")(s)
            h = L.Multiply()([h, s])
        h = conv_bn(h, f_out, 1, relu=False)
        return L.ReLU()(L.Add()([h, skip]))
    inp = K.Input(shape)
    x = L.Rescaling(1.0 / 255.0)(inp)
    x = conv_bn(x, 32, 3, 2)
    f_in = 32
    for depth, f_out in zip(depths, widths):
        x = block(x, f_in, f_out, 2)
        for _ in range(depth - 1):
            x = block(x, f_out, f_out, 1)
        f_in = f_out
    x = L.GlobalAveragePooling2D()(x)
    return K.Model(inp, L.Dense(1000, activation="softmax")(x), name=name.lower())


_LOSSES: Dict[int, Any] = {}


def keras_loss(model):
    _, K = keras_ns()
    if id(model) in _LOSSES:  # a hand-written model's own loss
        return _LOSSES[id(model)]
    act = getattr(model.layers[-1], "activation", None)
    probs = getattr(act, "__name__", "") == "softmax"  # keras.applications end in a softmax
    return K.losses.SparseCategoricalCrossentropy(from_logits=not probs)


def keras_compiled(c: Dict[str, Any]):
    """(tf, the case's model compiled with its optimizer and loss, one batch x, labels y as tensors):
    what every Keras measuring child (this benchmark's, the trace and the BFC replay) trains on."""
    tf, _ = keras_ns()
    model, make = keras_build(c)
    model.compile(optimizer=keras_optimizer(c["optimizer"]), loss=keras_loss(model))
    x, y = make(c["batch"])
    x = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    y = [tf.constant(a) for a in y] if isinstance(y, list) else tf.constant(y)
    return tf, model, x, y



def keras_measure(c: Dict[str, Any], steps: int) -> Dict[str, Any]:
    from bench.estimate.estimate_measure import keras_train_peaks
    _, model, x, y = keras_compiled(c)
    out = keras_train_peaks(model, x, y, steps)
    return {"peaks": out["peaks"], "step_seconds": out["step_seconds"]}


def _elem_bytes(dtype: object) -> int:
    """Bytes per element of a Keras tensor's dtype, as TensorFlow sizes it (4 where it has none):
    the naive baseline's own sizing, not the estimator's."""
    import tensorflow as tf
    try:
        return int(tf.as_dtype(getattr(dtype, "name", None) or str(dtype)).size) or 4
    except (TypeError, ValueError):
        return 4


def naive_baseline(model: Any, batch: int, slots: int) -> int:
    """The naive peak the estimate is compared with: the weights, their gradients and ``slots`` optimizer
    slots in float32, plus every layer's outputs at ``batch`` (no lifetimes, no temporaries)."""
    outputs = 0
    for layer in model.layers:
        outs = layer.output if isinstance(layer.output, (list, tuple)) else [layer.output]
        for o in outs:
            n = 1
            for d in tuple(o.shape)[1:]:
                n *= int(d)
            outputs += n * _elem_bytes(o.dtype)
    return model.count_params() * 4 * (2 + slots) + outputs * batch


def keras_estimate(c: Dict[str, Any]) -> Dict[str, Any]:
    import warnings
    from distmem.estimate import estimate_keras
    _, K = keras_ns()
    model, _ = keras_build(c)
    opt = keras_optimizer(c["optimizer"])
    t = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_keras(model, c["batch"], opt, device="cpu", name=c["model"])
        peak = est.peak_bytes
    seconds = time.time() - t
    baseline = naive_baseline(model, c["batch"], est.optimizer.get("slots_per_weight") or 0)
    K.mixed_precision.set_global_policy("float32")
    return {"ours": int(peak), "baseline": int(baseline), "phase": est.peak_detail()["phase"],
            "layers": len(est.layers), "estimate_seconds": round(seconds, 3), "warnings": list(est.warnings)}


# ================================================================== PyTorch
