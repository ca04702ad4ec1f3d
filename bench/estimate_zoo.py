"""The estimator against measured training-step peaks on a wide zoo nobody tuned it for.

Same method as ``bench/estimate_accuracy.py``: each case is measured in a fresh subprocess over
four full training steps (forward, backward, optimizer update), the largest allocator peak of the
four (the first included) is the reference, and the estimate is computed in the parent without
running the model.

* Keras on CPU (TF 2.15 / Keras 2 and TF 2.21 / Keras 3): every ``keras.applications`` family at
  two input sizes, GRU, bidirectional LSTM, LSTM, Conv1D, a transformer encoder, an embedding-heavy
  recommender, an MLP; SGD, momentum, RMSprop, Adam, AdamW; ``mixed_float16`` and
  ``mixed_bfloat16``. Reference: ``tf.config.experimental.get_memory_info('CPU:0')['peak']``.
* PyTorch on CUDA: torchvision families (vision transformers among them) and Hugging Face
  ``transformers`` models built from configs with random weights (encoder, decoder,
  encoder-decoder); fp32, autocast bf16, autocast fp16 with ``GradScaler``; SGD-momentum,
  RMSprop, Adam, AdamW, Adafactor. Reference: ``torch.cuda.max_memory_allocated()``. The peer,
  in the same run: PyTorch's own ``MemTracker`` (``torch.distributed._tools.mem_tracker``) under
  ``FakeTensorMode``, the method torchtitan's estimator uses.

Beside each estimate: a naive baseline, ``weight bytes x (2 + optimizer slots) + the sum of layer
outputs x batch``. One JSON line (the summary) goes to stdout, the full result to ``--out``.

    python bench/estimate_zoo.py --framework keras --out bench/results/estimate_accuracy_keras_tf215.json
    PYTHONPATH=. python3 bench/estimate_zoo.py --framework torch --out $OUT/torch.json     # on a GPU
    python bench/estimate_zoo.py --framework torch --estimate-only                         # CPU: estimates run
    python bench/estimate_zoo.py --framework keras --reuse OLD.json --out NEW.json         # re-estimate only

``--reuse`` takes the measured peaks of an earlier result file (same case ids, same measuring
code) and recomputes only the estimates: the measurements do not depend on the estimator.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from estimate_zoo_written import COMPILED, KERAS_WRITTEN, TORCH_WRITTEN, keras_written, torch_written  # noqa: E402

STEPS = 4
TARGETS = {"keras": {"mean_abs_err": 0.03, "max_abs_err": 0.08, "worst_under": -0.03},
           "torch": {"mean_abs_err": 0.015, "max_abs_err": 0.05, "worst_under": -0.02}}


def log(msg: str) -> None:
    print(f"[estimate_zoo] {msg}", file=sys.stderr, flush=True)


def case_id(c: Dict[str, Any]) -> str:
    return "{model}@{size}/b{batch}/{optimizer}/{precision}".format(**c)


# ================================================================== Keras

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
_COST = {"GRU": 0, "Conv1D": 0, "MLP": 0, "Recommender": 0, "BiLSTM": 1, "LSTMText": 1, "TransformerEncoder": 1,
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


def _keras_loss(model):
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
    model.compile(optimizer=keras_optimizer(c["optimizer"]), loss=_keras_loss(model))
    x, y = make(c["batch"])
    x = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    y = [tf.constant(a) for a in y] if isinstance(y, list) else tf.constant(y)
    return tf, model, x, y


def add_case_arguments(p) -> None:
    """The positional arguments naming one zoo case: MODEL SIZE BATCH OPTIMIZER PRECISION."""
    p.add_argument("model")
    p.add_argument("size", type=int)
    p.add_argument("batch", type=int)
    p.add_argument("optimizer")
    p.add_argument("precision")


def case_of(args) -> Dict[str, Any]:
    """The case dict of parsed :func:`add_case_arguments` arguments."""
    return {k: getattr(args, k) for k in ("model", "size", "batch", "optimizer", "precision")}


def keras_measure(c: Dict[str, Any], steps: int) -> Dict[str, Any]:
    from estimate_measure import keras_train_peaks
    _, model, x, y = keras_compiled(c)
    out = keras_train_peaks(model, x, y, steps)
    return {"peaks": out["peaks"], "step_seconds": out["step_seconds"]}


def keras_estimate(c: Dict[str, Any]) -> Dict[str, Any]:
    import warnings
    from distmem.estimate import estimate_keras
    from distmem.estimate.precision import dtype_bytes
    _, K = keras_ns()
    model, _ = keras_build(c)
    opt = keras_optimizer(c["optimizer"])
    t = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_keras(model, c["batch"], opt, device="cpu", name=c["model"])
        peak = est.peak_bytes
    seconds = time.time() - t
    slots = est.optimizer.get("slots_per_weight") or 0
    outputs = 0
    for layer in model.layers:
        outs = layer.output if isinstance(layer.output, (list, tuple)) else [layer.output]
        for o in outs:
            n = 1
            for d in tuple(o.shape)[1:]:
                n *= int(d)
            outputs += n * dtype_bytes(o.dtype)
    baseline = model.count_params() * 4 * (2 + slots) + outputs * c["batch"]
    K.mixed_precision.set_global_policy("float32")
    return {"ours": int(peak), "baseline": int(baseline), "phase": est.peak_detail()["phase"],
            "layers": len(est.layers), "estimate_seconds": round(seconds, 3), "warnings": list(est.warnings)}


# ================================================================== PyTorch

def _t(model, batch, optimizer, precision="float32", **kw):
    d = {"model": model, "size": kw.pop("size", 224), "batch": batch, "optimizer": optimizer,
         "precision": precision}
    d.update(kw)
    return d


TORCH_CASES: List[Dict[str, Any]] = [
    # torchvision: convolutional families
    _t("resnet50", 32, "adam"), _t("resnet18", 32, "momentum", "bf16"), _t("resnext50_32x4d", 16, "adamw"),
    _t("wide_resnet50_2", 16, "momentum"), _t("vgg11_bn", 16, "rmsprop"), _t("densenet121", 32, "adamw", "bf16"),
    _t("mobilenet_v2", 32, "rmsprop"), _t("mobilenet_v3_small", 64, "adam", "fp16"),
    _t("efficientnet_b0", 32, "adam", "bf16"), _t("efficientnet_v2_s", 16, "adafactor"),
    _t("regnet_y_1_6gf", 32, "momentum"), _t("convnext_tiny", 32, "adamw", "bf16"),
    _t("shufflenet_v2_x1_0", 64, "momentum", "fp16"), _t("squeezenet1_1", 64, "rmsprop"),
    _t("mnasnet1_0", 32, "adam"), _t("googlenet", 32, "adam"), _t("inception_v3", 16, "momentum", size=299),
    # torchvision: vision transformers
    _t("vit_b_16", 16, "adamw"), _t("vit_b_16", 16, "adamw", "bf16"), _t("swin_t", 16, "adam"),
    _t("maxvit_t", 8, "adamw", "bf16"),
    # Hugging Face transformers from configs (random weights): encoder, decoder, encoder-decoder
    _t("hf_bert", 16, "adamw"), _t("hf_bert", 16, "adamw", "bf16"), _t("hf_roberta_cls", 16, "adam", "fp16"),
    _t("hf_gpt2", 8, "adamw", "bf16"), _t("hf_gpt2", 8, "adafactor"), _t("hf_llama", 8, "adamw", "bf16"),
    _t("hf_llama", 8, "momentum"), _t("hf_t5", 8, "adafactor", "bf16"), _t("hf_t5", 8, "adamw"),
    _t("hf_bart", 8, "adam", "fp16"), _t("gpt_decoder", 16, "adam", "bf16"),
] + TORCH_WRITTEN

HF_SEQ = 256


def hf_config(name: str):
    import transformers as T
    if name == "hf_bert":
        return T.BertConfig(vocab_size=30522, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                            intermediate_size=2048), "masked"
    if name == "hf_roberta_cls":
        return T.RobertaConfig(vocab_size=50265, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                               intermediate_size=1536, num_labels=4, max_position_embeddings=514), "cls"
    if name == "hf_gpt2":
        return T.GPT2Config(vocab_size=50257, n_embd=768, n_layer=6, n_head=12, n_positions=1024), "causal"
    if name == "hf_llama":
        return T.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                             num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024), "causal"
    if name == "hf_t5":
        return T.T5Config(vocab_size=32128, d_model=512, d_ff=2048, num_layers=4, num_decoder_layers=4,
                          num_heads=8, d_kv=64), "seq2seq"
    if name == "hf_bart":
        return T.BartConfig(vocab_size=50265, d_model=512, encoder_layers=4, decoder_layers=4,
                            encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                            decoder_ffn_dim=2048, max_position_embeddings=1024), "seq2seq"
    raise SystemExit(f"unknown Hugging Face zoo model {name!r}")


def hf_build(name: str):
    import transformers as T
    cfg, kind = hf_config(name)
    cls = {"masked": T.AutoModelForMaskedLM, "cls": T.AutoModelForSequenceClassification,
           "causal": T.AutoModelForCausalLM, "seq2seq": T.AutoModelForSeq2SeqLM}[kind]
    model = cls.from_config(cfg)
    return model, cfg, kind


def torch_build(c: Dict[str, Any], device: str):
    """(model, inputs(batch, device) -> (args, kwargs), target(batch, device))."""
    import torch
    name = c["model"]
    if name in COMPILED:  # the same model, torch.compile'd
        model, inputs = torch_build(dict(c, model=COMPILED[name]), device)
        return torch.compile(model), inputs
    if any(w["model"] == name for w in TORCH_WRITTEN) and name not in ("resnet50", "resnet18"):
        return torch_written(name, c["size"], device)
    if name == "gpt_decoder":
        sys.path.insert(0, HERE)
        from estimate_accuracy import gpt_decoder
        with torch.device(device):
            model = gpt_decoder()
        return model, (lambda b, dev: ((torch.zeros((b, 256), dtype=torch.long, device=dev),), {}))
    if name.startswith("hf_"):
        with torch.device(device):
            model, cfg, kind = hf_build(name)
        vocab = cfg.vocab_size

        def inputs(b, dev):
            ids = torch.randint(0, vocab, (b, HF_SEQ), device=dev) if dev != "meta" else \
                torch.empty((b, HF_SEQ), dtype=torch.long, device=dev)
            kw = {"input_ids": ids}
            if kind == "seq2seq":
                kw["decoder_input_ids"] = ids[:, : HF_SEQ // 2]
            return (), kw
        return model, inputs
    import torchvision
    build = getattr(torchvision.models, name)
    kw = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
    try:
        with torch.device(device):
            model = build(weights=None, **kw)
    except (NotImplementedError, RuntimeError):  # a builder that computes its widths with tensors
        model = build(weights=None, **kw).to(device)
    s = c["size"]
    return model, (lambda b, dev: ((torch.randn(b, 3, s, s, device=dev) if dev != "meta" else
                                    torch.empty(b, 3, s, s, device=dev),), {}))


def torch_optimizer(name: str, params):
    import torch
    o = torch.optim
    return {"sgd": lambda: o.SGD(params, lr=0.01), "momentum": lambda: o.SGD(params, lr=0.01, momentum=0.9),
            "rmsprop": lambda: o.RMSprop(params), "adam": lambda: o.Adam(params), "adamw": lambda: o.AdamW(params),
            "adafactor": lambda: o.Adafactor(params)}[name]()


def _amp_dtype(precision: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def _logits(out):
    if isinstance(out, dict):
        out = out.get("logits", next(iter(out.values())))
    if isinstance(out, (list, tuple)):
        out = out[0]
    return getattr(out, "logits", out)


def _ce(out):
    """The loss the estimator assumes (``loss="auto"``): cross-entropy over the last dimension."""
    import torch
    t = _logits(out)
    logits = t.reshape(-1, t.shape[-1])
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=t.device)
    return torch.nn.functional.cross_entropy(logits.float() if t.dtype != torch.float32 else logits, target)


def torch_measure(c: Dict[str, Any], steps: int) -> Dict[str, Any]:
    import contextlib
    import torch
    from estimate_measure import torch_train_peaks
    model, inputs = torch_build(c, "cuda")
    model.train()
    opt = torch_optimizer(c["optimizer"], model.parameters())
    amp = _amp_dtype(c["precision"])
    scaler = torch.amp.GradScaler("cuda") if c["precision"] == "fp16" else None
    args, kwargs = inputs(c["batch"], "cuda")

    def step() -> None:
        ctx = torch.autocast("cuda", dtype=amp) if amp is not None else contextlib.nullcontext()
        with ctx:
            loss = _ce(model(*args, **kwargs))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
    return torch_train_peaks(step, steps)


def torch_memtracker(c: Dict[str, Any]) -> Dict[str, Any]:
    """PyTorch's own MemTracker under FakeTensorMode: two steps, the second's peak (its documented
    use: the first step's stats are reset once the optimizer state exists)."""
    import contextlib
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    where = os.environ.get("ESTIMATE_ZOO_PEER_DEVICE", "cuda")  # cpu: check the plumbing without a GPU
    dev = torch.device("cuda", torch.cuda.current_device()) if where == "cuda" else torch.device("cpu")
    t0 = time.time()
    with FakeTensorMode():
        model, inputs = torch_build(c, where)
        model.train()
        opt = torch_optimizer(c["optimizer"], model.parameters())
        amp = _amp_dtype(c["precision"])
        mt = MemTracker()
        mt.track_external(model, opt)
        peaks = []
        with mt:
            for i in range(2):
                args, kwargs = inputs(c["batch"], where)
                ctx = torch.autocast(where, dtype=amp) if amp is not None else contextlib.nullcontext()
                with ctx:
                    loss = _ce(model(*args, **kwargs))
                (loss * 1024.0 if c["precision"] == "fp16" else loss).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss
                peaks.append(int(mt.get_tracker_snapshot("peak")[dev]["Total"]))
                if i == 0:
                    mt.reset_mod_stats()
    return {"peer": max(peaks), "peer_steps": peaks, "peer_seconds": round(time.time() - t0, 2)}


def torch_estimate(c: Dict[str, Any]) -> Dict[str, Any]:
    import warnings
    import torch
    from distmem.estimate import estimate_torch
    model, inputs = torch_build(c, "meta")
    args, kwargs = inputs(c["batch"], "meta")
    example = kwargs if kwargs else args
    opt = torch_optimizer(c["optimizer"], [torch.nn.Parameter(torch.zeros(2, 2))])
    prec = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}.get(c["precision"])
    t = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_torch(model, example_input=example, batch_size=c["batch"], optimizer=opt, precision=prec,
                             device="cuda", name=c["model"])
        peak = est.peak_bytes
    seconds = time.time() - t
    outputs = [0]

    def hook(mod, a, out):
        if not list(mod.children()):
            from torch.utils._pytree import tree_flatten
            outputs[0] += sum(o.numel() * o.element_size() for o in tree_flatten(out)[0] if torch.is_tensor(o))
    from distmem.estimate.allocators import ExactAllocator
    from distmem.estimate.torch.dispatch import dispatch_mode, Tracker
    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:  # inside the estimator's dispatch mode, which answers .item() on meta tensors
        with torch.no_grad(), dispatch_mode(Tracker(ExactAllocator())):
            state = {k: torch.empty_like(v, device="meta") for k, v in
                     list(model.named_parameters()) + list(model.named_buffers())}
            torch.func.functional_call(model, state, args, kwargs)
    finally:
        handle.remove()
    slots = est.optimizer.get("slots_per_weight")
    params = sum(p.numel() for p in model.parameters())
    slot_bytes = est.optimizer_bytes if slots is None else params * 4 * slots
    baseline = params * 4 * 2 + slot_bytes + outputs[0]
    return {"ours": int(peak), "baseline": int(baseline), "phase": est.peak_detail()["phase"],
            "layers": len(est.layers), "estimate_seconds": round(seconds, 3), "warnings": list(est.warnings)}


