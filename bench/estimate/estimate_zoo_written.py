"""Models people write themselves, for the estimator's zoo: functional Keras with several inputs and
outputs, a shared tower, recurrent layers returning sequences, Conv2DTranspose decoders, a Lambda,
custom layers, ``tf.recompute_grad``; torch custom modules, activation checkpointing (reentrant,
non-reentrant, selective, Hugging Face's), LoRA and frozen backbones, ``torch.compile``.

Each is written as such a model is usually written (its loss the one its task takes), not tuned to
the estimator. ``keras_written(name, size, K)`` returns ``(model, make_batch, loss)``;
``torch_written(name, size, device)`` returns ``(model, inputs(batch, device))``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

__all__ = ["KERAS_WRITTEN", "keras_written", "TORCH_WRITTEN", "torch_written"]


def _k(model, size, batch, optimizer, precision="float32"):
    return {"model": model, "size": size, "batch": batch, "optimizer": optimizer, "precision": precision}


KERAS_WRITTEN: List[Dict[str, Any]] = [
    _k("UNet", 64, 8, "adam"), _k("ConvAutoencoder", 64, 16, "rmsprop", "mixed_bfloat16"),
    _k("Siamese", 64, 16, "adam"), _k("BiGRUTagger", 80, 32, "adam"), _k("TextCNN", 120, 32, "adam"),
    _k("PatchMixer", 64, 16, "adamw"), _k("CustomResNet", 64, 16, "momentum"), _k("MultiIO", 64, 16, "adam"),
    _k("RecomputeMLP", 512, 64, "adam"),
]


def _unet(K, L, s):
    def conv2(x, f):
        x = L.Conv2D(f, 3, padding="same", activation="relu")(x)
        return L.Conv2D(f, 3, padding="same", activation="relu")(x)
    inp = K.Input((s, s, 3))
    c1 = conv2(inp, 16)
    c2 = conv2(L.MaxPooling2D()(c1), 32)
    c3 = conv2(L.MaxPooling2D()(c2), 64)
    u2 = conv2(L.Concatenate()([L.Conv2DTranspose(32, 2, strides=2, padding="same")(c3), c2]), 32)
    u1 = conv2(L.Concatenate()([L.Conv2DTranspose(16, 2, strides=2, padding="same")(u2), c1]), 16)
    return K.Model(inp, L.Conv2D(5, 1, activation="softmax", dtype="float32")(u1), name="unet")


def _autoencoder(K, L, s):
    inp = K.Input((s, s, 3))
    h = L.Conv2D(32, 3, strides=2, padding="same", activation="relu")(inp)
    h = L.BatchNormalization()(h)
    h = L.Conv2D(64, 3, strides=2, padding="same", activation="relu")(h)
    h = L.BatchNormalization()(h)
    h = L.Conv2DTranspose(64, 3, strides=2, padding="same", activation="relu")(h)
    h = L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(h)
    return K.Model(inp, L.Conv2D(3, 3, padding="same", activation="sigmoid", dtype="float32")(h), name="autoencoder")


def _siamese(K, L, s):
    t_in = K.Input((s, s, 3))
    t = L.Conv2D(32, 3, activation="relu")(t_in)
    t = L.MaxPooling2D()(t)
    t = L.Conv2D(64, 3, activation="relu")(t)
    t = L.GlobalAveragePooling2D()(t)
    tower = K.Model(t_in, L.Dense(64)(t), name="tower")
    a, b = K.Input((s, s, 3)), K.Input((s, s, 3))
    d = L.Lambda(lambda ab: abs(ab[0] - ab[1]))([tower(a), tower(b)])
    return K.Model([a, b], L.Dense(1, activation="sigmoid")(d), name="siamese")


def _bigru_tagger(K, L, s):
    inp = K.Input((s,), dtype="int32")
    h = L.Embedding(8000, 64)(inp)
    h = L.Bidirectional(L.GRU(96, return_sequences=True))(h)
    return K.Model(inp, L.TimeDistributed(L.Dense(17))(h), name="bigru_tagger")


def _textcnn(K, L, s):
    inp = K.Input((s,), dtype="int32")
    e = L.Embedding(10000, 128)(inp)
    pools = [L.GlobalMaxPooling1D()(L.Conv1D(100, k, activation="relu")(e)) for k in (3, 4, 5)]
    h = L.Dropout(0.5)(L.Concatenate()(pools))
    return K.Model(inp, L.Dense(4)(h), name="textcnn")


def _patch_mixer(K, L, s, patch=8, d=128, blocks=4):
    inp = K.Input((s, s, 3))
    n = (s // patch) ** 2
    x = L.Reshape((n, d))(L.Conv2D(d, patch, strides=patch)(inp))
    for _ in range(blocks):
        y = L.Permute((2, 1))(L.LayerNormalization()(x))
        y = L.Dense(n)(L.Dense(4 * n, activation="gelu")(y))
        x = L.Add()([x, L.Permute((2, 1))(y)])
        y = L.LayerNormalization()(x)
        y = L.Dense(d)(L.Dense(4 * d, activation="gelu")(y))
        x = L.Add()([x, y])
    return K.Model(inp, L.Dense(10)(L.GlobalAveragePooling1D()(x)), name="patch_mixer")


def _custom_resnet(K, L, s):
    class ResidualBlock(L.Layer):
        """conv-bn-relu-conv-bn plus the (projected) input: a layer of its own, no get_config."""

        def __init__(self, filters, stride=1, **kw):
            super().__init__(**kw)
            self.c1 = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)
            self.b1 = L.BatchNormalization()
            self.c2 = L.Conv2D(filters, 3, padding="same", use_bias=False)
            self.b2 = L.BatchNormalization()
            self.proj = L.Conv2D(filters, 1, strides=stride, use_bias=False) if stride != 1 else None

        def call(self, x, training=None):
            h = K.activations.relu(self.b1(self.c1(x), training=training))
            h = self.b2(self.c2(h), training=training)
            return K.activations.relu(h + (self.proj(x) if self.proj is not None else x))
    inp = K.Input((s, s, 3))
    x = L.Conv2D(32, 3, padding="same", activation="relu")(inp)
    for f, stride in ((32, 1), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1)):
        x = ResidualBlock(f, stride)(x)
    return K.Model(inp, L.Dense(10)(L.GlobalAveragePooling2D()(x)), name="custom_resnet")


def _multi_io(K, L, s):
    img, meta = K.Input((s, s, 3), name="image"), K.Input((16,), name="meta")
    h = L.Conv2D(32, 3, strides=2, activation="relu")(img)
    h = L.Conv2D(64, 3, strides=2, activation="relu")(h)
    h = L.GlobalAveragePooling2D()(h)
    m = L.Dense(32, activation="relu")(meta)
    z = L.Concatenate()([h, m])
    cls = L.Dense(10, activation="softmax", name="cls")(z)
    reg = L.Dense(1, name="reg")(L.Dense(64, activation="relu")(z))
    return K.Model([img, meta], [cls, reg], name="multi_io")


def _recompute_mlp(K, L, s, width=1024, blocks=4):
    import tensorflow as tf

    class Recomputed(L.Layer):
        """A block of Dense layers whose activations are recomputed in the backward pass."""

        def __init__(self, **kw):
            super().__init__(**kw)
            self.d1 = L.Dense(width, activation="relu")
            self.d2 = L.Dense(width, activation="relu")

        def build(self, shape):
            self.d1.build(shape)
            self.d2.build((shape[0], width))
            super().build(shape)

        def call(self, x):
            return tf.recompute_grad(lambda t: self.d2(self.d1(t)))(x)
    inp = K.Input((s,))
    x = L.Dense(width, activation="relu")(inp)
    for _ in range(blocks):
        x = Recomputed()(x)
    return K.Model(inp, L.Dense(10)(x), name="recompute_mlp")


_KERAS = {"UNet": _unet, "ConvAutoencoder": _autoencoder, "Siamese": _siamese, "BiGRUTagger": _bigru_tagger,
          "TextCNN": _textcnn, "PatchMixer": _patch_mixer, "CustomResNet": _custom_resnet, "MultiIO": _multi_io,
          "RecomputeMLP": _recompute_mlp}


def keras_written(name: str, size: int, K) -> Tuple[Any, Callable[[int], Tuple[Any, Any]], Any]:
    """(model, make_batch(batch) -> (x, y), loss) for hand-written Keras model ``name``."""
    import numpy as np
    rng = np.random.default_rng(0)
    L = K.layers
    model = _KERAS[name](K, L, size)
    sce = K.losses.SparseCategoricalCrossentropy
    img = lambda b: rng.random((b, size, size, 3), dtype=np.float32)  # noqa: E731
    ids = lambda b, vocab: rng.integers(0, vocab, (b, size)).astype("int32")  # noqa: E731
    if name == "UNet":
        return model, lambda b: (img(b), rng.integers(0, 5, (b, size, size))), sce()
    if name == "ConvAutoencoder":
        return model, lambda b: (img(b), img(b)), "mse"
    if name == "Siamese":
        return model, lambda b: ([img(b), img(b)], rng.integers(0, 2, (b, 1)).astype("float32")), \
            "binary_crossentropy"
    if name == "BiGRUTagger":
        return model, lambda b: (ids(b, 8000), rng.integers(0, 17, (b, size))), sce(from_logits=True)
    if name == "TextCNN":
        return model, lambda b: (ids(b, 10000), rng.integers(0, 4, b)), sce(from_logits=True)
    if name == "MultiIO":
        return model, lambda b: ([img(b), rng.random((b, 16), dtype=np.float32)],
                                 [rng.integers(0, 10, b), rng.random((b, 1), dtype=np.float32)]), \
            {"cls": sce(), "reg": "mse"}
    if name == "RecomputeMLP":
        return model, lambda b: (rng.random((b, size), dtype=np.float32), rng.integers(0, 10, b)), \
            sce(from_logits=True)
    return model, lambda b: (img(b), rng.integers(0, 10, b)), sce(from_logits=True)


# ================================================================== torch

def _t(model, batch, optimizer, precision="float32", **kw):
    d = {"model": model, "size": kw.pop("size", 224), "batch": batch, "optimizer": optimizer,
         "precision": precision}
    d.update(kw)
    return d


TORCH_WRITTEN: List[Dict[str, Any]] = [
    _t("custom_unet", 16, "adam", size=128), _t("custom_transformer", 16, "adamw", "bf16", size=256),
    _t("ckpt_reentrant", 16, "adamw", size=256), _t("ckpt_nonreentrant", 16, "adamw", "bf16", size=256),
    _t("ckpt_selective", 16, "adamw", "bf16", size=256),
    _t("hf_gpt2_ckpt", 8, "adamw", "bf16", size=256), _t("hf_llama_ckpt", 8, "adamw", size=256),
    _t("hf_llama_lora", 8, "adamw", "bf16", size=256), _t("hf_bert_frozen", 16, "adam", size=256),
    _t("resnet50_frozen", 32, "momentum"), _t("resnet50", 32, "adam", "bf16"),
    _t("resnet18_compiled", 32, "adam"), _t("custom_transformer_compiled", 16, "adamw", "bf16", size=256),
    _t("resnet18", 32, "adam"),  # the compiled resnet18's eager twin
]

#: torch.compile'd cases: the estimate simulates the eager module (and says so)
COMPILED = {"resnet18_compiled": "resnet18", "custom_transformer_compiled": "custom_transformer"}


class _UNet:
    """A small UNet in torch: two down steps, two ConvTranspose2d up steps with skip concatenation."""

    @staticmethod
    def build():
        import torch
        nn = torch.nn

        def conv2(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        class UNet(nn.Module):
            def __init__(self):
                super().__init__()
                self.d1, self.d2, self.mid = conv2(3, 32), conv2(32, 64), conv2(64, 128)
                self.u2, self.c2 = nn.ConvTranspose2d(128, 64, 2, stride=2), conv2(128, 64)
                self.u1, self.c1 = nn.ConvTranspose2d(64, 32, 2, stride=2), conv2(64, 32)
                self.head = nn.Conv2d(32, 5, 1)

            def forward(self, x):
                a = self.d1(x)
                b = self.d2(torch.nn.functional.max_pool2d(a, 2))
                m = self.mid(torch.nn.functional.max_pool2d(b, 2))
                b = self.c2(torch.cat([self.u2(m), b], 1))
                a = self.c1(torch.cat([self.u1(b), a], 1))
                return self.head(a)
        return UNet()


def _transformer(checkpointing=None, vocab=8000, d=512, heads=8, blocks=6):
    """A decoder written by hand: token embedding, blocks of causal self-attention (one fused qkv
    projection, ``scaled_dot_product_attention``) and a GELU MLP, pre-norm, a tied LM head;
    ``checkpointing``: None, "reentrant", "nonreentrant" or "selective" per block."""
    import functools
    import torch
    from torch.utils.checkpoint import checkpoint
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(a)
            return x + self.out(F.gelu(self.fc(self.n2(x))))

    def policy(ctx, op, *args, **kwargs):  # torchtitan's idea: keep matmul and attention outputs
        from torch.utils.checkpoint import CheckpointPolicy
        keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten._scaled_dot_product_efficient_attention.default,
                torch.ops.aten._scaled_dot_product_flash_attention.default}
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(1024, d))
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            x = self.emb(ids) + self.pos[: ids.shape[1]]
            for blk in self.blocks:
                if checkpointing is None:
                    x = blk(x)
                elif checkpointing == "selective":
                    from torch.utils.checkpoint import create_selective_checkpoint_contexts
                    x = checkpoint(blk, x, use_reentrant=False,
                                   context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
                else:
                    x = checkpoint(blk, x, use_reentrant=checkpointing == "reentrant")
            return self.head(self.norm(x))
    return Decoder()


def _hf(name: str, device: str):
    import torch
    from bench.estimate import estimate_zoo_torch as Z
    base = {"hf_gpt2_ckpt": "hf_gpt2", "hf_llama_ckpt": "hf_llama", "hf_llama_lora": "hf_llama",
            "hf_bert_frozen": "hf_bert"}[name]
    with torch.device(device):
        model, cfg, kind = Z.hf_build(base)
    if name.endswith("_ckpt"):
        model.gradient_checkpointing_enable()
    if name == "hf_llama_lora":
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.05))
    if name == "hf_bert_frozen":
        for p in model.bert.parameters():
            p.requires_grad_(False)
    return model, cfg.vocab_size


def torch_written(name: str, size: int, device: str):
    """(model, inputs(batch, device) -> (args, kwargs)) for hand-written torch case ``name``."""
    import torch

    def empty(shape, dtype, dev):
        return torch.empty(shape, dtype=dtype, device=dev) if dev == "meta" else \
            (torch.randn(shape, device=dev) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype, device=dev))
    if name == "custom_unet":
        with torch.device(device):
            model = _UNet.build()
        return model, lambda b, dev: ((empty((b, 3, size, size), torch.float32, dev),), {})
    if name == "custom_transformer" or name.startswith("ckpt_"):
        mode = {"ckpt_reentrant": "reentrant", "ckpt_nonreentrant": "nonreentrant",
                "ckpt_selective": "selective"}.get(name)
        with torch.device(device):
            model = _transformer(mode)
        return model, lambda b, dev: ((empty((b, size), torch.long, dev),), {})
    if name.startswith("hf_"):
        model, vocab = _hf(name, device)
        return model, lambda b, dev: ((), {"input_ids": empty((b, size), torch.long, dev)})
    if name == "resnet50_frozen":
        import torchvision
        with torch.device(device):
            model = torchvision.models.resnet50(weights=None)
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("fc."))
        return model, lambda b, dev: ((empty((b, 3, size, size), torch.float32, dev),), {})
    raise KeyError(name)
