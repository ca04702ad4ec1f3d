"""``distmem.fit`` proven at scale: hundreds of (model, fleet, global batch) cases on one GPU, whole process.

    PYTHONPATH=. python3 bench/plan/fit_scale.py run --budget-s 390 --out $OUT            # on the GPU machine
    PYTHONPATH=. python3 bench/plan/fit_scale.py run --budget-s 390 --out $OUT \\
        --skip-done bench/results/fit_scale_h200.jsonl                                    # the next session: the rest
    PYTHONPATH=. python3 bench/plan/fit_scale.py dry --max-cases 20                        # CPU: fit's answers only
    PYTHONPATH=. python3 bench/plan/fit_scale.py smoke --max-cases 6                       # CPU: the training runs' plumbing
    PYTHONPATH=. python3 bench/plan/fit_scale.py run --cpu --budget-s 900 --out /tmp/fs --only 'hand:mlp'  # CPU: the coordinator
    PYTHONPATH=. python3 bench/plan/fit_scale.py run --budget-s 140 --out $OUT \\
        --redo bench/results/fit_scale_h200.jsonl --new 6 --allocator-probes none --tag h200-2  # what failed, again
    PYTHONPATH=. python3 bench/plan/fit_scale.py summarize bench/results/fit_scale_h200.jsonl \\
        $OUT/fit_scale_h200.jsonl --merge-to bench/results/fit_scale_h200.jsonl \\
        --summary-out bench/results/fit_scale_h200_summary.json                           # every case's latest run

Every case is a question a user asks ``distmem.fit`` (the public door) before launch: a model built as
users build it (torchvision and timm models, Hugging Face models from their configs - large
vocabularies, gradient checkpointing - and models written by hand as ``nn.Sequential`` of blocks), a
global batch and a fleet of GPUs of 8 to 80 GiB (``"4x16GiB"``), in a precision (``"auto"`` tries
float32 and mixed_bfloat16; mixed_float16 too), with the shardings it may use (ZeRO-1/2, FSDP2). The
model is built on the meta device and estimated there (``estimate="model"``: the answer a laptop or
login node gets; ``--estimate auto`` measures where a GPU is at hand). Models whose top-level children
do not run in sequence are asked with ``pipelines=[1]`` (data parallel, sharded or not), as a user of
DDP/FSDP asks.

Then, each run in a fresh process on this one GPU, emulating the fleet's GPU
(``torch.cuda.set_per_process_memory_fraction``; several runs at once, each under its own fraction,
packed so that their caps and contexts fit the GPU):

* ``chosen``: the chosen layout's heaviest rank (rank 0 of N through torch's fake process group
  ``torch.testing._internal.distributed.fake_pg``; a pipeline stage alone with the micro-batches its
  schedule keeps in flight) trains 4 steps under its planned limit, with the allocator settings
  ``init()`` gives the job (expandable segments where fit says it needs them); where float16's loss
  scaler skips steps, more, until the optimizer has stepped and a whole step has run with its state
  (a run whose optimizer never stepped proves nothing: booked as an error);
* ``best_rejected``: the best rejected layout's binding rank under its GPU's share;
* ``mb_up``: the chosen layout with the next micro-batch up (fit's own verdict on it: asked again
  where it was not among the rejected), under its share, when fit rejects it;
* ``default_allocator`` (cases where fit asked for expandable segments: every torch case under a
  hard limit): the chosen rank again without them, the evidence that the setting is needed;
  ``without_expandable``: the layout ``fit(..., expandable_segments=False)`` chooses (limits with
  room for the largest allocation), run without them (``--allocator-probes none``: neither).

Each run reads NVML's per-process usage (``nvmlDeviceGetComputeRunningProcesses``, by pid; sampled
while it trains and after) beside the allocator's peaks. A layout fits only if the whole process -
the allocator's reserve, the CUDA context, cuBLAS/cuDNN, and NCCL's communicators where the job
runs them (modelled: one GPU has no peers) - stays inside the rank's part of its GPU (its share plus
the memory outside the allocator the plan counted). Per run the memory outside the allocator
measured (NVML minus torch's reserved) is booked beside :mod:`distmem.plan.outside`'s figure.

Results: one JSON line per case as it completes (``fit_scale_h200.jsonl``: fit's answer, every
run), and a summary (``fit_scale_h200_summary.json``): chosen layouts out of memory (allocator OOM
or NVML over the share; target 0), rejected layouts that would have trained (target <= 5%), the
median memory the chosen layout left unused, fit's time per case, the outside-allocator model
against NVML. Cases run most informative first (every model family, wrapper and precision early);
what the ``--budget-s`` leaves undone, a later run takes with ``--skip-done``; ``--redo FILE`` runs
FILE's cases that count against the targets again (then ``--new N`` it does not hold), and
``summarize A B --merge-to A`` keeps every case's latest record (each carries its run's ``--tag``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 1024 ** 2
GiB = 1024 ** 3
NAME = "fit_scale_h200"
STEPS = 4
#: steps a run takes past STEPS, at most, waiting for the loss scaler to let the optimizer step
MAX_SKIPPED = 12
T0 = time.time()


def log(msg: str) -> None:
    print(f"[fit-scale {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ====================================================================== models, as users build them

@dataclass(frozen=True)
class Model:
    """A model of the bench. ``kind``: what it takes (``image``: (B, 3, S, S); ``tokens``: (B, S)
    token ids; ``seq2seq``: encoder ids (B, S) and decoder ids (B, S/2); ``vector``: (B, S)).
    ``sequential``: its top-level children run one after another (pipeline stages are slices of
    them). ``spec``: asked of fit as a spec string (the CLI's form) instead of a built module.
    ``tied``: weights shared between top-level children (no FSDP2 per child)."""

    key: str
    family: str
    kind: str
    size: int
    vocab: int = 0
    classes: int = 1000
    sequential: bool = False
    spec: Optional[str] = None
    tied: bool = False
    tags: Tuple[str, ...] = ()
    params_m: float = 0.0  # millions of parameters (scheduling: a build may hold the whole model once)


def _hf_config(name: str) -> Tuple[Any, Any, bool]:
    """(config, model class, gradient checkpointing) of a Hugging Face model of the bench."""
    import transformers as T

    ckpt = name.endswith("+ckpt")
    base = name[:-5] if ckpt else name
    if base == "gpt2":
        return T.GPT2Config(), T.GPT2LMHeadModel, ckpt
    if base == "gpt2-medium":
        return T.GPT2Config(n_embd=1024, n_layer=24, n_head=16), T.GPT2LMHeadModel, ckpt
    if base == "llama-160m":
        return (T.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                              num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024),
                T.LlamaForCausalLM, ckpt)
    if base == "llama3-400m":  # Llama 3's 128k vocabulary on a small body
        return (T.LlamaConfig(vocab_size=128256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048),
                T.LlamaForCausalLM, ckpt)
    if base == "qwen2-0.5b":  # Qwen2-0.5B's shape: 152k vocabulary, tied embeddings
        return (T.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                              tie_word_embeddings=True),
                T.Qwen2ForCausalLM, ckpt)
    if base == "mistral-1b":
        return (T.MistralConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048),
                T.MistralForCausalLM, ckpt)
    if base == "gemma-300m":  # Gemma's 256k vocabulary
        return (T.GemmaConfig(vocab_size=256000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                              max_position_embeddings=2048),
                T.GemmaForCausalLM, ckpt)
    if base == "bert-base":
        return T.BertConfig(), T.BertForMaskedLM, ckpt
    # the unseen set (--set unseen): architectures the scale set does not hold
    if base == "opt-350m":  # OPT-350M's shape: embeddings projected from 512 to the body's 1024
        return (T.OPTConfig(vocab_size=50272, hidden_size=1024, num_hidden_layers=24, ffn_dim=4096,
                            num_attention_heads=16, word_embed_proj_dim=512, max_position_embeddings=2048),
                T.OPTForCausalLM, ckpt)
    if base == "pythia-160m":  # GPT-NeoX: parallel attention and MLP, partial rotary
        return (T.GPTNeoXConfig(vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                intermediate_size=3072, rotary_pct=0.25, max_position_embeddings=2048),
                T.GPTNeoXForCausalLM, ckpt)
    if base == "phi-350m":
        return (T.PhiConfig(vocab_size=51200, hidden_size=1024, num_hidden_layers=16, intermediate_size=4096,
                            num_attention_heads=16, max_position_embeddings=2048),
                T.PhiForCausalLM, ckpt)
    if base == "bloom-560m":  # BLOOM's 251k vocabulary, ALiBi
        return T.BloomConfig(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16), T.BloomForCausalLM, ckpt
    if base == "distilbert":
        return T.DistilBertConfig(), T.DistilBertForMaskedLM, ckpt
    if base == "roberta-base":
        return T.RobertaConfig(vocab_size=50265, max_position_embeddings=514), T.RobertaForMaskedLM, ckpt
    if base == "bart-base":
        return T.BartConfig(), T.BartForConditionalGeneration, ckpt
    if base == "mixtral-tiny":  # a mixture of experts: 8 experts, 2 per token, routed by the data
        return (T.MixtralConfig(vocab_size=32000, hidden_size=768, intermediate_size=1536, num_hidden_layers=8,
                                num_attention_heads=12, num_key_value_heads=4, num_local_experts=8,
                                num_experts_per_tok=2, max_position_embeddings=2048),
                T.MixtralForCausalLM, ckpt)
    if base == "t5-small":
        return T.T5Config(), T.T5ForConditionalGeneration, ckpt
    raise KeyError(name)


def _gpt(d: int, layers: int, heads: int, seq: int, vocab: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from collections import OrderedDict

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)

        def forward(self, idx):
            return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.out = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, x):
            return self.out(self.ln(x))

    class GPT(nn.Sequential):
        def example_input(self, batch):  # what the estimator feeds it: token ids
            return torch.zeros((batch, seq), dtype=torch.long)

    parts: "OrderedDict[str, Any]" = OrderedDict(embed=Embed())
    for i in range(layers):
        parts[f"block{i}"] = Block()
    parts["head"] = Head()
    return GPT(parts)


def _vgg16_seq():
    import torch.nn as nn
    import torchvision
    from collections import OrderedDict

    tv = torchvision.models.vgg16(weights=None)
    parts: "OrderedDict[str, Any]" = OrderedDict()
    convs, i, k = list(tv.features), 0, 0
    while i < len(convs):  # one block per convolution with its ReLU (and a following pool)
        group = [convs[i]]
        i += 1
        while i < len(convs) and not isinstance(convs[i], nn.Conv2d):
            group.append(convs[i])
            i += 1
        parts[f"conv{k}"] = nn.Sequential(*group)
        k += 1
    parts["pool"] = nn.Sequential(tv.avgpool, nn.Flatten())
    cls = list(tv.classifier)
    parts["fc0"], parts["fc1"], parts["fc2"] = nn.Sequential(*cls[0:3]), nn.Sequential(*cls[3:6]), cls[6]
    return nn.Sequential(parts)


def _resnet_seq(depth: int):
    import torch.nn as nn
    import torchvision
    from collections import OrderedDict

    tv = getattr(torchvision.models, f"resnet{depth}")(weights=None)
    parts: "OrderedDict[str, Any]" = OrderedDict(stem=nn.Sequential(tv.conv1, tv.bn1, tv.relu, tv.maxpool))
    for li in range(1, 5):
        for bi, block in enumerate(getattr(tv, f"layer{li}")):
            parts[f"layer{li}_{bi}"] = block
    parts["pool"] = nn.Sequential(tv.avgpool, nn.Flatten())
    parts["fc"] = tv.fc
    return nn.Sequential(parts)


def _lstm_lm(vocab: int, seq: int, d: int = 1024, layers: int = 2):
    """A hand-written LSTM language model (cuDNN's RNN kernels and their reserve space)."""
    import torch
    import torch.nn as nn

    class LSTMLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.rnn = nn.LSTM(d, d, num_layers=layers, batch_first=True)
            self.head = nn.Linear(d, vocab)

        def forward(self, idx):
            return self.head(self.rnn(self.embed(idx))[0])

        def example_input(self, batch):  # what the estimator feeds it: token ids
            return torch.zeros((batch, seq), dtype=torch.long)

    return LSTMLM()


def _unet(classes: int = 19, base: int = 64):
    """A hand-written U-Net (skip connections held across the whole forward; not a sequence)."""
    import torch
    import torch.nn as nn

    def conv(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                             nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            w = [base, base * 2, base * 4, base * 8]
            self.downs = nn.ModuleList([conv(3, w[0])] + [conv(w[i], w[i + 1]) for i in range(3)])
            self.pool = nn.MaxPool2d(2)
            self.ups = nn.ModuleList([nn.ConvTranspose2d(w[i + 1], w[i], 2, stride=2) for i in reversed(range(3))])
            self.dec = nn.ModuleList([conv(w[i] * 2, w[i]) for i in reversed(range(3))])
            self.out = nn.Conv2d(w[0], classes, 1)

        def forward(self, x):
            skips = []
            for i, down in enumerate(self.downs):
                x = down(x if i == 0 else self.pool(x))
                skips.append(x)
            for up, dec, skip in zip(self.ups, self.dec, reversed(skips[:-1])):
                x = dec(torch.cat([up(x), skip], dim=1))
            return self.out(x)

    return UNet()


def _mlp(width: int, depth: int, inputs: int, classes: int):
    import torch.nn as nn

    layers: List[Any] = [nn.Sequential(nn.Linear(inputs, width), nn.GELU())]
    layers += [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(depth)]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


_TV = [("resnet18", 11.7), ("resnet50", 25.6), ("resnet101", 44.5), ("vgg16", 138.4), ("vit_b_16", 86.6),
       ("convnext_tiny", 28.6), ("efficientnet_b0", 5.3), ("mobilenet_v3_large", 5.5), ("densenet121", 8.0),
       ("swin_t", 28.3), ("wide_resnet50_2", 68.9)]
_TIMM = [("vit_small_patch16_224", 22.1), ("vit_base_patch16_224", 86.6), ("convnext_small", 50.2),
         ("efficientnet_b2", 9.1), ("resnet50d", 25.6), ("swin_tiny_patch4_window7_224", 28.3),
         ("regnety_016", 11.2), ("mixer_b16_224", 59.9)]
_HF = [("gpt2", "tokens", 1024, 50257, True, 124), ("gpt2-medium", "tokens", 1024, 50257, True, 355),
       ("gpt2-medium+ckpt", "tokens", 1024, 50257, True, 355), ("llama-160m", "tokens", 1024, 32000, False, 134),
       ("llama3-400m", "tokens", 1024, 128256, False, 480), ("llama3-400m+ckpt", "tokens", 1024, 128256, False, 480),
       ("qwen2-0.5b", "tokens", 1024, 151936, True, 494), ("qwen2-0.5b+ckpt", "tokens", 1024, 151936, True, 494),
       ("mistral-1b", "tokens", 1024, 32000, False, 1100), ("gemma-300m", "tokens", 1024, 256000, True, 440),
       ("bert-base", "tokens", 512, 30522, True, 110), ("t5-small", "seq2seq", 512, 32128, True, 60)]


#: ``--set unseen``: models the scale set does not hold (chosen after its rules were fitted, none of
#: them read by a rule): torchvision and timm models by name, Hugging Face configs, hand-written ones
_UNSEEN_TV = [("inception_v3", 27.2, 299), ("googlenet", 6.6, 224), ("resnext50_32x4d", 25.0, 224),
              ("regnet_y_1_6gf", 11.2, 224), ("shufflenet_v2_x1_0", 2.3, 224), ("efficientnet_v2_s", 21.5, 224),
              ("convnext_base", 88.6, 224), ("maxvit_t", 30.9, 224), ("swin_v2_t", 28.4, 256),
              ("vit_l_16", 304.3, 224), ("squeezenet1_1", 1.2, 224), ("mnasnet1_0", 4.4, 224)]
_UNSEEN_TIMM = [("deit_small_patch16_224", 22.1), ("beit_base_patch16_224", 86.5), ("resnet152", 60.2),
                ("efficientnetv2_rw_s", 23.9), ("poolformer_s12", 11.9), ("cait_xxs24_224", 12.0),
                ("nfnet_l0", 35.1), ("edgenext_small", 5.6), ("repvgg_a2", 28.2), ("coat_lite_mini", 11.0)]
_UNSEEN_HF = [("opt-350m", "tokens", 1024, 50272, True, 331), ("pythia-160m", "tokens", 1024, 50304, False, 162),
              ("pythia-160m+ckpt", "tokens", 1024, 50304, False, 162), ("phi-350m", "tokens", 1024, 51200, False, 310),
              ("bloom-560m", "tokens", 1024, 250880, True, 559), ("distilbert", "tokens", 512, 30522, True, 66),
              ("roberta-base", "tokens", 512, 50265, True, 125), ("bart-base", "seq2seq", 512, 50265, True, 140)]


#: image models whose names start so are tagged ``attention`` (token mixers), the others ``conv``
_ATTENTION = ("vit", "swin", "maxvit", "mixer", "deit", "beit", "cait", "coat", "poolformer", "edgenext")


def _models() -> Dict[str, Model]:
    out: Dict[str, Model] = {}
    for name, pm, size in [(n, p, 224) for n, p in _TV] + _UNSEEN_TV:
        out[f"tv:{name}"] = Model(f"tv:{name}", "torchvision", "image", size, spec=f"torchvision:{name}", params_m=pm,
                                  tags=("attention",) if name.startswith(_ATTENTION) else ("conv",))
    for name, pm in _TIMM + _UNSEEN_TIMM:
        out[f"timm:{name}"] = Model(f"timm:{name}", "timm", "image", 224, params_m=pm,
                                    tags=("attention",) if name.startswith(_ATTENTION) else ("conv",))
    for name, kind, seq, vocab, tied, pm in _HF + _UNSEEN_HF:
        tags = ["attention"] + (["large-vocab"] if vocab >= 100000 else []) + (["checkpointing"] if "+ckpt" in name
                                                                              else [])
        out[f"hf:{name}"] = Model(f"hf:{name}", "huggingface", kind, seq, vocab=vocab, tied=tied, tags=tuple(tags),
                                  params_m=pm)
    out["hand:lstm-lm"] = Model("hand:lstm-lm", "hand-written", "tokens", 512, vocab=32000, tags=("rnn",),
                                params_m=82)
    out["hand:unet"] = Model("hand:unet", "hand-written", "image", 256, tags=("conv", "skips"), params_m=7.8)
    out["hand:resnet50-frozen"] = Model("hand:resnet50-frozen", "hand-written", "image", 224, tags=("conv", "frozen"),
                                        params_m=25.6)
    out["hf:llama-160m+lora"] = Model("hf:llama-160m+lora", "huggingface", "tokens", 1024, vocab=32000,
                                      tags=("attention", "frozen"), params_m=134)
    out["hf:mixtral-tiny"] = Model("hf:mixtral-tiny", "huggingface", "tokens", 1024, vocab=32000,
                                   tags=("attention", "experts"), params_m=330)
    for key, d, layers, heads, pm in (("gpt-125m", 768, 12, 12, 124), ("gpt-350m", 1024, 24, 16, 355),
                                      ("gpt-1b", 1600, 32, 25, 1040)):
        out[f"hand:{key}"] = Model(f"hand:{key}", "hand-written", "tokens", 1024, vocab=32768, sequential=True,
                                   tags=("attention", "pipeline"), params_m=pm)
    out["hand:vgg16-seq"] = Model("hand:vgg16-seq", "hand-written", "image", 224, sequential=True,
                                  tags=("conv", "pipeline"), params_m=138.4)
    out["hand:resnet50-seq"] = Model("hand:resnet50-seq", "hand-written", "image", 224, sequential=True,
                                     tags=("conv", "pipeline"), params_m=25.6)
    out["hand:resnet18-seq"] = Model("hand:resnet18-seq", "hand-written", "image", 224, sequential=True,
                                     tags=("conv", "pipeline"), params_m=11.7)
    out["hand:mlp"] = Model("hand:mlp", "hand-written", "vector", 4096, sequential=True, tags=("mlp", "pipeline"),
                            params_m=570)
    return out


MODELS = _models()


def build(key: str):
    """The model ``key`` built under the current ``torch.device`` context, as its users build it."""
    m = MODELS[key]
    if m.family == "torchvision":
        import torchvision

        return getattr(torchvision.models, key.split(":", 1)[1])(weights=None)
    if m.family == "timm":
        import timm

        return timm.create_model(key.split(":", 1)[1], pretrained=False)
    if m.family == "huggingface":
        name = key.split(":", 1)[1]
        lora = name.endswith("+lora")
        cfg, cls, ckpt = _hf_config(name[:-len("+lora")] if lora else name)
        model = cls(cfg)
        if ckpt:
            model.gradient_checkpointing_enable()
        if lora:  # PEFT's LoRA on the attention's query and value projections: the body frozen
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                               task_type="CAUSAL_LM"))
        return model
    name = key.split(":", 1)[1]
    if name.startswith("gpt-"):
        d, layers, heads = {"gpt-125m": (768, 12, 12), "gpt-350m": (1024, 24, 16), "gpt-1b": (1600, 32, 25)}[name]
        return _gpt(d, layers, heads, m.size, m.vocab)
    if name == "vgg16-seq":
        return _vgg16_seq()
    if name.startswith("resnet") and name.endswith("-seq"):
        return _resnet_seq(int(name[len("resnet"):-len("-seq")]))
    if name == "lstm-lm":
        return _lstm_lm(m.vocab, m.size)
    if name == "unet":
        return _unet()
    if name == "resnet50-frozen":  # fine-tuning the head alone: the backbone frozen
        import torchvision

        model = torchvision.models.resnet50(weights=None)
        for prm in model.parameters():
            prm.requires_grad_(False)
        for prm in model.fc.parameters():
            prm.requires_grad_(True)
        return model
    return _mlp(8192, 6, m.size, m.classes)


#: ``smoke`` (CPU): token sequences this long instead of the model's, so a step takes seconds
SMOKE_SEQ_ENV = "FIT_SCALE_SMOKE_SEQ"


def inputs(key: str, batch: int, device: str) -> Tuple[tuple, Dict[str, Any]]:
    """A batch for ``key`` on ``device``: what the estimator feeds it (token ids; images; vectors)."""
    import torch

    m = MODELS[key]
    real = device != "meta"
    if m.kind in ("tokens", "seq2seq"):
        seq = int(os.environ.get(SMOKE_SEQ_ENV) or m.size)
        ids = (torch.randint(0, m.vocab, (batch, seq), device=device) if real
               else torch.zeros((batch, seq), dtype=torch.long, device=device))
        if m.kind == "seq2seq":
            dec = torch.zeros((batch, seq // 2), dtype=torch.long, device=device)
            return (), {"input_ids": ids, "decoder_input_ids": dec}
        return ((ids,), {}) if m.family == "hand-written" else ((), {"input_ids": ids})
    shape = (batch, 3, m.size, m.size) if m.kind == "image" else (batch, m.size)
    return ((torch.randn(shape, device=device) if real else torch.empty(shape, device=device)),), {}


def loss_of(out: Any):
    """The loss the estimator assumes: cross-entropy over the last dimension of the logits, in float32."""
    import torch
    import torch.nn.functional as F

    t = out
    if isinstance(t, dict):
        t = t.get("logits", next(iter(t.values())))
    if isinstance(t, (list, tuple)):
        t = t[0]
    t = getattr(t, "logits", t)
    logits = t.reshape(-1, t.shape[-1])
    if logits.dtype != torch.float32:
        logits = logits.float()
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))


# ====================================================================== the cases

@dataclass(frozen=True)
class Case:
    """One question: ``model`` at ``batch`` samples per step on ``hosts`` hosts of ``count`` GPUs of
    ``gib`` GiB, in ``precision``, with ``shardings`` (fit's option)."""

    model: str
    batch: int
    count: int
    gib: int
    hosts: int = 1
    precision: str = "auto"
    shardings: str = "auto"

    @property
    def fleet(self) -> str:
        return f"{self.count}x{self.gib}GiB"

    @property
    def id(self) -> str:
        return (f"{self.model} B={self.batch} {self.hosts}x{self.fleet} {self.precision} "
                f"shardings={self.shardings}")

    def tags(self) -> List[str]:
        m = MODELS[self.model]
        gpu = "gpu<=12" if self.gib <= 12 else "gpu<=24" if self.gib <= 24 else "gpu<=48" if self.gib <= 48 else "gpu80"
        return ([f"family:{m.family}", f"model:{self.model}", f"precision:{self.precision}",
                 f"shardings:{self.shardings}", gpu, f"gpus:{self.count * self.hosts}", f"kind:{m.kind}"]
                + [f"tag:{t}" for t in m.tags] + (["hosts>1"] if self.hosts > 1 else []))

    def cost(self) -> float:
        """A rough share of the GPU's time and memory the case's runs take (orders ties)."""
        return self.gib * (1 + MODELS[self.model].params_m / 500)


#: per model: (global batch, GPUs per host, GiB per GPU[, hosts]) questions; the precision and the
#: shardings asked rotate over each model's questions
_PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")
_SHARDINGS = ("auto", "none", "zero1,zero2", "fsdp2,fsdp2_keep")

_IMAGE_SMALL = [(256, 4, 8), (512, 4, 12), (1024, 8, 10), (128, 2, 8), (512, 8, 16), (2048, 8, 24), (128, 1, 8)]
_IMAGE_MID = [(256, 4, 16), (512, 8, 12), (128, 2, 10), (256, 4, 24), (1024, 8, 32), (512, 4, 40), (256, 1, 16)]
_IMAGE_BIG = [(256, 4, 16), (128, 4, 10), (512, 8, 24), (256, 2, 40), (1024, 8, 80), (64, 2, 8), (128, 1, 24)]

_QUESTIONS: Dict[str, List[Tuple[int, ...]]] = {
    "tv:resnet18": _IMAGE_SMALL, "tv:resnet50": _IMAGE_MID, "tv:resnet101": _IMAGE_MID,
    "tv:vgg16": _IMAGE_BIG, "tv:vit_b_16": _IMAGE_MID, "tv:convnext_tiny": _IMAGE_MID,
    "tv:efficientnet_b0": _IMAGE_SMALL, "tv:mobilenet_v3_large": _IMAGE_SMALL, "tv:densenet121": _IMAGE_SMALL,
    "tv:swin_t": _IMAGE_MID, "tv:wide_resnet50_2": _IMAGE_BIG,
    "timm:vit_small_patch16_224": _IMAGE_SMALL, "timm:vit_base_patch16_224": _IMAGE_MID,
    "timm:convnext_small": _IMAGE_MID, "timm:efficientnet_b2": _IMAGE_SMALL, "timm:resnet50d": _IMAGE_MID,
    "timm:swin_tiny_patch4_window7_224": _IMAGE_MID, "timm:regnety_016": _IMAGE_SMALL,
    "timm:mixer_b16_224": _IMAGE_BIG,
    "hf:gpt2": [(32, 4, 12), (64, 8, 10), (16, 2, 8), (128, 8, 24), (64, 4, 40), (8, 1, 8)],
    "hf:gpt2-medium": [(32, 4, 16), (64, 8, 24), (16, 4, 10), (128, 4, 80)],
    "hf:gpt2-medium+ckpt": [(32, 4, 12), (128, 8, 16), (64, 2, 24)],
    "hf:llama-160m": [(32, 4, 12), (64, 8, 16), (16, 2, 8), (128, 4, 40), (16, 1, 12)],
    "hf:llama3-400m": [(32, 8, 24), (16, 4, 16), (64, 4, 48), (128, 8, 80)],
    "hf:llama3-400m+ckpt": [(32, 4, 16), (64, 8, 20), (128, 4, 40)],
    "hf:qwen2-0.5b": [(16, 4, 24), (32, 8, 32), (64, 4, 80), (8, 2, 16)],
    "hf:qwen2-0.5b+ckpt": [(32, 4, 24), (64, 8, 40), (16, 2, 16)],
    "hf:mistral-1b": [(16, 8, 40), (32, 8, 48), (64, 4, 80), (16, 8, 24), (8, 4, 32)],
    "hf:gemma-300m": [(16, 4, 24), (32, 8, 40), (8, 2, 16), (64, 4, 80)],
    "hf:bert-base": [(64, 4, 12), (128, 8, 10), (256, 4, 24), (32, 2, 8)],
    "hf:t5-small": [(64, 4, 8), (128, 8, 12), (256, 4, 24), (32, 2, 8)],
    "hand:gpt-125m": [(32, 4, 8), (64, 8, 12), (128, 8, 16), (16, 2, 8), (64, 4, 24), (16, 1, 10)],
    "hand:gpt-350m": [(64, 4, 16), (128, 8, 24), (32, 8, 8), (64, 8, 12, 2), (128, 4, 40)],
    "hand:gpt-1b": [(32, 4, 16), (64, 8, 24), (16, 8, 8), (32, 8, 12), (128, 8, 48, 2), (64, 4, 80)],
    "hand:vgg16-seq": [(256, 4, 16), (128, 8, 8), (512, 8, 24), (64, 4, 10)],
    "hand:resnet50-seq": [(512, 4, 12), (256, 8, 8), (1024, 8, 24), (128, 2, 10)],
    "hand:mlp": [(4096, 4, 8), (16384, 8, 12), (8192, 2, 16), (2048, 8, 10)],
}


#: ``--set pairs``: the (model, fleet) pairs of ``bench/plan/fit.py`` (bench/results/fit_h200.json),
#: asked and run as every case here is - sharded layouts sharded (rank 0 of N), the allocator settings
#: init() gives the job, NVML beside the allocator. fit.py's own worker ran every layout unsharded with
#: the default allocator (bench/results/fit_h200_pairs_worker_gap.json measured what that costs).
PAIR_CASES = [
    Case("hand:resnet50-seq", 512, 4, 12, 1, "float32"), Case("hand:resnet50-seq", 256, 8, 6, 1, "auto"),
    Case("hand:resnet18-seq", 1024, 4, 16, 1, "auto"), Case("hand:vgg16-seq", 256, 4, 16, 1, "float32"),
    Case("hand:gpt-350m", 64, 4, 16, 1, "float32"), Case("hand:gpt-350m", 128, 8, 24, 1, "auto"),
    Case("hand:gpt-1b", 32, 4, 16, 1, "float32"), Case("hand:gpt-1b", 64, 8, 24, 1, "auto"),
    Case("hand:gpt-1b", 32, 8, 12, 1, "mixed_bfloat16"), Case("hand:gpt-1b", 16, 8, 8, 1, "float32"),
    Case("hand:resnet50-seq", 128, 2, 6, 1, "float32"),
]

SETS = ("scale", "pairs", "unseen")

#: ``--set unseen``: per model (global batch, GPUs per host, GiB per GPU[, hosts]); precision and
#: shardings rotate as in the scale set
_UNSEEN_QUESTIONS: Dict[str, List[Tuple[int, ...]]] = {
    "tv:inception_v3": [(256, 4, 16), (512, 8, 12)], "tv:googlenet": [(512, 4, 10), (256, 2, 8)],
    "tv:resnext50_32x4d": [(256, 4, 12), (512, 8, 24)], "tv:regnet_y_1_6gf": [(512, 4, 12)],
    "tv:shufflenet_v2_x1_0": [(1024, 4, 8)], "tv:efficientnet_v2_s": [(256, 4, 16), (512, 8, 20)],
    "tv:convnext_base": [(256, 8, 16), (128, 2, 24)], "tv:maxvit_t": [(256, 4, 24)],
    "tv:swin_v2_t": [(256, 4, 24)], "tv:vit_l_16": [(128, 8, 40), (256, 8, 80)],
    "tv:squeezenet1_1": [(1024, 2, 8)], "tv:mnasnet1_0": [(512, 4, 8)],
    "timm:deit_small_patch16_224": [(512, 4, 12), (256, 2, 8)], "timm:beit_base_patch16_224": [(256, 8, 16)],
    "timm:resnet152": [(256, 4, 16), (512, 8, 32)], "timm:efficientnetv2_rw_s": [(256, 4, 16)],
    "timm:poolformer_s12": [(512, 4, 12)], "timm:cait_xxs24_224": [(256, 4, 10)],
    "timm:nfnet_l0": [(256, 4, 16)], "timm:edgenext_small": [(512, 4, 10)], "timm:repvgg_a2": [(512, 4, 12)],
    "timm:coat_lite_mini": [(256, 4, 10)],
    "hf:opt-350m": [(32, 4, 24), (64, 8, 40)], "hf:pythia-160m": [(32, 4, 12), (64, 8, 16)],
    "hf:pythia-160m+ckpt": [(64, 4, 12)], "hf:phi-350m": [(32, 4, 24), (64, 8, 32)],
    "hf:bloom-560m": [(16, 4, 40), (32, 8, 80)], "hf:distilbert": [(128, 4, 10)],
    "hf:roberta-base": [(64, 4, 12), (128, 8, 16)], "hf:bart-base": [(64, 4, 16)],
    "hand:lstm-lm": [(128, 4, 12), (256, 8, 16)], "hand:unet": [(64, 4, 16), (32, 2, 10)],
    "hand:resnet50-frozen": [(512, 4, 8), (1024, 2, 10)], "hf:llama-160m+lora": [(32, 4, 12), (64, 2, 16)],
    "hf:mixtral-tiny": [(32, 4, 16), (64, 8, 24)],
}


def all_cases(which: str = "scale") -> List[Case]:
    """Every case of the bench (in a fixed order; :func:`order_cases` decides the running order);
    ``which="pairs"``: :data:`PAIR_CASES`; ``"unseen"``: models the scale set does not hold."""
    if which == "pairs":
        return list(PAIR_CASES)
    out: List[Case] = []
    unseen = which == "unseen"
    for j, (key, questions) in enumerate((_UNSEEN_QUESTIONS if unseen else _QUESTIONS).items()):
        m = MODELS[key]
        for i, q in enumerate(questions):
            batch, count, gib = q[:3]
            hosts = q[3] if len(q) > 3 else 1
            # the unseen set asks each model once or twice: its precisions rotate over the models too
            prec = _PRECISIONS[(i + (j if unseen else 0)) % len(_PRECISIONS)]
            shard = _SHARDINGS[(i + len(key)) % len(_SHARDINGS)]
            if (m.tied or m.family == "huggingface" or "frozen" in m.tags) and shard in ("auto", "fsdp2,fsdp2_keep"):
                # fit prices FSDP2 with one unit per block, and a block is a top-level child: a
                # Hugging Face model's two children (the body, the head; tied weights between them)
                # are not the units its users shard (decoder layers), so its users are asked as ZeRO's
                shard = "zero1,zero2"
            out.append(Case(key, batch, count, gib, hosts, prec, shard))
    return out


def order_cases(cases: Sequence[Case]) -> List[Case]:
    """Most informative first: each next case adds the most tags (family, model, precision,
    shardings, GPU size, ...) not yet covered, cheaper first among equals; once every tag is
    covered, models take turns."""
    left = list(cases)
    seen: Dict[str, int] = {}
    per_model: Dict[str, int] = {}
    out: List[Case] = []
    while left:
        def score(c: Case) -> Tuple[Any, ...]:
            new = sum(1 for t in c.tags() if t not in seen)
            return (-new, per_model.get(c.model, 0), sum(seen.get(t, 0) for t in c.tags()), c.cost(), c.id)
        best = min(left, key=score)
        left.remove(best)
        out.append(best)
        per_model[best.model] = per_model.get(best.model, 0) + 1
        for t in best.tags():
            seen[t] = seen.get(t, 0) + 1
    return out


# ====================================================================== asking fit (the door)

def _stage_row(stage: Any) -> Dict[str, Any]:
    d = stage.to_dict()
    d.pop("blocks", None)
    return d


def _candidate(cand: Any, stage: Any) -> Dict[str, Any]:
    out = cand.outside or {}
    parts = dict(out.get("parts", {}))
    nccl = sum(v for k, v in parts.items() if k.startswith("nccl"))
    return {"layout": cand.layout.to_dict(), "describe": cand.layout.describe(), "fits": bool(cand.fits),
            "stage": _stage_row(stage), "outside_total": int(out.get("total_bytes", 0)),
            "outside_parts": parts, "outside_nccl": int(nccl)}


#: ``run --headroom H``: every case asked as ``fit(..., headroom=H)`` (a headroom on trial, beside the
#: default in force); the askers read it from the environment
HEADROOM_ENV = "FIT_SCALE_HEADROOM"


def _fit_kwargs(case: Case, estimate: str) -> Dict[str, Any]:
    m = MODELS[case.model]
    kw: Dict[str, Any] = dict(global_batch_size=case.batch, gpus=case.fleet, hosts=case.hosts,
                              precision=case.precision, estimate=estimate, top=3, rejected=8)
    if case.shardings != "auto":
        kw["shardings"] = case.shardings
    if os.environ.get(HEADROOM_ENV):
        kw["headroom"] = float(os.environ[HEADROOM_ENV])  # fit(headroom=...): a rule on trial
    if not m.sequential:
        kw["pipelines"] = [1]  # its children do not run in sequence: data parallel, sharded or not
    if m.kind in ("image", "vector"):
        kw["input_shape"] = (3, m.size, m.size) if m.kind == "image" else (m.size,)
    return kw


def _asked_model(key: str) -> Any:
    """What the user hands fit: a spec string, or the model built on the meta device (no memory)
    with the example input its estimator needs."""
    import torch

    m = MODELS[key]
    if m.spec:
        return m.spec
    try:
        with torch.device("meta"):
            model = build(key)
    except (NotImplementedError, RuntimeError):
        # a constructor that reads a tensor's values (timm's regnety_016 under torch 2.11: aten::_unique2
        # has no meta kernel): built on the CPU, as its users build it
        model = build(key)
    if m.family == "huggingface":
        def example_input(batch: int, _key: str = key) -> Dict[str, Any]:
            return inputs(_key, batch, "meta")[1]
        model.example_input = example_input
    return model


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ask(case_dict: Dict[str, Any], estimate: str = "model") -> Dict[str, Any]:
    """Ask ``distmem.fit`` about one case (in an asker process, CUDA hidden); the answer as plain data."""
    import distmem

    case = Case(**case_dict)
    answer: Dict[str, Any] = {"case": case.id, "params": asdict(case), "family": MODELS[case.model].family}
    model = _asked_model(case.model)
    kw = _fit_kwargs(case, estimate)
    t = time.perf_counter()
    try:
        res = distmem.fit(model, **kw)
    except Exception as exc:  # noqa: BLE001 - a refusal is an answer too (booked, not run)
        answer.update(error=f"{type(exc).__name__}: {str(exc)[:600]}", fit_seconds=round(time.perf_counter() - t, 3))
        return answer
    answer.update(fit_seconds=round(time.perf_counter() - t, 3), solver_seconds=round(res.seconds, 3),
                  searched=res.searched, evaluated=res.evaluated, blocks=len(res.block_names),
                  expandable_segments=bool(res.expandable_segments), warnings=list(res.warnings)[:4],
                  suggestion=res.suggestion)
    if res.chosen is not None:
        answer["chosen"] = _candidate(res.chosen, res.chosen.heaviest)
    if res.rejected:
        rj = next((r for r in res.rejected if r.layout.ranks_per_gpu == 1 and r.binding is not None), None) \
            or next((r for r in res.rejected if r.binding is not None), None)
        if rj is not None:
            answer["best_rejected"] = _candidate(rj, rj.binding)
    if res.chosen is not None:
        answer["mb_up"] = _mb_up(model, case, kw, res)
    if res.expandable_segments:
        # the same question where expandable segments cannot be set (CUDA started before init, or
        # the user turned them off): fit must leave the headroom the largest block needs instead
        t = time.perf_counter()
        try:
            res2 = distmem.fit(model, **dict(kw, expandable_segments=False))
            if res2.chosen is not None:
                answer["without_expandable"] = dict(_candidate(res2.chosen, res2.chosen.heaviest),
                                                    fit_seconds=round(time.perf_counter() - t, 3))
        except Exception as exc:  # noqa: BLE001 - booked: nothing of it to run
            answer["without_expandable_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return answer


def _mb_up(model: Any, case: Case, kw: Dict[str, Any], res: Any) -> Dict[str, Any]:
    """fit's verdict on the chosen layout with the next micro-batch up (same replicas, stages,
    sharding, precision): from its rejected list, else asked again with the search pinned to it."""
    import distmem

    lay = res.chosen.layout
    per = case.batch // lay.data_parallel
    ups = [d for d in _divisors(per) if d > lay.micro_batch]
    if not ups:
        return {"status": "none", "why": f"micro-batch {lay.micro_batch} is the replica's whole batch"}
    up = replace(lay, micro_batch=ups[0], accumulation=per // ups[0])
    for cand in res.rejected:
        if cand.layout == up and cand.binding is not None:
            return dict(_candidate(cand, cand.binding), status="rejected", asked="in the first answer")
    for cand in res.fits:
        if cand.layout == up:
            return {"status": "fits", "describe": up.describe()}
    pinned = dict(kw, pipelines=[lay.pipeline], micro_batches=[up.micro_batch], ranks_per_gpu=[lay.ranks_per_gpu],
                  shardings=[lay.shard] if lay.shard else "none", precision=lay.precision, recompute=lay.recompute,
                  top=1, rejected=4)
    if lay.pipeline > 1:
        pinned["schedules"] = [lay.schedule]
    t = time.perf_counter()
    try:
        res2 = distmem.fit(model, **pinned)
    except Exception as exc:  # noqa: BLE001 - booked: no verdict to run
        return {"status": "none", "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
    secs = round(time.perf_counter() - t, 3)
    for cand in res2.fits:
        if cand.layout == up:
            return {"status": "fits", "describe": up.describe(), "fit_seconds": secs}
    for cand in res2.rejected:
        if cand.layout == up and cand.binding is not None:
            return dict(_candidate(cand, cand.binding), status="rejected", asked="pinned", fit_seconds=secs)
    return {"status": "none", "why": f"{up.describe()} not among fit's answers", "fit_seconds": secs}


# ====================================================================== the runs

ROLES = ("chosen", "best_rejected", "mb_up", "default_allocator", "without_expandable")


def run_specs(answer: Dict[str, Any], probes: bool = True) -> List[Dict[str, Any]]:
    """The runs of one answered case, most important first; ``probes``: also the allocator's
    (``default_allocator``, ``without_expandable``) where fit asked for expandable segments."""
    case = answer["params"]
    specs: List[Dict[str, Any]] = []
    xs = bool(answer.get("expandable_segments"))

    def spec(role: str, cand: Dict[str, Any], limit_key: str, expandable: bool) -> Optional[Dict[str, Any]]:
        lay, st = cand["layout"], cand["stage"]
        limit = int(st[limit_key])
        if limit < MiB:
            return None
        process_outside = cand["outside_total"] - cand["outside_nccl"]
        return {"case": answer["case"], "role": role, "describe": cand["describe"], "model": case["model"],
                "micro_batch": lay["micro_batch"],
                "accumulation": lay["accumulation"], "precision": lay["precision"], "shard": lay["shard"] or "",
                "world": lay["data_parallel"], "pipeline": lay["pipeline"], "schedule": lay["schedule"],
                "recompute": bool(lay["recompute"]), "first_block": st["first_block"], "stop_block": st["stop_block"],
                "blocks": answer.get("blocks", 0), "in_flight": st["in_flight"] if lay["pipeline"] > 1 else 1,
                "limit_bytes": limit, "planned_bytes": int(st["planned_bytes"]), "share_bytes": int(st["share_bytes"]),
                "estimated_peak": int(st["allocator_bytes"]), "figure": "bounded",
                "slice_bytes": int(st["share_bytes"]) + cand["outside_total"],
                "outside_modelled": cand["outside_total"], "outside_modelled_process": process_outside,
                "outside_nccl": cand["outside_nccl"], "gpu_total_bytes": int(st["gpu_total_bytes"]),
                "shared_by": int(st["shared_by"]), "expandable": expandable, "steps": STEPS,
                "params_m": MODELS[case["model"]].params_m}

    if "chosen" in answer:
        specs.append(spec("chosen", answer["chosen"], "planned_bytes", xs))
    if "best_rejected" in answer:
        specs.append(spec("best_rejected", answer["best_rejected"], "share_bytes", xs))
    up = answer.get("mb_up") or {}
    if up.get("status") == "rejected":
        specs.append(spec("mb_up", up, "share_bytes", xs))
    if xs and "chosen" in answer and probes:
        specs.append(spec("default_allocator", answer["chosen"], "planned_bytes", False))
    if "without_expandable" in answer and probes:
        specs.append(spec("without_expandable", answer["without_expandable"], "planned_bytes", False))
    return [s for s in specs if s is not None]


def _fraction(limit: int, total: int) -> float:
    """The fraction whose cap ``int(fraction * total)`` is at most ``limit`` (never above it)."""
    import math

    if limit >= total:
        return 1.0
    f = limit / total
    while int(f * total) > limit:
        f = math.nextafter(f, 0.0)
    return f


class _Nvml:
    """NVML's memory for one process (by pid), sampled in a thread while it trains."""

    def __init__(self) -> None:
        import threading

        self.ok = False
        self.peak = 0
        self.error: Optional[str] = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.ok = True
        except Exception as exc:  # noqa: BLE001 - booked: the run still says what the allocator saw
            self.error = f"{type(exc).__name__}: {exc}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def used(self) -> Optional[int]:
        if not self.ok:
            return None
        try:
            for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
        except Exception as exc:  # noqa: BLE001
            self.error = f"{type(exc).__name__}: {exc}"
        return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            v = self.used()
            if v is not None:
                self.peak = max(self.peak, v)
            self._stop.wait(0.02)

    def start(self) -> "_Nvml":
        if self.ok:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)


_OOM_FREE = re.compile(r"of which ([\d.]+) (GiB|MiB|KiB|bytes) is free")
_OOM_ASK = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|bytes)")
_UNIT = {"GiB": GiB, "MiB": MiB, "KiB": 1024, "bytes": 1}


_OOM_HELD = re.compile(r"([\d.]+) (GiB|MiB|KiB|bytes) is allocated by PyTorch, and ([\d.]+) (GiB|MiB|KiB|bytes) "
                       r"is reserved by PyTorch but unallocated")


def oom_parts(message: str) -> Dict[str, int]:
    """What an out-of-memory message says the allocator held when it gave up: the request
    (``oom_request``), the bytes allocated (``oom_allocated``) and those reserved but unallocated
    (``oom_stranded``: after it released what it could, what a hard limit must leave room for beside
    the allocations). Read from the whole message before it is shortened for the record; {} where
    it does not say."""
    got: Dict[str, int] = {}
    ask_, held = _OOM_ASK.search(message or ""), _OOM_HELD.search(message or "")
    if ask_:
        got["oom_request"] = int(float(ask_.group(1)) * _UNIT[ask_.group(2)])
    if held:
        got["oom_allocated"] = int(float(held.group(1)) * _UNIT[held.group(2)])
        got["oom_stranded"] = int(float(held.group(3)) * _UNIT[held.group(4)])
    return got


def physical_oom(message: str) -> bool:
    """Whether an out-of-memory message says the GPU itself had no room (other runs of the bench),
    not this process's cap: its free memory was below the request."""
    free, ask_ = _OOM_FREE.search(message or ""), _OOM_ASK.search(message or "")
    if not free or not ask_:
        return False
    return float(free.group(1)) * _UNIT[free.group(2)] < float(ask_.group(1)) * _UNIT[ask_.group(2)]


def _zero_optimizer(model: Any, kind: str):
    """ZeRO-1: ``ZeroRedundancyOptimizer`` over Adam; ZeRO-2: also free the gradients of parameters
    another rank owns once they are accumulated (a stage-2 rank keeps only its partition's)."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.Adam)
    if kind == "zero2":
        owned = {id(p) for g in opt.optim.param_groups for p in g["params"]}
        for p in model.parameters():
            if id(p) not in owned and p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    return opt


def _init_shards(model: Any) -> None:
    """Each rank initialises its own shards (FSDP2 built on the meta device)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.dim() > 1:
                local.normal_(0.0, 0.02)
            elif name.endswith("weight"):
                local.fill_(1.0)
            else:
                local.zero_()


def _materialise(module: Any, device: str) -> Any:
    """A module built on the meta device, on ``device`` with weights and buffers initialised."""
    import copy

    import torch

    real = copy.deepcopy(module).to_empty(device=device)
    _init_shards(real)
    with torch.no_grad():
        for name, b in real.named_buffers():
            b.fill_(1) if "running_var" in name else b.zero_()
    return real


def gpu_run(spec: Dict[str, Any], device: str = "cuda") -> Dict[str, Any]:
    """One rank of one layout for ``spec["steps"]`` steps under ``spec["limit_bytes"]``, in this
    (fresh) process; ``device="cpu"``: the plumbing alone (nothing measured)."""
    t0 = time.time()
    cuda = device == "cuda"
    if spec.get("expandable") and cuda:
        # what init() sets before CUDA starts (and tells the allocator at run time: torch may have
        # read its settings at import)
        for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            os.environ[var] = "expandable_segments:True"
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    out: Dict[str, Any] = {"oom": False, "error": None, "torch": torch.__version__}
    nvml = _Nvml() if cuda else None
    if cuda:
        torch.set_num_threads(2)  # the GPU does the work; many runs share the host's cores
        torch.cuda.set_device(0)
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        if setter is not None:
            try:
                setter(f"expandable_segments:{'True' if spec.get('expandable') else 'False'}")
            except Exception as exc:  # noqa: BLE001 - the environment set before the process started holds
                out["allocator_setting_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    key, mb, m = spec["model"], int(spec["micro_batch"]), int(spec["accumulation"])
    world, shard, p = int(spec["world"]), spec.get("shard") or "", int(spec["pipeline"])
    mixed = spec["precision"] != "float32"
    cdt = torch.bfloat16 if spec["precision"] == "mixed_bfloat16" else torch.float16
    limit = int(spec["limit_bytes"])
    total = torch.cuda.get_device_properties(0).total_memory if cuda else 0

    def cap() -> None:
        if cuda:
            torch.cuda.empty_cache()
            f = _fraction(limit, total)
            torch.cuda.set_per_process_memory_fraction(f, 0)
            out["cap_bytes"] = int(f * total)

    if shard and not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    stage_in: Optional[Tuple[Tuple[int, ...], Any]] = None
    try:
        first, stop = int(spec["first_block"]), int(spec["stop_block"])
        fsdp = shard.startswith("fsdp2")  # sharded after building: the whole model (stage) is held once, uncapped
        if p > 1:
            # a pipeline stage: its blocks alone; its input's shape from the blocks before it on the
            # meta device, its dtype under autocast from one real micro-batch of 1 through them (one
            # block on the device at a time, before the cap)
            with torch.device("meta"):
                children = list(build(key).children())
            if spec.get("blocks") and len(children) != int(spec["blocks"]):
                raise RuntimeError(f"{key}: fit cut {spec['blocks']} blocks but the model has {len(children)} "
                                   "top-level children; its stages are not slices of them")
            with torch.no_grad():
                h = inputs(key, mb, "meta")[0][0]
                for c in children[:first]:
                    h = c(h)
            shape, dtype = tuple(h.shape), h.dtype
            if first > 0 and mixed:
                with torch.no_grad(), torch.autocast(device, dtype=cdt):
                    hh = inputs(key, 1, device)[0][0]
                    for c in children[:first]:
                        real = _materialise(c, device)
                        hh = real(hh)
                        del real
                dtype = hh.dtype
                del hh
            stage_in = (shape, dtype)
            if not fsdp:
                cap()
            model = _materialise(nn.Sequential(*children[first:stop]), device)
        else:
            if not fsdp:
                cap()
            with torch.device(device):
                model = build(key)
        model.train()
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            units = len(list(model.children()))
            if p == 1 and spec.get("blocks") and units != int(spec["blocks"]):
                raise RuntimeError(f"{key}: fit priced FSDP2 over {spec['blocks']} blocks but the model has {units} "
                                   "top-level children to shard")

            for child in model.children():
                fully_shard(child, reshard_after_forward=shard == "fsdp2")
            fully_shard(model)
            cap()
        if shard in ("zero1", "zero2"):
            opt = _zero_optimizer(model, shard)
        else:
            opt = torch.optim.Adam(model.parameters())
        scaler = torch.amp.GradScaler(device) if spec["precision"] == "mixed_float16" else None
        last_stage = p == 1 or stop >= int(spec.get("blocks") or stop)
        recompute = bool(spec.get("recompute")) and p > 1

        def make_input():
            if stage_in is None or first == 0:
                return inputs(key, mb, device)
            shape, dtype = stage_in
            return (torch.randn(shape, device=device, dtype=dtype).requires_grad_(True),), {}

        def forward(args, kwargs):
            from torch.utils.checkpoint import checkpoint

            with torch.autocast(device, dtype=cdt, enabled=mixed):
                if recompute:
                    return checkpoint(model, *args, use_reentrant=False)
                return model(*args, **kwargs)

        def backward(o):
            if last_stage:
                loss = loss_of(o)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            else:
                # the gradient arriving from the next stage, scaled there by its GradScaler (this
                # stage's scaler then unscales its gradients in step(), as every stage's does); of
                # unit norm, as a mean-reduced loss's is (a unit normal per element, times the loss
                # scale, overflowed float16 and the scaler skipped every step: no optimizer state)
                grad = torch.randn_like(o) / math.sqrt(max(1, o.numel()))
                o.backward(scaler.scale(grad) if scaler is not None else grad)

        in_flight = max(1, int(spec.get("in_flight") or 1))
        peaks: List[int] = []
        if cuda:
            torch.cuda.synchronize()
            out["reserved_before_steps"] = int(torch.cuda.memory_reserved())
            out["allocated_before_steps"] = int(torch.cuda.memory_allocated())
            nvml.start()
        # a step the scaler skips (float16 overflow) creates no optimizer state: the job's steady
        # state is not reached until one is taken. Steps go on past ``steps`` until the optimizer
        # has stepped and a whole step has run after it (at most MAX_SKIPPED more)
        want = int(spec.get("steps", STEPS))
        stepped = 0
        first_taken: Optional[int] = None
        step_no = 0
        while step_no < want or ((first_taken is None or step_no <= first_taken) and step_no < want + MAX_SKIPPED):
            step_no += 1
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            pending: List[Any] = []
            kept = None
            for i in range(m):
                args, kwargs = make_input()
                pending.append(forward(args, kwargs))
                del args, kwargs
                if len(pending) >= in_flight:
                    o = pending.pop(0)
                    backward(o)
                    if i == m - 1 and p == 1:
                        kept = o  # the step's output lives to the update, as the estimator's step
                    del o
            while pending:
                o = pending.pop(0)
                backward(o)
                del o
            if scaler is not None:
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                taken = scaler.get_scale() >= before  # the scale falls only where the step was skipped
            else:
                opt.step()
                taken = True
            if taken:
                stepped += 1
                if first_taken is None:
                    first_taken = step_no
            opt.zero_grad(set_to_none=True)
            del kept
            if cuda:
                torch.cuda.synchronize()
                peaks.append(int(torch.cuda.max_memory_allocated()))
        out["steps_allocated"] = peaks
        out.update(optimizer_steps=stepped, skipped_steps=step_no - stepped)
    except torch.cuda.OutOfMemoryError as exc:
        msg = str(exc).split("\n")[0][:400]
        out.update(oom=True, error=msg, physical_oom=physical_oom(msg), **oom_parts(str(exc)))
    except Exception as exc:  # noqa: BLE001 - booked as an error, not an out-of-memory
        out.update(oom=None, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if cuda:
        torch.cuda.synchronize()
        time.sleep(0.3)  # NVML's per-process figure lags the allocations a little
        st = torch.cuda.memory_stats()
        used_end = nvml.used() if nvml is not None else None
        nvml.stop()
        reserved = int(torch.cuda.memory_reserved())
        out.update(peak_allocated=int(st.get("allocated_bytes.all.peak", 0)),
                   peak_reserved=int(st.get("reserved_bytes.all.peak", 0)), reserved_end=reserved,
                   nvml_end=used_end, nvml_peak=max(nvml.peak, used_end or 0) or None, nvml_error=nvml.error,
                   alloc_retries=int(st.get("num_alloc_retries", 0)),
                   outside_measured=(used_end - reserved) if used_end is not None else None)
        if spec.get("expandable"):
            try:
                out["expandable_effective"] = any(s.get("is_expandable") for s in torch.cuda.memory_snapshot())
            except Exception:  # noqa: BLE001 - a torch without the flag
                out["expandable_effective"] = None
    out["seconds"] = round(time.time() - t0, 2)
    return out


class _Fresh:
    """A run in a fresh interpreter (``python fit_scale.py child SPEC RESULT``) whose environment sets
    the allocator before torch is imported: the runs with expandable segments, as ``init()`` gives
    them to a job. Looks like a ``multiprocessing.Process`` to the coordinator."""

    def __init__(self, spec: Dict[str, Any], path: str) -> None:
        import subprocess

        with open(path + ".spec", "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            env[var] = "expandable_segments:True"
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "child", path + ".spec", path],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.proc.wait(timeout)
        except Exception:  # noqa: BLE001 - still running: the coordinator books it
            pass

    @property
    def exitcode(self) -> Optional[int]:
        return self.proc.returncode


def _child(spec: Dict[str, Any], path: str) -> None:
    """A run's process: the result as JSON at ``path`` (read by the coordinator once it exits)."""
    try:
        result = gpu_run(spec, device=spec.get("device", "cuda"))
    except BaseException as exc:  # noqa: BLE001 - the coordinator books it
        result = {"oom": None, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


# ====================================================================== judging and the summary

def judge(spec: Dict[str, Any], r: Dict[str, Any]) -> Dict[str, Any]:
    """A run's verdict. ``over_share``: the whole process as NVML saw it, plus the NCCL communicators
    the real job holds (modelled: fake process groups have none), above the rank's part of its GPU
    (share + the memory outside the allocator the plan counted). ``trained``: all steps, no
    out-of-memory, not over the share."""
    v: Dict[str, Any] = {}
    if r.get("physical_oom") or r.get("oom") is None:
        v["status"] = "error"
        return v
    if not r["oom"] and r.get("optimizer_steps") == 0:
        # every step skipped by the loss scaler: no optimizer state was ever held, so the run did
        # not reach the job's steady state and proves it trains nothing (a run out of memory without
        # the state would be so with it: that verdict stands)
        v.update(status="error", why="the optimizer never stepped (every step skipped by the loss scaler)")
        return v
    nv = r.get("nvml_peak")
    whole = (nv + int(spec.get("outside_nccl", 0))) if nv else None
    v["whole_process_bytes"] = whole
    v["over_share"] = bool(whole is not None and whole > spec["slice_bytes"])
    # beyond what the GPU itself has for each of its ranks (the reserve too): it could not have run
    per_rank = int(spec.get("gpu_total_bytes", 0)) // max(1, int(spec.get("shared_by", 1)))
    v["over_gpu"] = bool(whole is not None and per_rank and whole > per_rank)
    v["trained"] = (not r["oom"]) and not v["over_share"]
    v["status"] = "trained" if v["trained"] else ("oom" if r["oom"] else "over_share")
    if r.get("peak_allocated") and not r["oom"]:
        v["peak_over_limit"] = round(r["peak_allocated"] / spec["limit_bytes"], 4)
        v["estimate_error"] = round(spec["estimated_peak"] / r["peak_allocated"] - 1, 4)
        share = spec["share_bytes"]
        v["unused_of_share"] = round((share - r["peak_allocated"]) / share, 4)
        v["limit_slack_of_share"] = round((spec["planned_bytes"] - r["peak_allocated"]) / share, 4)
    if r.get("outside_measured") is not None:
        v["outside_over_model"] = int(r["outside_measured"]) - int(spec["outside_modelled_process"])
    return v


def _pct(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summarize(records: List[Dict[str, Any]], seconds: float = 0.0, budget_s: Optional[float] = None,
              env: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The summary over the cases' records."""
    runs = [(rec, run) for rec in records for run in rec.get("runs", [])]

    def role(name: str) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
        return [(rec, run) for rec, run in runs if run["spec"]["role"] == name]

    chosen = [x for x in role("chosen") if x[1]["verdict"]["status"] != "error"]
    failed = [x for x in chosen if not x[1]["verdict"]["trained"]]
    rejected = [x for x in role("best_rejected") + role("mb_up") if x[1]["verdict"]["status"] != "error"]
    wrongly = [x for x in rejected if x[1]["verdict"]["trained"]]
    errors = [(rec, run) for rec, run in runs if run["verdict"]["status"] == "error"]
    unused = [run["verdict"]["unused_of_share"] for _, run in chosen if "unused_of_share" in run["verdict"]]
    slack = [run["verdict"]["limit_slack_of_share"] for _, run in chosen if "limit_slack_of_share" in run["verdict"]]
    ratio = [run["verdict"]["peak_over_limit"] for _, run in chosen if "peak_over_limit" in run["verdict"]]
    est = [run["verdict"]["estimate_error"] for _, run in chosen if "estimate_error" in run["verdict"]]
    fit_s = [rec["answer"]["fit_seconds"] for rec in records if "fit_seconds" in rec.get("answer", {})]
    solver_s = [rec["answer"]["solver_seconds"] for rec in records if "solver_seconds" in rec.get("answer", {})]
    outside = [(run["spec"], run["result"]) for _, run in runs if run["result"].get("outside_measured") is not None]
    over_model = [r["outside_measured"] - s["outside_modelled_process"] for s, r in outside]
    xs = [rec for rec in records if rec.get("answer", {}).get("expandable_segments")]
    probe = [run for _, run in role("default_allocator") if run["verdict"]["status"] != "error"]
    without = [run for _, run in role("without_expandable") if run["verdict"]["status"] != "error"]
    best_rej = [x for x in role("best_rejected") if x[1]["verdict"]["status"] != "error"]

    def by(items: Iterable[Tuple[Dict[str, Any], Any]], key: Callable[[Dict[str, Any]], str]) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for rec, _ in items:
            out[key(rec)] = out.get(key(rec), 0) + 1
        return dict(sorted(out.items()))

    def row(rec: Dict[str, Any], run: Dict[str, Any]) -> str:
        s, r, v = run["spec"], run["result"], run["verdict"]
        what = ("out of memory" if r.get("oom") else f"NVML {v.get('whole_process_bytes', 0) / GiB:.2f} GiB over the "
                f"part {s['slice_bytes'] / GiB:.2f} GiB" if v.get("over_share") else "trained")
        return (f"{rec['case']}: {s['role']} {s.get('describe', '')} limit {s['limit_bytes'] / GiB:.2f} GiB: {what}"
                + (f" ({(r.get('error') or '')[:120]})" if r.get("oom") else ""))

    n_chosen, n_rej = len(chosen), len(rejected)
    layouts = [rec["answer"]["chosen"]["layout"] for rec in records if "chosen" in rec.get("answer", {})]
    summary: Dict[str, Any] = {
        "bench": "fit_scale", **(env or {}),
        "cases": len(records), "families": by(((rec, None) for rec in records), lambda rec: rec["answer"]["family"]),
        "cases_by_tag": by(((rec, None) for rec in records), lambda rec: str(rec.get("tag") or UNTAGGED)),
        "cases_where_nothing_fits": sum(1 for rec in records if "chosen" not in rec.get("answer", {})
                                        and "error" not in rec.get("answer", {})),
        "cases_fit_refused": sum(1 for rec in records if "error" in rec.get("answer", {})),
        "chosen_layouts": {"pipeline": sum(1 for l in layouts if l["pipeline"] > 1),
                           "sharded": dict(sorted({s: sum(1 for l in layouts if l["shard"] == s)
                                                   for s in {l["shard"] for l in layouts}}.items())),
                           "accumulation": sum(1 for l in layouts if l["pipeline"] == 1 and l["accumulation"] > 1),
                           "recompute": sum(1 for l in layouts if l["recompute"]),
                           "two_ranks_per_gpu": sum(1 for l in layouts if l["ranks_per_gpu"] > 1),
                           "precision": dict(sorted({p: sum(1 for l in layouts if l["precision"] == p)
                                                     for p in {l["precision"] for l in layouts}}.items()))},
        "chosen_runs": n_chosen,
        "chosen_out_of_memory": sum(1 for _, run in failed if run["result"].get("oom")),
        "chosen_over_share_nvml": sum(1 for _, run in failed if run["verdict"].get("over_share")),
        "chosen_over_gpu_nvml": sum(1 for _, run in failed if run["verdict"].get("over_gpu")),
        "chosen_failed": len(failed),
        "runs_without_nvml": sum(1 for _, run in runs if run["verdict"]["status"] != "error"
                                 and not run["result"].get("nvml_peak")),
        "chosen_failures": [row(rec, run) for rec, run in failed][:40],
        "rejected_runs": n_rej,
        "rejected_would_have_trained": len(wrongly),
        "rejected_would_have_trained_rate": round(len(wrongly) / n_rej, 4) if n_rej else None,
        "rejected_would_have_trained_cases": [row(rec, run) for rec, run in wrongly][:40],
        "unused_of_share_median": _pct(unused, 0.5),
        "limit_slack_of_share_median": _pct(slack, 0.5),
        "peak_over_limit": {"min": _pct(ratio, 0.0), "median": _pct(ratio, 0.5), "max": _pct(ratio, 1.0)},
        "estimate_error": {"median_abs": _pct([abs(e) for e in est], 0.5), "worst_under": _pct(est, 0.0),
                           "worst_over": _pct(est, 1.0)},
        "fit_seconds": {"median": _pct(fit_s, 0.5), "p90": _pct(fit_s, 0.9), "max": _pct(fit_s, 1.0),
                        "mean": round(statistics.mean(fit_s), 3) if fit_s else None,
                        "search_median": _pct(solver_s, 0.5),
                        "what": "distmem.fit(model, ...) per case, the estimate on the meta device included; "
                                "search: FitResult.seconds"},
        "outside_allocator": {
            "runs": len(outside),
            "measured_median_mib": _mib(_pct([r["outside_measured"] for _, r in outside], 0.5)),
            "measured_max_mib": _mib(_pct([r["outside_measured"] for _, r in outside], 1.0)),
            "modelled_mib": sorted({_mib(s["outside_modelled_process"]) for s, _ in outside}),
            "measured_minus_modelled_max_mib": _mib(_pct(over_model, 1.0)),
            "measured_minus_modelled_median_mib": _mib(_pct(over_model, 0.5)),
            "runs_above_model": sum(1 for x in over_model if x > 0),
            "by_group_max_mib": _outside_groups(outside)},
        "expandable_segments": {
            "cases_advised": len(xs),
            "default_allocator_runs": len(probe),
            "default_allocator_out_of_memory": sum(1 for r in probe if r["result"].get("oom")),
            "without_expandable_runs": len(without),
            "without_expandable_failed": sum(1 for r in without if not r["verdict"]["trained"])},
        "by_family": {fam: {"chosen_runs": sum(1 for rec, _ in chosen if rec["answer"]["family"] == fam),
                            "chosen_failed": sum(1 for rec, _ in failed if rec["answer"]["family"] == fam),
                            "rejected_runs": sum(1 for rec, _ in rejected if rec["answer"]["family"] == fam),
                            "rejected_would_have_trained": sum(1 for rec, _ in wrongly
                                                               if rec["answer"]["family"] == fam)}
                      for fam in sorted({rec["answer"].get("family", "?") for rec in records})},
        "errors": len(errors),
        "error_runs": [f"{rec['case']}: {run['spec']['role']}: {(run['result'].get('error') or '')[:160]}"
                       for rec, run in errors][:20],
        "baseline": "the best rejected layout's binding rank under its GPU's share: what a search without the "
                    "memory check runs when that layout ranks first",
        "ours_failure_rate": round(len(failed) / n_chosen, 4) if n_chosen else None,
        "baseline_failure_rate": round(sum(1 for _, run in best_rej if not run["verdict"]["trained"])
                                       / len(best_rej), 4) if best_rej else None,
        "targets": {"chosen_failed": 0, "rejected_would_have_trained_rate": 0.05, "limit_slack_of_share_median": 0.10},
        "seconds": round(seconds, 1), "budget_s": budget_s,
        "split": split(records),
    }
    return summary


#: The bare process outside the allocator the rules below are read against: CUDA context, cuBLAS and
#: cuDNN after one matmul and one convolution (bench/results/outside_allocator_h200.json, 694 MiB)
OUTSIDE_BARE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results",
                                 "outside_allocator_h200.json")


def half_of(model: str) -> str:
    """Which half a model's cases fall in: ``fit`` (the rules are read from it) or ``held_out`` (they
    are checked on it). By model, so that no model is in both; fixed by the name (CRC-32), not by the
    results."""
    import zlib

    return "fit" if zlib.crc32(model.encode()) % 2 == 0 else "held_out"


def _bare_outside() -> Optional[int]:
    try:
        with open(OUTSIDE_BARE_FILE) as f:
            return int(json.load(f)["summary"]["without_nccl_bytes"])
    except (OSError, ValueError, KeyError):
        return None


def split(records: List[Dict[str, Any]], bare: Optional[int] = None) -> Dict[str, Any]:
    """The two rules the first H200 run changed, read from the ``fit`` half of the models and checked
    on the ``held_out`` half (:func:`half_of`):

    * the allocator: chosen layouts under a hard limit run with torch's default allocator and with
      expandable segments, how many of each ran out of memory (and the ``default_allocator`` probes:
      a layout planned for expandable segments run without them);
    * the memory outside the allocator after training steps: the fit half's largest (NVML's figure for
      the process minus torch's reserved bytes, runs that trained) over the bare process gives the
      step kernels (and FSDP2's beyond them); the held-out half's runs above bare + those."""
    bare = _bare_outside() if bare is None else bare
    halves: Dict[str, Dict[str, Any]] = {}
    for name in ("fit", "held_out"):
        recs = [r for r in records if half_of(str(r.get("answer", {}).get("params", {}).get("model", r["case"])))
                == name]
        runs = [run for r in recs for run in r.get("runs", []) if run["verdict"]["status"] != "error"]
        chosen = [run for run in runs if run["spec"]["role"] == "chosen"]
        probes = [run for run in runs if run["spec"]["role"] == "default_allocator"]
        trained = [run for run in runs if run["verdict"].get("trained")
                   and run["result"].get("outside_measured") is not None]
        fsdp2 = [int(run["result"]["outside_measured"]) for run in trained
                 if str(run["spec"].get("shard") or "").startswith("fsdp2")]
        plain = [int(run["result"]["outside_measured"]) for run in trained
                 if not str(run["spec"].get("shard") or "").startswith("fsdp2")]

        def count(rs: List[Dict[str, Any]]) -> Dict[str, int]:
            return {"runs": len(rs), "out_of_memory": sum(1 for run in rs if run["result"].get("oom"))}

        halves[name] = {
            "models": len({str(r.get("answer", {}).get("params", {}).get("model")) for r in recs}),
            "cases": len(recs),
            "chosen_default_allocator": count([run for run in chosen if not run["spec"].get("expandable")]),
            "chosen_expandable_segments": count([run for run in chosen if run["spec"].get("expandable")]),
            "default_allocator_probes": count(probes),
            "outside_trained_runs": len(plain) + len(fsdp2),
            "outside_max_mib": _mib(max(plain)) if plain else None,
            "outside_fsdp2_max_mib": _mib(max(fsdp2)) if fsdp2 else None,
            "_plain": plain, "_fsdp2": fsdp2}
    fit, held = halves["fit"], halves["held_out"]
    out: Dict[str, Any] = {"how": "by model, CRC-32 of its name: even = fit, odd = held_out",
                           "bare_outside_mib": _mib(bare)}
    if bare is not None and fit["_plain"]:
        step = max(fit["_plain"]) - bare
        extra = max(0, max(fit["_fsdp2"]) - max(fit["_plain"])) if fit["_fsdp2"] else 0
        above = [v - (bare + step) for v in held["_plain"] if v > bare + step] + \
                [v - (bare + step + extra) for v in held["_fsdp2"] if v > bare + step + extra]
        out["from_fit_half"] = {"step_kernels_mib": _mib(step), "fsdp2_kernels_mib": _mib(extra)}
        out["held_out_above_rule"] = {"runs": len(above), "of": len(held["_plain"]) + len(held["_fsdp2"]),
                                      "max_mib": _mib(max(above)) if above else 0.0}
    for h in halves.values():
        h.pop("_plain")
        h.pop("_fsdp2")
    out.update(halves)
    return out


def _mib(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v / MiB, 1)


def _outside_groups(outside: List[Tuple[Dict[str, Any], Dict[str, Any]]]) -> Dict[str, float]:
    """The largest measured memory outside the allocator per kind of model x precision."""
    out: Dict[str, int] = {}
    for s, r in outside:
        m = MODELS.get(s["model"])
        g = f"{m.kind if m else '?'}/{'+'.join(m.tags) if m else ''}/{s['precision']}"
        out[g] = max(out.get(g, 0), int(r["outside_measured"]))
    return {k: _mib(v) for k, v in sorted(out.items())}


def line(summary: Dict[str, Any]) -> Dict[str, Any]:
    """The bench's one JSON line: the figure (chosen layouts that failed, of those run), the baseline
    measured in the same run (the best rejected layouts that failed) and their ratio."""
    ours, base = summary.get("ours_failure_rate"), summary.get("baseline_failure_rate")
    keys = ("cases", "chosen_runs", "chosen_failed", "chosen_out_of_memory", "chosen_over_share_nvml", "rejected_runs",
            "rejected_would_have_trained_rate", "unused_of_share_median", "limit_slack_of_share_median", "fit_seconds",
            "errors", "seconds")
    return {"bench": "fit_scale", "figure": ours, "peer": base,
            "ratio": round(ours / base, 4) if ours is not None and base else None,
            **{k: summary.get(k) for k in keys}}


# ====================================================================== scheduling runs on the one GPU

@dataclass
class Job:
    """A run waiting for (or holding) its part of the GPU. ``need``: bytes it may hold at once."""

    order: Tuple[int, int]
    spec: Dict[str, Any]
    need: int
    queued_at: float = 0.0


def job_need(spec: Dict[str, Any], outside: int = 1536 * MiB) -> int:
    """What a run may hold on the GPU: its cap and its context; an FSDP2 run builds the whole model
    first (float32, uncapped), a pipeline stage runs the blocks before it once."""
    build = int(spec.get("params_m", 0) * 1e6 * 4) if str(spec.get("shard", "")).startswith("fsdp2") else 0
    return max(int(spec["limit_bytes"]), build) + outside


def pick(pending: List[Job], used: int, capacity: int, running: int, workers: int, now: float,
         patience_s: float = 15.0, window: int = 16) -> Optional[Job]:
    """The next job to start: the first waiting one that fits what is left of the GPU (among the
    first ``window``), unless the head has waited ``patience_s`` - then only the head, so a large
    run is not starved by smaller ones."""
    if running >= workers or not pending:
        return None
    head = pending[0]
    if head.need > capacity:  # larger than what the GPU has for runs: alone, booked as whatever happens
        return head if used == 0 else None
    if used + head.need <= capacity:
        return head
    if now - head.queued_at >= patience_s:
        return None
    for job in pending[1:window]:
        if used + job.need <= capacity:
            return job
    return None


# ====================================================================== the coordinator

def _preload() -> List[str]:
    return ["torch", "torch.nn", "torch.distributed", "torchvision", "timm", "transformers",
            "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
            "transformers.models.qwen2.modeling_qwen2", "transformers.models.mistral.modeling_mistral",
            "transformers.models.gemma.modeling_gemma", "transformers.models.bert.modeling_bert",
            "transformers.models.t5.modeling_t5", "pynvml", "distmem", "distmem.estimate"]


def _asker_init() -> None:
    # fit is asked before launch: no GPU in the asking process (and no CUDA context on the GPU)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        import torch

        torch.set_num_threads(1)  # the meta-device simulation is Python; the cores are the runs'
    except ImportError:
        pass


def _ask_one(case_dict: Dict[str, Any], estimate: str) -> Dict[str, Any]:
    try:
        return ask(case_dict, estimate)
    except BaseException as exc:  # noqa: BLE001 - booked with the case
        return {"case": Case(**case_dict).id, "params": case_dict, "family": MODELS[case_dict["model"]].family,
                "error": f"bench: {type(exc).__name__}: {str(exc)[:600]}"}


def read_records(path: Optional[str]) -> List[Dict[str, Any]]:
    if not path or not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for text in f:
            text = text.strip()
            if text.startswith("{"):
                out.append(json.loads(text))
    return out


def _env() -> Dict[str, Any]:
    info: Dict[str, Any] = {}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        info.update(device=name.decode() if isinstance(name, bytes) else name,
                    driver=pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001
        pass
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda)
    except Exception:  # noqa: BLE001
        pass
    return info


def _gpu_free() -> Tuple[int, int]:
    import pynvml

    pynvml.nvmlInit()
    mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    return int(mem.free), int(mem.total)


def coordinate(args: argparse.Namespace) -> Dict[str, Any]:
    """``run``: ask fit about every case (askers), run what it answers (GPU runs), book each case."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    deadline = T0 + args.budget_s
    done_before = read_records(args.skip_done)
    done_ids = {r["case"] for r in done_before}
    cases = [c for c in selected(args) if c.id not in done_ids]
    probes = args.allocator_probes != "none"
    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, f"{args.name}.jsonl")
    with open(jsonl, "w") as f:  # the earlier cases first, so this file is complete on its own
        for rec in done_before:
            f.write(json.dumps(rec) + "\n")
    log(f"{len(cases)} cases to run ({len(done_before)} done before), budget {args.budget_s:.0f} s")
    if args.cpu:  # the coordinator's plumbing on CPU: short runs, nothing measured
        os.environ[SMOKE_SEQ_ENV] = "16"
        free, total = 64 * GiB, 64 * GiB
    else:
        free, total = _gpu_free()
    capacity = free - int(args.margin_gib * GiB)
    log(f"GPU: {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB; runs may hold {capacity / GiB:.1f} GiB at once")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preload())
    askers = ProcessPoolExecutor(max_workers=args.askers, mp_context=ctx, initializer=_asker_init)
    futures = [(i, c, askers.submit(_ask_one, asdict(c), args.estimate)) for i, c in enumerate(cases)]
    tmp = tempfile.mkdtemp(prefix="fit-scale-")
    pending: List[Job] = []
    running: Dict[int, Tuple[Job, Any, str, float]] = {}
    open_cases: Dict[int, Dict[str, Any]] = {}
    answered = set()
    written = 0
    seq = 0
    while True:
        now = time.time()
        for i, c, fut in futures:
            if i in answered or not fut.done():
                continue
            answered.add(i)
            try:
                answer = fut.result()
            except BaseException as exc:  # noqa: BLE001 - a dead asker
                answer = {"case": c.id, "params": asdict(c), "family": MODELS[c.model].family,
                          "error": f"bench: {type(exc).__name__}: {exc}"}
            specs = run_specs(answer, probes) if "error" not in answer else []
            if args.cpu:
                specs = [dict(sp, device="cpu", micro_batch=1, accumulation=min(2, sp["accumulation"]), steps=1)
                         for sp in specs]
            open_cases[i] = {"case": c.id, "order": i, "tag": args.tag, "headroom": args.headroom, "answer": answer,
                             "runs": [], "left": len(specs)}
            for k, s in enumerate(specs):
                pending.append(Job((i, k), s, job_need(s), now))
            pending.sort(key=lambda j: j.order)
        # book finished runs
        for pid, (job, proc, path, started) in list(running.items()):
            alive = proc.is_alive()
            if alive and now - started < args.run_timeout_s:
                continue
            if alive:
                proc.kill()
                proc.join(5)
                result = {"oom": None, "error": f"ran past {args.run_timeout_s:.0f} s"}
            else:
                proc.join(1)
                if os.path.exists(path):
                    with open(path) as f:
                        result = json.load(f)
                else:
                    result = {"oom": None, "error": f"process exited {proc.exitcode} without a result"}
            del running[pid]
            rec = open_cases[job.order[0]]
            rec["runs"].append({"spec": job.spec, "result": result, "verdict": judge(job.spec, result)})
            rec["left"] -= 1
            v = rec["runs"][-1]["verdict"]
            log(f"{rec['case']}: {job.spec['role']} -> {v['status']} (peak "
                f"{(result.get('peak_allocated') or 0) / GiB:.2f} GiB, limit {job.spec['limit_bytes'] / GiB:.2f} GiB, "
                f"NVML {(result.get('nvml_peak') or 0) / GiB:.2f} GiB)")
        for i in sorted(open_cases):
            rec = open_cases[i]
            if rec["left"] == 0:
                rec.pop("left")
                rec["runs"].sort(key=lambda r: ROLES.index(r["spec"]["role"]))
                with open(jsonl, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                written += 1
                del open_cases[i]
        # start runs
        if now < deadline - args.tail_s:
            while True:
                used = sum(j.need for j, _, _, _ in running.values())
                job = pick(pending, used, capacity, len(running), args.workers, now)
                if job is None:
                    break
                pending.remove(job)
                seq += 1
                path = os.path.join(tmp, f"run{seq}.json")
                if job.spec.get("expandable"):
                    proc: Any = _Fresh(job.spec, path)
                else:  # forked from a server that imported torch (never CUDA): a fresh process, quick
                    proc = ctx.Process(target=_child, args=(job.spec, path), daemon=True)
                    proc.start()
                running[proc.pid] = (job, proc, path, time.time())
        all_answered = len(answered) == len(futures)
        if all_answered and not pending and not running and not open_cases:
            break
        if now >= deadline - 5 or (now >= deadline - args.tail_s and not running):
            break
        time.sleep(0.05)
    # the budget is spent: what is still running or waiting is left to a later run (--skip-done)
    for job, proc, _, _ in running.values():
        proc.kill()
    asking = list((getattr(askers, "_processes", None) or {}).values())  # the pool forgets them on shutdown
    askers.shutdown(wait=False, cancel_futures=True)
    for proc in asking:
        if proc.is_alive():
            proc.kill()
    log(f"{written} cases booked in this run; {len(cases) - written} left for a later run (--skip-done)")
    records = read_records(jsonl)
    summary = summarize(records, time.time() - T0, args.budget_s, _env())
    summary.update(cases_this_run=written, cases_left=len(cases) - written, estimate=args.estimate,
                   workers=args.workers, askers=args.askers)
    with open(os.path.join(args.out, f"{args.name}_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(line(summary)), flush=True)
    return summary


def selected(args: argparse.Namespace) -> List[Case]:
    """The cases in running order, those matching ``--only``, the first ``--max-cases``; with
    ``--redo FILE``: FILE's cases that count against the targets (:func:`to_redo`), then the first
    ``--new`` cases FILE does not hold."""
    cases = [c for c in order_cases(all_cases(getattr(args, "set", "scale")))
             if (not args.only or re.search(args.only, c.id))
             and getattr(args, "half", "all") in ("all", half_of(c.model))]
    if getattr(args, "redo", None):
        earlier = read_records(args.redo)
        again, held = to_redo(earlier), {r["case"] for r in earlier}
        by_id = {c.id: c for c in cases}
        return [by_id[i] for i in again if i in by_id] + [c for c in cases if c.id not in held][:args.new]
    return cases[:args.max_cases or None]


def to_redo(records: List[Dict[str, Any]]) -> List[str]:
    """The cases whose runs count against the targets or say nothing, in that order: a chosen layout
    that did not train (or whose run errored), a rejected one that trained, another run that
    errored, an answer the bench could not get; earlier records first within each."""
    ranked = []
    for k, rec in enumerate(records):
        ans = rec.get("answer", {})
        rank = 3 if str(ans.get("error", "")).startswith("bench:") else None
        for run in rec.get("runs", []):
            role, v = run["spec"]["role"], run["verdict"]
            if role == "chosen" and not v.get("trained"):
                r = 0
            elif role in ("best_rejected", "mb_up") and v.get("status") != "error" and v.get("trained"):
                r = 1
            elif v.get("status") == "error":
                r = 2
            else:
                continue
            rank = r if rank is None else min(rank, r)
        if rank is not None:
            ranked.append((rank, k, rec["case"]))
    return [case for _, _, case in sorted(ranked)]


def merge(paths: Sequence[str]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Every case's latest record over ``paths`` (a later file's record of a case replaces an
    earlier one, in the earlier one's place), and per file what it gave (cases, tag, seconds)."""
    merged: Dict[str, Dict[str, Any]] = {}
    runs = []
    for path in paths:
        recs = read_records(path)
        for rec in recs:
            merged[rec["case"]] = rec
        side = _summary_of(path)
        runs.append({"file": os.path.basename(path), "cases": len(recs),
                     "tags": sorted({str(r.get("tag") or UNTAGGED) for r in recs}),
                     "seconds": side.get("seconds"), "torch": side.get("torch"), "device": side.get("device")})
    return list(merged.values()), runs


#: the tag of a record written before records carried one: the first H200 run (main e9b4784)
UNTAGGED = "h200-1@e9b4784"


def _summary_of(jsonl: str) -> Dict[str, Any]:
    """The summary written beside a results file (``X.jsonl`` -> ``X_summary.json``), or {}."""
    path = re.sub(r"\.jsonl$", "", jsonl) + "_summary.json"
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def dry(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """``dry``: fit's answers only (no GPU), in order, with what would run."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    cases = selected(args)
    log(f"{len(cases)} cases of {len(all_cases(args.set))}")
    answers = []
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchvision", "distmem"])
    with ProcessPoolExecutor(max_workers=args.askers, mp_context=ctx, initializer=_asker_init) as pool:
        for c, a in zip(cases, pool.map(_ask_one, [asdict(c) for c in cases], [args.estimate] * len(cases))):
            runs = [s["role"] for s in run_specs(a, args.allocator_probes != "none")] if "error" not in a else []
            ch = a.get("chosen", {}).get("describe")
            log(f"{c.id}: {a.get('fit_seconds')} s; chosen {ch}; xs={a.get('expandable_segments')}; runs {runs}"
                + (f"; ERROR {a['error'][:300]}" if "error" in a else ""))
            answers.append(a)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.name}_dry.jsonl"), "w") as f:
            for a in answers:
                f.write(json.dumps(a) + "\n")
    recs = [{"case": a["case"], "answer": a, "runs": []} for a in answers]
    s = summarize(recs)
    print(json.dumps({k: s[k] for k in ("cases", "families", "cases_where_nothing_fits", "cases_fit_refused",
                                        "chosen_layouts", "fit_seconds")}))
    return answers


def smoke(args: argparse.Namespace) -> int:
    """``smoke``: the runs' plumbing on CPU (models, wrappers through the fake process group, pipeline
    stages, accumulation, the loss) at micro-batch 1 for one step, nothing measured."""
    answers = read_records(args.answers) if args.answers else dry(args)
    os.environ[SMOKE_SEQ_ENV] = "32"
    bad = 0
    for a in answers:
        for s in run_specs(a) if "error" not in a else []:
            if s["params_m"] > args.smoke_max_params_m:
                continue
            s = dict(s, micro_batch=1, accumulation=min(2, s["accumulation"]), steps=1)
            r = gpu_run(s, device="cpu")
            ok = r.get("oom") is False
            bad += not ok
            log(f"smoke {a['case']}: {s['role']} ({s['shard'] or 'replicated'}, pp{s['pipeline']}): "
                f"{'ok' if ok else r.get('error')} in {r.get('seconds')} s")
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["run", "dry", "smoke", "summarize", "cases", "child"])
    ap.add_argument("files", nargs="*", help="summarize: the .jsonl files")
    ap.add_argument("--budget-s", type=float, default=None, help="run: device seconds for the whole run (required)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default $OUT)")
    ap.add_argument("--name", default=NAME, help=f"results' file name stem (default {NAME})")
    ap.add_argument("--skip-done", default=None, metavar="FILE", help="a .jsonl of an earlier run: its cases are kept, "
                                                                      "not run again")
    ap.add_argument("--redo", default=None, metavar="FILE", help="run FILE's cases that count against the targets "
                    "(a chosen layout that failed, a rejected one that trained, an error) again, then --new others; "
                    "this run's file holds only them (merge with summarize --merge-to)")
    ap.add_argument("--new", type=int, default=0, help="with --redo: also the first N cases FILE does not hold")
    ap.add_argument("--tag", default=None, help="written into every record of this run (which tree asked fit)")
    ap.add_argument("--allocator-probes", default="all", choices=["all", "none"], help="the default_allocator and "
                    "without_expandable runs where fit asks for expandable segments (default all)")
    ap.add_argument("--merge-to", default=None, metavar="FILE", help="summarize: write every case's latest record "
                    "over the files given (later files win) to FILE")
    ap.add_argument("--summary-out", default=None, metavar="FILE", help="summarize: write the summary to FILE")
    ap.add_argument("--set", default="scale", choices=SETS, help="the cases: scale (default, 200+), pairs (the "
                    "(model, fleet) pairs of bench/plan/fit.py, results fit_h200.json) or unseen (models the scale set "
                    "does not hold, none read by a rule)")
    ap.add_argument("--max-cases", type=int, default=0, help="only the first N cases in running order")
    ap.add_argument("--half", default="all", choices=["all", "fit", "held_out"], help="only the cases of one half "
                    "(half_of: by model): a rule fitted on one half is run on the other")
    ap.add_argument("--headroom", type=float, default=None, help="run: ask fit(..., headroom=H) instead of the "
                    "default in force (a rule on trial; recorded in every record)")
    ap.add_argument("--only", default=None, metavar="REGEX", help="only the cases whose id matches")
    ap.add_argument("--workers", type=int, default=9, help="runs at once on the GPU (default 9)")
    ap.add_argument("--askers", type=int, default=6, help="processes asking fit at once (default 6)")
    ap.add_argument("--estimate", default="model", choices=["model", "auto"], help="fit's estimate= (default model: "
                    "the meta-device simulation, as before launch)")
    ap.add_argument("--margin-gib", type=float, default=6.0, help="GPU memory left free by the packing (default 6)")
    ap.add_argument("--run-timeout-s", type=float, default=150.0, help="a run killed after this long")
    ap.add_argument("--tail-s", type=float, default=40.0, help="no run starts this close to the budget's end")
    ap.add_argument("--answers", default=None, help="smoke: answers from an earlier dry run (its _dry.jsonl)")
    ap.add_argument("--cpu", action="store_true", help="run: the coordinator's plumbing on CPU (runs at micro-batch 1, "
                                                       "one step, short sequences; nothing measured)")
    ap.add_argument("--smoke-max-params-m", type=float, default=150.0, help="smoke: skip larger models on CPU")
    a = ap.parse_args(argv)
    if a.mode == "child":  # one run: SPEC_FILE RESULT_FILE
        with open(a.files[0]) as f:
            _child(json.load(f), a.files[1])
        return 0
    if a.mode == "cases":
        for c in order_cases(all_cases(a.set)):
            print(c.id)
        return 0
    if a.mode == "summarize":
        recs, runs = merge(a.files)
        env = {}
        for p in a.files:  # the environment of the last run that says it
            side = _summary_of(p)
            env.update({k: side[k] for k in ("device", "driver", "torch", "cuda") if k in side})
        devices = sorted({r["device"] for r in runs if r.get("device")})
        if len(devices) > 1:  # the cards differ between files: say so, with which file ran where (runs)
            env["device"] = " and ".join(devices)
        s = summarize(recs, env=env)
        ids = {c.id for c in all_cases(a.set)}
        s.update(seconds=None, budget_s=None, runs=runs, cases_left=len(ids - {r["case"] for r in recs}))
        if a.merge_to:
            with open(a.merge_to + ".tmp", "w") as f:
                for rec in recs:
                    f.write(json.dumps(rec) + "\n")
            os.replace(a.merge_to + ".tmp", a.merge_to)
        if a.summary_out:
            with open(a.summary_out, "w") as f:
                json.dump(s, f, indent=1)
        print(json.dumps(s, indent=1))
        print(json.dumps(line(s)))
        return 0
    if a.mode == "dry":
        dry(a)
        return 0
    if a.mode == "smoke":
        return smoke(a)
    if a.budget_s is None:
        ap.error("run needs --budget-s SECONDS (the device time this run may take)")
    if not a.out:
        ap.error("run needs --out FOLDER (or $OUT)")
    if a.headroom is not None:
        os.environ[HEADROOM_ENV] = repr(float(a.headroom))
    if a.redo and a.skip_done:
        ap.error("--redo and --skip-done: give one (--redo writes this run's cases alone; --skip-done copies the "
                 "earlier file's cases first)")
    coordinate(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