# ================================================================== driver

def stats(rows: List[Dict[str, Any]], key: str) -> Dict[str, Any]:
    errs = [r[f"{key}_err"] for r in rows if r.get(f"{key}_err") is not None]
    if not errs:
        return {"cases": 0}
    a = [abs(e) for e in errs]
    return {"cases": len(errs), "mean_abs_err": round(sum(a) / len(a), 4),
            "median_abs_err": round(statistics.median(a), 4), "max_abs_err": round(max(a), 4),
            "worst_under": round(min(min(errs), 0.0), 4),
            "share_under": round(sum(1 for e in errs if e < 0) / len(errs), 3)}


def _worker(args) -> int:
    c = json.loads(args.worker)
    if args.framework == "keras":
        out = keras_measure(c, args.steps)
    elif args.peer:
        out = torch_memtracker(c)
    else:
        out = torch_measure(c, args.steps)
    print(json.dumps(out))
    return 0


def _subprocess(framework: str, c: Dict[str, Any], steps: int, timeout: int, peer: bool = False) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--framework", framework, "--worker", json.dumps(c),
           "--steps", str(steps)] + (["--peer"] if peer else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")
    return json.loads(lines[-1])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("keras", "torch"), default="keras")
    p.add_argument("--models", default=None, help="comma-separated model names (a subset of the zoo)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--estimate-only", action="store_true", help="estimate every case, measure nothing")
    p.add_argument("--no-peer", dest="peer", action="store_false", help="torch: skip MemTracker")
    p.add_argument("--reuse", default=None, help="take measured peaks (and the peer's) from this earlier result")
    p.add_argument("--out", default=None)
    p.add_argument("--jsonl", default=None, help="also write one JSON line per case, then the summary line")
    p.add_argument("--timeout", type=int, default=600, help="seconds per measuring subprocess")
    p.add_argument("--jobs", type=int, default=1, help="measuring subprocesses at once (GPU: 4 is fine)")
    p.add_argument("--fast-first", action="store_true", help="measure the quick cases first (a shared CPU)")
    p.add_argument("--no-estimate", action="store_true", help="measure only (estimate later with --reuse)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer", dest="peer_worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.peer = args.peer_worker
        return _worker(args)
    fw = args.framework
    cases = KERAS_CASES if fw == "keras" else TORCH_CASES
    if args.models:
        keep = set(args.models.split(","))
        cases = [c for c in cases if c["model"] in keep]
    reused: Dict[str, Dict[str, Any]] = {}
    if args.reuse:
        with open(args.reuse, encoding="utf-8") as f:
            reused = {r["id"]: r for r in json.load(f)["rows"]}
    env: Dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    if fw == "keras":
        tf, K = keras_ns()
        env.update(tensorflow=tf.__version__, keras=getattr(K, "__version__", None), measured_on="CPU:0",
                   TF_ENABLE_ONEDNN_OPTS=os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                   TF_CPU_ALLOCATOR_USE_BFC=os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"))
        estimate_fn = keras_estimate
    else:
        import torch
        env["torch"] = torch.__version__
        env["measured_on"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        try:
            import transformers
            env["transformers"] = transformers.__version__
        except ImportError:
            cases = [c for c in cases if not c["model"].startswith("hf_")]
            log("transformers is not importable: the hf_* cases are left out")
        estimate_fn = torch_estimate
    measure = not args.estimate_only
    rows: List[Dict[str, Any]] = []
    t0 = time.time()
    for c in cases:  # estimates first, one after another in this process (their speed is reported)
        cid = case_id(c)
        row: Dict[str, Any] = {"id": cid, **c}
        if args.no_estimate:
            rows.append(row)
            continue
        try:
            row.update(estimate_fn(c))
        except Exception as exc:  # an estimate that cannot run is a result, reported as such
            row["estimate_error"] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"{cid}: estimate failed: {row['estimate_error']}")
        log(f"{cid}: ours {row.get('ours', 0) / 2**20:.1f} MiB [{row.get('estimate_seconds', '?')} s]")
        rows.append(row)

    def measure_row(row: Dict[str, Any]) -> None:
        c = {k: row[k] for k in ("model", "size", "batch", "optimizer", "precision")}
        old = reused.get(row["id"])
        if old and old.get("measured"):
            for k in ("measured", "measured_steps", "measured_spread", "peer", "peer_steps", "peer_error",
                      "peer_seconds", "step_seconds", "max_reserved", "measured_source", "measured_at"):
                if k in old:
                    row[k] = old[k]
            # the run that measured it, through any number of re-estimates
            row["measured_reused_from"] = old.get("measured_reused_from") or \
                (None if old.get("measured_at") else os.path.basename(args.reuse))
            return
        if not measure:
            return
        try:
            m = _subprocess(fw, c, args.steps, args.timeout)
            row["measured"] = max(m["peaks"])
            row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            row["measured_steps"] = m["peaks"]
            row["measured_spread"] = round((max(m["peaks"]) - min(m["peaks"])) / max(m["peaks"]), 4)
            row["step_seconds"] = m["step_seconds"]
            if "max_reserved" in m:
                row["max_reserved"] = m["max_reserved"]
        except Exception as exc:
            row["measure_error"] = str(exc)[-500:]
            log(f"{row['id']}: measuring failed: {row['measure_error']}")
        if fw == "torch" and args.peer and row.get("measured"):
            try:
                row.update(_subprocess(fw, c, args.steps, args.timeout, peer=True))
            except Exception as exc:
                row["peer_error"] = str(exc)[-300:]

    # each measurement is its own process; on a GPU several can share it (each process's
    # max_memory_allocated is its own), on a shared CPU one at a time
    import threading
    from concurrent.futures import ThreadPoolExecutor
    lock = threading.Lock()

    def measure_and_save(row: Dict[str, Any]) -> None:
        measure_row(row)
        if args.out:  # a checkpoint after every case, so a run stopped early keeps what it measured
            with lock, open(args.out + ".partial", "w", encoding="utf-8") as f:
                json.dump({"rows": rows}, f)
    order = sorted(rows, key=lambda r: _COST.get(r["model"], 5)) if args.fast_first else rows
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(measure_and_save, order))
    for row in rows:
        if row.get("measured") and row.get("ours"):
            row["ours_err"] = round(row["ours"] / row["measured"] - 1, 4)
            row["baseline_err"] = round(row["baseline"] / row["measured"] - 1, 4)
            if row.get("peer"):
                row["peer_err"] = round(row["peer"] / row["measured"] - 1, 4)
        if row.get("measured"):
            msg = (f"{row['id']}: ours {row.get('ours', 0) / 2**20:.1f} MiB, measured {row['measured'] / 2**20:.1f} "
                   f"MiB ({100 * row.get('ours_err', 0):+.1f}%), baseline {100 * row.get('baseline_err', 0):+.1f}%")
            if row.get("peer_err") is not None:
                msg += f", MemTracker {100 * row['peer_err']:+.1f}%"
            log(msg)
    result: Dict[str, Any] = {
        "bench": "estimate_zoo", "framework": fw, "env": env,
        "measured": ("get_memory_info('CPU:0')['peak'] (TensorFlow CPU allocator)" if fw == "keras"
                     else "torch.cuda.max_memory_allocated()"),
        "peak_of": f"max over {args.steps} training steps (first included), each case in a fresh process",
        "cases": len(rows), "ours": stats(rows, "ours"), "baseline": stats(rows, "baseline"),
        "targets": TARGETS[fw], "seconds": round(time.time() - t0, 1),
    }
    if fw == "torch":
        result["peer"] = {"name": "torch.distributed._tools.mem_tracker.MemTracker under FakeTensorMode",
                          **stats(rows, "peer"),
                          "could_not_run": sum(1 for r in rows if r.get("peer_error"))}
    s = result["ours"]
    if s.get("cases"):
        t = TARGETS[fw]
        result["targets_met"] = (s["mean_abs_err"] <= t["mean_abs_err"] and s["max_abs_err"] <= t["max_abs_err"]
                                 and s["worst_under"] >= t["worst_under"])
        result["misses"] = [r["id"] for r in rows if r.get("ours_err") is not None and
                            (abs(r["ours_err"]) > t["max_abs_err"] or r["ours_err"] < t["worst_under"])]
    result["rows"] = rows
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        log(f"wrote {args.out}")
    if args.jsonl:
        write_jsonl(result, args.jsonl)
        log(f"wrote {args.jsonl}")
    return 0


def write_jsonl(result: Dict[str, Any], path: str) -> None:
    """Per-case rows (measured, ours, baseline and their errors), then one summary line: mean,
    median and max absolute error, worst under-estimate and share of under-estimates, ours and
    the naive baseline's."""
    keep = ("id", "model", "size", "batch", "optimizer", "precision", "measured", "measured_steps", "ours",
            "ours_err", "baseline", "baseline_err", "peer", "peer_err", "phase", "warnings", "measure_error",
            "estimate_error", "measured_reused_from", "measured_at")
    with open(path, "w", encoding="utf-8") as f:
        for row in result["rows"]:
            f.write(json.dumps({k: row[k] for k in keep if k in row}) + "\n")
        f.write(json.dumps({"summary": True, **{k: v for k, v in result.items() if k != "rows"}}) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
