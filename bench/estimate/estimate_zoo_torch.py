"""The torch half of the estimator's zoo (``bench/estimate/estimate_zoo.py`` runs it): torchvision families,
Hugging Face models from configs, and the hand-written, checkpointed, LoRA, frozen and compiled
cases of ``estimate_zoo_written``; how each is built, measured on CUDA (``estimate_measure``),
estimated, and sized by the peer (PyTorch's MemTracker)."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List

from bench.estimate.estimate_zoo_written import COMPILED, TORCH_WRITTEN, torch_written

__all__ = ["TORCH_CASES", "HF_SEQ", "hf_config", "hf_build", "torch_build", "torch_optimizer", "amp_dtype",
           "cross_entropy", "torch_measure", "torch_memtracker", "torch_estimate"]


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
        from bench.estimate.estimate_accuracy import gpt_decoder
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


def amp_dtype(precision: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def _logits(out):
    if isinstance(out, dict):
        out = out.get("logits", next(iter(out.values())))
    if isinstance(out, (list, tuple)):
        out = out[0]
    return getattr(out, "logits", out)


def cross_entropy(out):
    """The loss the estimator assumes (``loss="auto"``): cross-entropy over the last dimension."""
    import torch
    t = _logits(out)
    logits = t.reshape(-1, t.shape[-1])
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=t.device)
    return torch.nn.functional.cross_entropy(logits.float() if t.dtype != torch.float32 else logits, target)


def torch_measure(c: Dict[str, Any], steps: int) -> Dict[str, Any]:
    import contextlib
    import torch
    from bench.estimate.estimate_measure import torch_train_peaks
    model, inputs = torch_build(c, "cuda")
    model.train()
    opt = torch_optimizer(c["optimizer"], model.parameters())
    amp = amp_dtype(c["precision"])
    scaler = torch.amp.GradScaler("cuda") if c["precision"] == "fp16" else None
    args, kwargs = inputs(c["batch"], "cuda")

    def step() -> None:
        ctx = torch.autocast("cuda", dtype=amp) if amp is not None else contextlib.nullcontext()
        with ctx:
            loss = cross_entropy(model(*args, **kwargs))
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
        amp = amp_dtype(c["precision"])
        mt = MemTracker()
        mt.track_external(model, opt)
        peaks = []
        with mt:
            for i in range(2):
                args, kwargs = inputs(c["batch"], where)
                ctx = torch.autocast(where, dtype=amp) if amp is not None else contextlib.nullcontext()
                with ctx:
                    loss = cross_entropy(model(*args, **kwargs))
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
