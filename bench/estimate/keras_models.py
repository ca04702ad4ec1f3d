"""Keras models for the estimate benchmark (``keras_heldout.py``), written the way TensorFlow users
write them: the functional API with shared layers and several inputs and outputs, ``Sequential``,
custom layers, a subclassed ``Model``, a ``Lambda``, ``add_loss``, their own losses and metrics,
compiled as their task compiles them; and ``keras.applications`` at small inputs.

The cases come in families (a segmentation decoder, an autoencoder, siamese towers, a recurrent
tagger, TextCNN, separable convolutions, a mixer, a custom ResNet...), each with one member in the
**fit** half (what rules, carries and margins may be fitted on) and another, written differently,
in the **held** half (what the benchmark reports). ``build(case)`` returns ``(model, make_batch)``
with the model compiled; nothing here knows distmem.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

__all__ = ["CASES", "build", "case_id", "cases"]


def _c(model: str, half: str, family: str, size: int, batch: int, optimizer: str,
       precision: str = "float32") -> Dict[str, Any]:
    return {"model": model, "half": half, "family": family, "size": size, "batch": batch, "optimizer": optimizer,
            "precision": precision}


CASES: List[Dict[str, Any]] = [
    # segmentation decoders
    _c("UNet", "fit", "segmentation", 64, 8, "adam"),
    _c("FPNSeg", "held", "segmentation", 64, 8, "adam"),
    # autoencoder decoders
    _c("ConvAutoencoder", "fit", "autoencoder", 64, 16, "rmsprop"),
    _c("VAE", "held", "autoencoder", 32, 32, "adam"),
    _c("DCGANGenerator", "held", "autoencoder", 32, 32, "adam", "mixed_bfloat16"),
    # siamese towers, shared layers
    _c("SiameseTower", "fit", "siamese", 64, 16, "adam"),
    _c("TripletShared", "held", "siamese", 48, 16, "adam"),
    # bidirectional recurrent taggers
    _c("BiLSTMTagger", "fit", "recurrent", 60, 32, "adam"),
    _c("BiGRUTagger", "held", "recurrent", 80, 16, "rmsprop"),
    _c("CRNN", "fit", "recurrent", 32, 16, "adam"),
    _c("Forecaster", "held", "recurrent", 96, 32, "adam"),
    # TextCNN
    _c("TextCNN", "fit", "textcnn", 100, 32, "adam"),
    _c("TextCNNDeep", "held", "textcnn", 200, 32, "adamw"),
    # separable convolutions
    _c("MiniXception", "fit", "separable", 64, 16, "adam"),
    _c("SepCNN", "held", "separable", 48, 16, "momentum"),
    # mixers
    _c("MLPMixer", "fit", "mixer", 64, 16, "adamw"),
    _c("ConvMixer", "held", "mixer", 32, 16, "adam"),
    # custom ResNets
    _c("ResNetLayers", "fit", "resnet", 64, 16, "momentum"),
    _c("ResNetFunctional", "held", "resnet", 64, 16, "adam"),
    _c("SubclassedResNet", "held", "resnet", 32, 16, "momentum"),
    # transformers
    _c("TextTransformer", "fit", "transformer", 64, 16, "adam"),
    _c("TinyViT", "held", "transformer", 32, 16, "adamw"),
    # several inputs / outputs
    _c("MultiTask", "fit", "multi_io", 64, 16, "adam"),
    _c("WideDeep", "held", "multi_io", 1, 256, "adam"),
    # Sequential CNNs
    _c("SequentialCNN", "fit", "sequential", 28, 64, "adam"),
    _c("SequentialVGG", "held", "sequential", 32, 32, "momentum"),
    # MLPs
    _c("MLPDeep", "fit", "mlp", 784, 64, "sgd"),
    _c("MLP3", "held", "mlp", 128, 16, "adam"),
    # hand-written blocks of known architectures
    _c("InceptionBlocks", "fit", "blocks", 64, 16, "adam"),
    _c("DenseNetSmall", "held", "blocks", 48, 16, "adam"),
    _c("AttentionBiLSTM", "held", "recurrent", 50, 32, "adam"),
    # keras.applications
    _c("MobileNetV2", "fit", "applications", 64, 16, "adam"),
    _c("ResNet50", "fit", "applications", 64, 8, "momentum"),
    _c("DenseNet121", "fit", "applications", 64, 8, "adam"),
    _c("EfficientNetB0", "fit", "applications", 64, 8, "rmsprop", "mixed_float16"),
    _c("Xception", "fit", "applications", 71, 8, "sgd"),
    _c("MobileNet", "held", "applications", 64, 16, "rmsprop"),
    _c("ResNet50V2", "held", "applications", 64, 8, "adam"),
    _c("MobileNetV3Small", "held", "applications", 64, 16, "adamw"),
    _c("EfficientNetV2B0", "held", "applications", 64, 8, "momentum"),
    _c("VGG16", "held", "applications", 48, 8, "adam"),
    _c("DenseNet169", "held", "applications", 48, 8, "sgd"),
    _c("ResNet101", "held", "applications", 48, 4, "adam"),
    _c("EfficientNetB1", "held", "applications", 64, 8, "adam"),
    _c("InceptionV3", "held", "applications", 75, 8, "adam", "mixed_bfloat16"),
]


def case_id(c: Dict[str, Any]) -> str:
    return f"{c['model']}@{c['size']}/b{c['batch']}/{c['optimizer']}/{c['precision']}"


def cases(half: str = "all") -> List[Dict[str, Any]]:
    return [c for c in CASES if half in ("all", c["half"])]


def _optimizer(name: str, K):
    o = K.optimizers
    return {"sgd": lambda: o.SGD(0.01), "momentum": lambda: o.SGD(0.01, momentum=0.9),
            "rmsprop": lambda: o.RMSprop(1e-3), "adam": lambda: o.Adam(1e-3), "adamw": lambda: o.AdamW(1e-3)}[name]()


def build(c: Dict[str, Any]) -> Tuple[Any, Callable[[int], Tuple[Any, Any]]]:
    """(the case's model, compiled as its task compiles it; make_batch(batch) -> (x, y))."""
    import numpy as np
    import tensorflow as tf
    K = tf.keras
    K.mixed_precision.set_global_policy(c["precision"])
    rng = np.random.default_rng(0)
    builder = _BUILDERS.get(c["model"])
    if builder is None:
        model, make, loss = _application(c, K, rng)
        metrics: List[Any] = ["accuracy"]
    else:
        model, make, loss, metrics = builder(K, K.layers, c["size"], rng, tf)
    model.compile(optimizer=_optimizer(c["optimizer"], K), loss=loss, metrics=metrics)
    return model, make


def _application(c, K, rng):
    shape = (c["size"], c["size"], 3)
    model = getattr(K.applications, c["model"])(weights=None, input_shape=shape, classes=100)
    import numpy as np
    return (model, lambda b: (rng.random((b, *shape), dtype=np.float32), rng.integers(0, 100, b)),
            K.losses.SparseCategoricalCrossentropy())


def _img(rng, s, ch=3):
    import numpy as np
    return lambda b: rng.random((b, s, s, ch), dtype=np.float32)


# ================================================================== segmentation

def _unet(K, L, s, rng, tf):
    def block(x, f):
        x = L.Conv2D(f, 3, padding="same", activation="relu")(x)
        return L.Conv2D(f, 3, padding="same", activation="relu")(x)
    inp = K.Input((s, s, 3))
    c1 = block(inp, 16)
    c2 = block(L.MaxPooling2D()(c1), 32)
    c3 = block(L.MaxPooling2D()(c2), 64)
    u2 = block(L.concatenate([L.Conv2DTranspose(32, 2, strides=2, padding="same")(c3), c2]), 32)
    u1 = block(L.concatenate([L.Conv2DTranspose(16, 2, strides=2, padding="same")(u2), c1]), 16)
    out = L.Conv2D(4, 1, activation="softmax", dtype="float32")(u1)
    img = _img(rng, s)
    return K.Model(inp, out), lambda b: (img(b), rng.integers(0, 4, (b, s, s))), \
        "sparse_categorical_crossentropy", ["accuracy"]


def _fpn(K, L, s, rng, tf):
    """An FPN-style binary segmenter: a strided encoder, 1x1 laterals, bilinear top-down path."""
    inp = K.Input((s, s, 3))
    feats, x = [], inp
    for f in (24, 48, 96):
        x = L.Conv2D(f, 3, strides=2, padding="same", use_bias=False)(x)
        x = L.BatchNormalization()(x)
        x = L.Activation("relu")(x)
        feats.append(x)
    p = L.Conv2D(64, 1)(feats[-1])
    for f in reversed(feats[:-1]):
        p = L.UpSampling2D(interpolation="bilinear")(p)
        p = L.Add()([p, L.Conv2D(64, 1)(f)])
        p = L.Conv2D(64, 3, padding="same", activation="relu")(p)
    p = L.UpSampling2D(size=2, interpolation="bilinear")(p)
    out = L.Conv2D(1, 1, activation="sigmoid", dtype="float32")(p)
    img = _img(rng, s)
    import numpy as np
    return K.Model(inp, out, name="fpn"), \
        lambda b: (img(b), (rng.random((b, s, s, 1)) > 0.5).astype(np.float32)), "binary_crossentropy", \
        [K.metrics.BinaryAccuracy()]


# ================================================================== autoencoders

def _conv_ae(K, L, s, rng, tf):
    inp = K.Input((s, s, 3))
    h = L.Conv2D(32, 3, strides=2, padding="same", activation="relu")(inp)
    h = L.Conv2D(64, 3, strides=2, padding="same", activation="relu")(h)
    h = L.Conv2DTranspose(64, 3, strides=2, padding="same", activation="relu")(h)
    h = L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(h)
    out = L.Conv2D(3, 3, padding="same", activation="sigmoid")(h)
    img = _img(rng, s)
    return K.Model(inp, out), lambda b: (img(b), img(b)), "mse", []


def _vae(K, L, s, rng, tf):
    """The Keras VAE example's shape: a Sampling layer, a dense bottleneck, a Conv2DTranspose
    decoder, the KL term through add_loss, reconstruction as the compiled loss."""
    latent = 16

    class Sampling(L.Layer):
        def call(self, inputs):
            mean, log_var = inputs
            eps = tf.random.normal(tf.shape(mean))
            return mean + tf.exp(0.5 * log_var) * eps

    class KLDivergence(L.Layer):
        def call(self, inputs):
            mean, log_var = inputs
            self.add_loss(-0.5 * tf.reduce_mean(1 + log_var - tf.square(mean) - tf.exp(log_var)))
            return mean

    inp = K.Input((s, s, 3))
    h = L.Conv2D(32, 3, strides=2, padding="same", activation="relu")(inp)
    h = L.Conv2D(64, 3, strides=2, padding="same", activation="relu")(h)
    h = L.Flatten()(h)
    h = L.Dense(128, activation="relu")(h)
    mean, log_var = L.Dense(latent)(h), L.Dense(latent)(h)
    mean = KLDivergence()([mean, log_var])
    z = Sampling()([mean, log_var])
    d = L.Dense((s // 4) * (s // 4) * 64, activation="relu")(z)
    d = L.Reshape((s // 4, s // 4, 64))(d)
    d = L.Conv2DTranspose(64, 3, strides=2, padding="same", activation="relu")(d)
    d = L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(d)
    out = L.Conv2DTranspose(3, 3, padding="same", activation="sigmoid")(d)
    img = _img(rng, s)
    return K.Model(inp, out, name="vae"), lambda b: (img(b), img(b)), "binary_crossentropy", []


def _dcgan_generator(K, L, s, rng, tf):
    """A DCGAN generator trained alone to reproduce images from noise (its GAN loss aside)."""
    import numpy as np
    inp = K.Input((100,))
    h = L.Dense((s // 8) * (s // 8) * 256, use_bias=False)(inp)
    h = L.BatchNormalization()(h)
    h = L.LeakyReLU()(h)
    h = L.Reshape((s // 8, s // 8, 256))(h)
    for f in (128, 64):
        h = L.Conv2DTranspose(f, 5, strides=2, padding="same", use_bias=False)(h)
        h = L.BatchNormalization()(h)
        h = L.LeakyReLU()(h)
    out = L.Conv2DTranspose(3, 5, strides=2, padding="same", activation="tanh", dtype="float32")(h)
    img = _img(rng, s)
    return K.Model(inp, out, name="generator"), \
        lambda b: (rng.standard_normal((b, 100)).astype(np.float32), img(b) * 2 - 1), "mae", []


# ================================================================== siamese

def _siamese_tower(K, L, s, rng, tf):
    import numpy as np
    tower = K.Sequential([K.Input((s, s, 3)), L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(),
                          L.Conv2D(64, 3, activation="relu"), L.GlobalAveragePooling2D(), L.Dense(64)],
                         name="tower")
    a, b = K.Input((s, s, 3)), K.Input((s, s, 3))
    d = L.Lambda(lambda ab: tf.abs(ab[0] - ab[1]))([tower(a), tower(b)])
    out = L.Dense(1, activation="sigmoid")(d)
    img = _img(rng, s)
    return K.Model([a, b], out), \
        lambda n: ([img(n), img(n)], rng.integers(0, 2, (n, 1)).astype(np.float32)), "binary_crossentropy", \
        ["accuracy"]


def _triplet(K, L, s, rng, tf):
    """Three inputs through the same layer objects (shared weights without a sub-model), embeddings
    L2-normalised, a triplet loss written as a loss function over the stacked distances."""
    import numpy as np
    conv1 = L.Conv2D(32, 3, padding="same", activation="relu")
    pool = L.MaxPooling2D()
    conv2 = L.Conv2D(64, 3, padding="same", activation="relu")
    gap = L.GlobalAveragePooling2D()
    dense = L.Dense(64)
    norm = L.UnitNormalization() if hasattr(L, "UnitNormalization") else L.Lambda(lambda t: tf.math.l2_normalize(t, -1))

    def embed(x):
        return norm(dense(gap(conv2(pool(conv1(x))))))
    anc, pos, neg = K.Input((s, s, 3)), K.Input((s, s, 3)), K.Input((s, s, 3))
    ea, ep, en = embed(anc), embed(pos), embed(neg)
    d_pos = L.Dot(axes=1)([ea, ep])
    d_neg = L.Dot(axes=1)([ea, en])
    out = L.Concatenate()([d_pos, d_neg])

    def triplet_loss(y_true, y_pred, margin=0.2):
        return tf.maximum(y_pred[:, 1] - y_pred[:, 0] + margin, 0.0)
    img = _img(rng, s)
    return K.Model([anc, pos, neg], out, name="triplet"), \
        lambda n: ([img(n), img(n), img(n)], np.zeros((n, 2), np.float32)), triplet_loss, []


# ================================================================== recurrent

def _bilstm_tagger(K, L, s, rng, tf):
    inp = K.Input((s,), dtype="int32")
    h = L.Embedding(6000, 64)(inp)
    h = L.Bidirectional(L.LSTM(64, return_sequences=True))(h)
    out = L.TimeDistributed(L.Dense(12, activation="softmax"))(h)
    return K.Model(inp, out), \
        lambda b: (rng.integers(1, 6000, (b, s)).astype("int32"), rng.integers(0, 12, (b, s))), \
        "sparse_categorical_crossentropy", ["accuracy"]


def _bigru_tagger(K, L, s, rng, tf):
    inp = K.Input((s,), dtype="int32")
    h = L.Embedding(8000, 96, mask_zero=True)(inp)
    h = L.Bidirectional(L.GRU(96, return_sequences=True))(h)
    h = L.Dropout(0.3)(h)
    h = L.Bidirectional(L.GRU(48, return_sequences=True))(h)
    out = L.Dense(20)(h)
    return K.Model(inp, out, name="bigru_tagger"), \
        lambda b: (rng.integers(1, 8000, (b, s)).astype("int32"), rng.integers(0, 20, (b, s))), \
        K.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]


def _crnn(K, L, s, rng, tf):
    """Text-line recognition: conv features over a 32 x 128 line, read left to right by a BiGRU."""
    import numpy as np
    w = 4 * s
    inp = K.Input((s, w, 1))
    h = L.Conv2D(32, 3, padding="same", activation="relu")(inp)
    h = L.MaxPooling2D()(h)
    h = L.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = L.MaxPooling2D()(h)
    h = L.Permute((2, 1, 3))(h)
    h = L.Reshape((w // 4, (s // 4) * 64))(h)
    h = L.Dense(64, activation="relu")(h)
    h = L.Bidirectional(L.GRU(64, return_sequences=True))(h)
    out = L.Dense(40, activation="softmax")(h)
    return K.Model(inp, out, name="crnn"), \
        lambda b: (rng.random((b, s, w, 1), dtype=np.float32), rng.integers(0, 40, (b, w // 4))), \
        "sparse_categorical_crossentropy", []


def _forecaster(K, L, s, rng, tf):
    import numpy as np
    inp = K.Input((s, 8))
    h = L.Conv1D(32, 5, padding="causal", activation="relu")(inp)
    h = L.LSTM(64, return_sequences=True)(h)
    h = L.LSTM(32)(h)
    out = L.Dense(24)(h)
    return K.Model(inp, out, name="forecaster"), \
        lambda b: (rng.random((b, s, 8), dtype=np.float32), rng.random((b, 24), dtype=np.float32)), "mse", ["mae"]


def _attention_bilstm(K, L, s, rng, tf):
    inp = K.Input((s,), dtype="int32")
    h = L.Embedding(5000, 64)(inp)
    h = L.Bidirectional(L.LSTM(48, return_sequences=True))(h)
    a = L.Attention()([h, h])
    h = L.GlobalAveragePooling1D()(L.Concatenate()([h, a]))
    out = L.Dense(5, activation="softmax")(h)
    return K.Model(inp, out, name="attention_bilstm"), \
        lambda b: (rng.integers(0, 5000, (b, s)).astype("int32"), rng.integers(0, 5, b)), \
        "sparse_categorical_crossentropy", ["accuracy"]


# ================================================================== TextCNN

def _textcnn(K, L, s, rng, tf):
    inp = K.Input((s,), dtype="int32")
    e = L.Embedding(10000, 128)(inp)
    pools = [L.GlobalMaxPooling1D()(L.Conv1D(100, k, activation="relu")(e)) for k in (3, 4, 5)]
    h = L.Dropout(0.5)(L.Concatenate()(pools))
    out = L.Dense(4)(h)
    return K.Model(inp, out), \
        lambda b: (rng.integers(0, 10000, (b, s)).astype("int32"), rng.integers(0, 4, b)), \
        K.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]


def _textcnn_deep(K, L, s, rng, tf):
    """Multi-label: a stacked branch and a dilated one, sigmoid outputs."""
    import numpy as np
    inp = K.Input((s,), dtype="int32")
    e = L.SpatialDropout1D(0.2)(L.Embedding(20000, 100)(inp))
    a = L.Conv1D(128, 5, activation="relu")(e)
    a = L.MaxPooling1D(3)(a)
    a = L.Conv1D(128, 5, activation="relu")(a)
    a = L.GlobalMaxPooling1D()(a)
    d = L.Conv1D(64, 3, dilation_rate=2, padding="same", activation="relu")(e)
    d = L.Conv1D(64, 3, dilation_rate=4, padding="same", activation="relu")(d)
    d = L.GlobalAveragePooling1D()(d)
    h = L.Dense(64, activation="relu")(L.Concatenate()([a, d]))
    out = L.Dense(6, activation="sigmoid")(h)
    return K.Model(inp, out, name="textcnn_deep"), \
        lambda b: (rng.integers(0, 20000, (b, s)).astype("int32"), (rng.random((b, 6)) > 0.7).astype(np.float32)), \
        "binary_crossentropy", [K.metrics.AUC()]


# ================================================================== separable convolutions

def _mini_xception(K, L, s, rng, tf):
    inp = K.Input((s, s, 3))
    x = L.Conv2D(32, 3, strides=2, padding="same", use_bias=False)(inp)
    x = L.BatchNormalization()(x)
    x = L.Activation("relu")(x)
    for f in (64, 128, 256):
        res = L.BatchNormalization()(L.Conv2D(f, 1, strides=2, padding="same", use_bias=False)(x))
        x = L.Activation("relu")(x)
        x = L.SeparableConv2D(f, 3, padding="same", use_bias=False)(x)
        x = L.BatchNormalization()(x)
        x = L.Activation("relu")(x)
        x = L.SeparableConv2D(f, 3, padding="same", use_bias=False)(x)
        x = L.BatchNormalization()(x)
        x = L.MaxPooling2D(3, strides=2, padding="same")(x)
        x = L.add([x, res])
    out = L.Dense(10, activation="softmax")(L.GlobalAveragePooling2D()(x))
    return K.Model(inp, out, name="mini_xception"), \
        lambda b: (_img(rng, s)(b), rng.integers(0, 10, b)), "sparse_categorical_crossentropy", ["accuracy"]


def _sepcnn(K, L, s, rng, tf):
    """Depthwise-separable blocks with a depth multiplier and strides, and a SeparableConv1D head."""
    inp = K.Input((s, s, 3))
    x = L.SeparableConv2D(32, 3, depth_multiplier=2, padding="same", activation="relu")(inp)
    x = L.SeparableConv2D(64, 3, strides=2, padding="same")(x)
    x = L.BatchNormalization()(x)
    x = L.ReLU(6.0)(x)
    x = L.DepthwiseConv2D(3, padding="same", depth_multiplier=1)(x)
    x = L.Conv2D(128, 1, activation="relu")(x)
    x = L.SeparableConv2D(128, 3, strides=2, padding="same", activation="relu")(x)
    x = L.Reshape(((s // 4) * (s // 4), 128))(x)
    x = L.SeparableConv1D(64, 3, padding="same", activation="relu")(x)
    out = L.Dense(10)(L.GlobalMaxPooling1D()(x))
    return K.Model(inp, out, name="sepcnn"), \
        lambda b: (_img(rng, s)(b), rng.integers(0, 10, b)), \
        K.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]


# ================================================================== mixers

def _mlp_mixer(K, L, s, rng, tf, patch=8, d=128, blocks=4):
    inp = K.Input((s, s, 3))
    n = (s // patch) ** 2
    x = L.Reshape((n, d))(L.Conv2D(d, patch, strides=patch)(inp))
    for _ in range(blocks):
        y = L.Permute((2, 1))(L.LayerNormalization()(x))
        y = L.Dense(n)(L.Dense(2 * n, activation="gelu")(y))
        x = L.Add()([x, L.Permute((2, 1))(y)])
        y = L.LayerNormalization()(x)
        y = L.Dense(d)(L.Dense(4 * d, activation="gelu")(y))
        x = L.Add()([x, y])
    out = L.Dense(10)(L.GlobalAveragePooling1D()(L.LayerNormalization()(x)))
    return K.Model(inp, out, name="mlp_mixer"), \
        lambda b: (_img(rng, s)(b), rng.integers(0, 10, b)), \
        K.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]


def _conv_mixer(K, L, s, rng, tf, dim=128, depth=4, kernel=5, patch=2):
    """ConvMixer (Trockman & Kolter): patch embedding, depthwise mixing with a residual, pointwise."""
    inp = K.Input((s, s, 3))
    x = L.Conv2D(dim, patch, strides=patch)(inp)
    x = L.BatchNormalization()(L.Activation("gelu")(x))
    for _ in range(depth):
        y = L.DepthwiseConv2D(kernel, padding="same")(x)
        y = L.BatchNormalization()(L.Activation("gelu")(y))
        x = L.Add()([y, x])
        x = L.Conv2D(dim, 1)(x)
        x = L.BatchNormalization()(L.Activation("gelu")(x))
    out = L.Dense(10, activation="softmax")(L.GlobalAveragePooling2D()(x))
    return K.Model(inp, out, name="conv_mixer"), \
        lambda b: (_img(rng, s)(b), rng.integers(0, 10, b)), "sparse_categorical_crossentropy", ["accuracy"]


# ================================================================== ResNets written by hand

def _resnet_layers(K, L, s, rng, tf):
    class ResidualBlock(L.Layer):
        """conv-bn-relu-conv-bn plus the (projected) input: a layer of its own."""

        def __init__(self, filters, stride=1, **kw):
            super().__init__(**kw)
            self.c1 = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)
            self.b1 = L.BatchNormalization()
            self.c2 = L.Conv2D(filters, 3, padding="same", use_bias=False)
            self.b2 = L.BatchNormalization()
            self.proj = L.Conv2D(filters, 1, strides=stride, use_bias=False) if stride != 1 else None

        def call(self, x, training=None):
            h = tf.nn.relu(self.b1(self.c1(x), training=training))
            h = self.b2(self.c2(h), training=training)
            return tf.nn.relu(h + (self.proj(x) if self.proj is not None else x))
    inp = K.Input((s, s, 3))
    x = L.Conv2D(32, 3, padding="same", activation="relu")(inp)
    for f, stride in ((32, 1), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1)):
        x = ResidualBlock(f, stride)(x)
    out = L.Dense(10)(L.GlobalAveragePooling2D()(x))
    return K.Model(inp, out, name="resnet_layers"), \
        lambda b: (_img(rng, s)(b), rng.integers(0, 10, b)), \
        K.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]


def _resnet_functional(K, L, s, rng, tf):
    def bottleneck(x, f, stride):
        short = x
        if stride != 1 or x.shape[-1] != 4 * f:
            short = L.BatchNormalization()(L.Conv2D(4 * f, 1, strides=stride, use_bias=False)(x))
        h = L.Activation("relu")(L.BatchNormalization()(L.Conv2D(f, 1, use_bias=False)(x)))
        h = L.Activation("relu")(L.BatchNormalization()(L.Conv2D(f, 3, strides=stride, padding="same",
                                                                   use_bias=False)(h)))
        h = L.BatchNormalization()(L.Conv2D(4 * f, 1, use_bias=False)(h))
        return L.Activation("relu")(L.Add()([h, short]))
    inp = K.Input((s, s, 3))
    x = L.Activation("relu")(L.BatchNormalization()(L.Conv2D(32, 3, strides=2, padding="same", use_bias=False)(inp)))
    for f, n, stride in ((16, 2, 1), (32, 2, 2), (64, 2, 2)):
        for i in range(n):
            x = bottleneck(x, f, stride if i == 0 else 1)
    out = L.Dense(20, activation="softmax")(L.GlobalAveragePooling2D()(x))
    return K.Model(inp, out, name="resnet_functional"), \
        lambda b: (_img(rng, s)(b), rng.integers(0, 20, b)), "sparse_categorical_crossentropy", ["accuracy"]


def _subclassed_resnet(K, L, s, rng, tf):
    """A ``keras.Model`` subclass with its own ``call``: no layer graph to read."""
    class Block(L.Layer):
        def __init__(self, f, stride, **kw):
            super().__init__(**kw)
            self.c1 = L.Conv2D(f, 3, strides=stride, padding="same", activation="relu")
            self.c2 = L.Conv2D(f, 3, padding="same")
            self.skip = L.Conv2D(f, 1, strides=stride) if stride > 1 else None

        def call(self, x):
            h = self.c2(self.c1(x))
            return tf.nn.relu(h + (self.skip(x) if self.skip is not None else x))

    class Net(K.Model):
        def __init__(self):
            super().__init__(name="subclassed_resnet")
            self.stem = L.Conv2D(32, 3, padding="same", activation="relu")
            self.blocks = [Block(32, 1), Block(64, 2), Block(64, 1), Block(128, 2)]
            self.pool = L.GlobalAveragePooling2D()
            self.head = L.Dense(10)

        def call(self, x, training=False):
            x = self.stem(x)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.pool(x))
    net = Net()
    net(tf.zeros((1, s, s, 3)))  # builds its weights, as users do before summary()
    return net, lambda b: (_img(rng, s)(b), rng.integers(0, 10, b)), \
        K.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]


# ================================================================== transformers

def _text_transformer(K, L, s, rng, tf, vocab=8000, d=128, heads=4, ff=256, blocks=2):
    class TokenAndPositionEmbedding(L.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.tok = L.Embedding(vocab, d)
            self.pos = L.Embedding(s, d)

        def call(self, x):
            return self.tok(x) + self.pos(tf.range(tf.shape(x)[-1]))
    inp = K.Input((s,), dtype="int32")
    h = TokenAndPositionEmbedding()(inp)
    for _ in range(blocks):
        a = L.MultiHeadAttention(heads, d // heads)(h, h)
        h = L.LayerNormalization(epsilon=1e-6)(h + L.Dropout(0.1)(a))
        f = L.Dense(d)(L.Dense(ff, activation="relu")(h))
        h = L.LayerNormalization(epsilon=1e-6)(h + L.Dropout(0.1)(f))
    h = L.Dropout(0.1)(L.GlobalAveragePooling1D()(h))
    out = L.Dense(2, activation="softmax")(L.Dense(32, activation="relu")(h))
    return K.Model(inp, out, name="text_transformer"), \
        lambda b: (rng.integers(0, vocab, (b, s)).astype("int32"), rng.integers(0, 2, b)), \
        "sparse_categorical_crossentropy", ["accuracy"]


def _tiny_vit(K, L, s, rng, tf, patch=4, d=96, heads=3, blocks=3):
    n = (s // patch) ** 2

    class Patches(L.Layer):
        def call(self, images):
            p = tf.image.extract_patches(images, sizes=[1, patch, patch, 1], strides=[1, patch, patch, 1],
                                         rates=[1, 1, 1, 1], padding="VALID")
            return tf.reshape(p, [tf.shape(images)[0], n, patch * patch * 3])

    class PatchEncoder(L.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.proj = L.Dense(d)
            self.pos = L.Embedding(n, d)

        def call(self, patches):
            return self.proj(patches) + self.pos(tf.range(n))
    inp = K.Input((s, s, 3))
    h = PatchEncoder()(Patches()(inp))
    for _ in range(blocks):
        x1 = L.LayerNormalization(epsilon=1e-6)(h)
        a = L.MultiHeadAttention(heads, d // heads, dropout=0.1)(x1, x1)
        h = L.Add()([a, h])
        x3 = L.LayerNormalization(epsilon=1e-6)(h)
        x3 = L.Dense(2 * d, activation="gelu")(x3)
        x3 = L.Dropout(0.1)(L.Dense(d)(x3))
        h = L.Add()([x3, h])
    h = L.Flatten()(L.LayerNormalization(epsilon=1e-6)(h))
    out = L.Dense(10)(L.Dropout(0.3)(L.Dense(128, activation="gelu")(h)))
    return K.Model(inp, out, name="tiny_vit"), \
        lambda b: (_img(rng, s)(b), rng.integers(0, 10, b)), \
        K.losses.SparseCategoricalCrossentropy(from_logits=True), [K.metrics.SparseCategoricalAccuracy()]


# ================================================================== several inputs and outputs

def _multitask(K, L, s, rng, tf):
    import numpy as np
    inp = K.Input((s, s, 3), name="image")
    h = L.Conv2D(32, 3, strides=2, activation="relu")(inp)
    h = L.Conv2D(64, 3, strides=2, activation="relu")(h)
    h = L.GlobalAveragePooling2D()(h)
    cls = L.Dense(10, activation="softmax", name="cls")(h)
    box = L.Dense(4, activation="sigmoid", name="box")(L.Dense(64, activation="relu")(h))
    model = K.Model(inp, {"cls": cls, "box": box}, name="multitask")
    img = _img(rng, s)
    return model, lambda b: (img(b), {"cls": rng.integers(0, 10, b), "box": rng.random((b, 4), dtype=np.float32)}), \
        {"cls": "sparse_categorical_crossentropy", "box": "mse"}, {"cls": ["accuracy"]}


def _wide_deep(K, L, s, rng, tf):
    """Wide & Deep: categorical ids through embeddings and a dense tower, a wide linear part."""
    import numpy as np
    cards = (50000, 20000, 1000, 100)
    ids = [K.Input((1,), dtype="int32", name=f"cat{i}") for i in range(len(cards))]
    num = K.Input((13,), name="numeric")
    embs = [L.Flatten()(L.Embedding(c, 16)(x)) for c, x in zip(cards, ids)]
    deep = L.Concatenate()(embs + [num])
    for w in (256, 128, 64):
        deep = L.Dense(w, activation="relu")(deep)
    wide = L.Dense(1)(num)
    out = L.Activation("sigmoid")(L.Add()([L.Dense(1)(deep), wide]))
    model = K.Model(ids + [num], out, name="wide_deep")
    return model, lambda b: ([rng.integers(0, c, (b, 1)).astype("int32") for c in cards]
                             + [rng.random((b, 13), dtype=np.float32)], rng.integers(0, 2, (b, 1)).astype(np.float32)), \
        "binary_crossentropy", [K.metrics.AUC()]


# ================================================================== Sequential

def _sequential_cnn(K, L, s, rng, tf):
    import numpy as np
    model = K.Sequential([
        K.Input((s, s, 1)),
        L.Conv2D(32, 3, activation="relu"), L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(),
        L.Dropout(0.25), L.Flatten(), L.Dense(128, activation="relu"), L.Dropout(0.5),
        L.Dense(10, activation="softmax")])
    return model, lambda b: (rng.random((b, s, s, 1), dtype=np.float32), rng.integers(0, 10, b)), \
        "sparse_categorical_crossentropy", ["accuracy"]


def _sequential_vgg(K, L, s, rng, tf):
    import numpy as np
    layers = [K.Input((s, s, 3))]
    for f in (32, 64, 128):
        layers += [L.Conv2D(f, 3, padding="same", activation="relu"), L.BatchNormalization(),
                   L.Conv2D(f, 3, padding="same", activation="relu"), L.BatchNormalization(),
                   L.MaxPooling2D(), L.Dropout(0.2)]
    layers += [L.Flatten(), L.Dense(128, activation="relu"), L.Dropout(0.5), L.Dense(10, activation="softmax")]
    model = K.Sequential(layers, name="sequential_vgg")
    return model, lambda b: (_img(rng, s)(b), np.eye(10, dtype=np.float32)[rng.integers(0, 10, b)]), \
        "categorical_crossentropy", ["accuracy"]


# ================================================================== MLPs

def _mlp_deep(K, L, s, rng, tf):
    import numpy as np
    inp = K.Input((s,))
    h = L.Dense(512, activation="relu")(inp)
    h = L.Dropout(0.2)(h)
    h = L.Dense(512, activation="relu")(h)
    h = L.Dropout(0.2)(h)
    h = L.Dense(256, activation="relu")(h)
    out = L.Dense(10, activation="softmax")(h)
    return K.Model(inp, out), lambda b: (rng.random((b, s), dtype=np.float32), rng.integers(0, 10, b)), \
        "sparse_categorical_crossentropy", ["accuracy"]


def _mlp3(K, L, s, rng, tf):
    """The three-layer MLP of issue 37: Dense(256) -> Dense(128) -> Dense(10) on 128 inputs, 67,210
    parameters."""
    import numpy as np
    inp = K.Input((s,))
    h = L.Dense(256, activation="relu")(inp)
    h = L.Dense(128, activation="relu")(h)
    out = L.Dense(10)(h)
    return K.Model(inp, out), lambda b: (rng.random((b, s), dtype=np.float32), rng.integers(0, 10, b)), \
        K.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]


# ================================================================== blocks of known architectures

def _inception_blocks(K, L, s, rng, tf):
    def module(x, f):
        a = L.Conv2D(f, 1, activation="relu")(x)
        b = L.Conv2D(f, 3, padding="same", activation="relu")(L.Conv2D(f // 2, 1, activation="relu")(x))
        c = L.Conv2D(f // 2, 5, padding="same", activation="relu")(L.Conv2D(f // 4, 1, activation="relu")(x))
        d = L.Conv2D(f // 2, 1, activation="relu")(L.MaxPooling2D(3, strides=1, padding="same")(x))
        return L.Concatenate()([a, b, c, d])
    inp = K.Input((s, s, 3))
    x = L.Conv2D(32, 3, strides=2, padding="same", activation="relu")(inp)
    x = module(x, 32)
    x = L.MaxPooling2D()(x)
    x = module(x, 64)
    x = module(x, 64)
    out = L.Dense(10, activation="softmax")(L.GlobalAveragePooling2D()(x))
    return K.Model(inp, out, name="inception_blocks"), \
        lambda b: (_img(rng, s)(b), rng.integers(0, 10, b)), "sparse_categorical_crossentropy", ["accuracy"]


def _densenet_small(K, L, s, rng, tf, growth=16):
    def dense_block(x, n):
        for _ in range(n):
            h = L.Activation("relu")(L.BatchNormalization()(x))
            h = L.Conv2D(4 * growth, 1, use_bias=False)(h)
            h = L.Activation("relu")(L.BatchNormalization()(h))
            h = L.Conv2D(growth, 3, padding="same", use_bias=False)(h)
            x = L.Concatenate()([x, h])
        return x

    def transition(x):
        x = L.Conv2D(int(x.shape[-1]) // 2, 1, use_bias=False)(L.Activation("relu")(L.BatchNormalization()(x)))
        return L.AveragePooling2D(2)(x)
    inp = K.Input((s, s, 3))
    x = L.Conv2D(2 * growth, 3, padding="same", use_bias=False)(inp)
    x = transition(dense_block(x, 4))
    x = transition(dense_block(x, 4))
    x = dense_block(x, 4)
    x = L.GlobalAveragePooling2D()(L.Activation("relu")(L.BatchNormalization()(x)))
    out = L.Dense(10, activation="softmax")(x)
    return K.Model(inp, out, name="densenet_small"), \
        lambda b: (_img(rng, s)(b), rng.integers(0, 10, b)), "sparse_categorical_crossentropy", ["accuracy"]


_BUILDERS = {
    "UNet": _unet, "FPNSeg": _fpn, "ConvAutoencoder": _conv_ae, "VAE": _vae, "DCGANGenerator": _dcgan_generator,
    "SiameseTower": _siamese_tower, "TripletShared": _triplet, "BiLSTMTagger": _bilstm_tagger,
    "BiGRUTagger": _bigru_tagger, "CRNN": _crnn, "Forecaster": _forecaster, "AttentionBiLSTM": _attention_bilstm,
    "TextCNN": _textcnn, "TextCNNDeep": _textcnn_deep, "MiniXception": _mini_xception, "SepCNN": _sepcnn,
    "MLPMixer": _mlp_mixer, "ConvMixer": _conv_mixer, "ResNetLayers": _resnet_layers,
    "ResNetFunctional": _resnet_functional, "SubclassedResNet": _subclassed_resnet,
    "TextTransformer": _text_transformer, "TinyViT": _tiny_vit, "MultiTask": _multitask, "WideDeep": _wide_deep,
    "SequentialCNN": _sequential_cnn, "SequentialVGG": _sequential_vgg, "MLPDeep": _mlp_deep, "MLP3": _mlp3,
    "InceptionBlocks": _inception_blocks, "DenseNetSmall": _densenet_small,
}
