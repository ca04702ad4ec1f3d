"""Frozen backbones under autocast: the forward peak the GPU holds against ``distmem.estimate``'s.

A model fine-tuning its head alone (every parameter frozen but its last ``nn.Linear``'s) keeps no
activations for a backward through the backbone: its step's peak is in the forward, where cuDNN's
half-precision convolutions hold NHWC copies of their input and output beside the output
(``distmem.estimate``'s rule for them was read from ResNet-50: every convolution's hidden bytes,
bench/results/estimate_half_forward_probe_h200.json; the other torchvision models here are held
out). Each case, on the GPU: three warm-up steps (Adam on the head), then the worst step's
``max_memory_allocated``; ``distmem.estimate(model, batch, "adam", precision=..., device="cuda",
method="model")`` on the meta device; and the peer, PyTorch's own MemTracker under FakeTensorMode
(two steps, the second's peak, as ``estimate_zoo_torch.py`` runs it).

    PYTHONPATH=. python3 bench/estimate/estimate_half_forward.py --out bench/results/estimate_half_forward_h100.json

One JSON line: the held-out mean absolute error of the door (figure), of the naive sum of sizes
(baseline) and of the peer (None where it could not run: MemTracker hooks every parameter's
gradient, and a frozen one takes no hook).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.estimate.estimate_measure import torch_train_peaks  # noqa: E402  one step's peak, as every torch bench reads it

FITTED = ("resnet50",)
HELD_OUT = ("resnet18", "resnet101", "resnext50_32x4d", "wide_resnet50_2", "densenet121", "vgg16_bn",
            "efficientnet_b0", "mobilenet_v3_large", "regnet_y_1_6gf", "convnext_tiny", "googlenet")
BATCHES = {"resnet50": (64, 128)}
PRECISIONS = ("mixed_bfloat16", "mixed_float16")
MiB = 2 ** 20


def frozen(name: str, device: str):
    """torchvision's ``name`` with every parameter frozen but its last ``nn.Linear``'s."""
    import torch
    import torchvision

    kw = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    try:
        with torch.device(device):
            model = getattr(torchvision.models, name)(weights=None, **kw)
    except NotImplementedError:  # a constructor that reads a tensor's values (RegNet's widths): built on the CPU
        model = getattr(torchvision.models, name)(weights=None, **kw).to(device)
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in head.parameters():
        p.requires_grad_(True)
    return model


def true_peak(name: str, batch: int, precision: str) -> int:
    import torch
    import torch.nn.functional as F

    model = frozen(name, "cuda").train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    dtype = torch.bfloat16 if precision == "mixed_bfloat16" else torch.float16
    scaler = torch.amp.GradScaler("cuda") if precision == "mixed_float16" else None

    def step() -> None:
        with torch.autocast("cuda", dtype=dtype):
            loss = F.cross_entropy(model(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
    peaks = torch_train_peaks(step, 4)["peaks"]
    del model, opt, x, y
    torch.cuda.empty_cache()
    return max(peaks[1:])  # after the first step, which makes Adam's state


def modelled(name: str, batch: int, precision: str) -> Tuple[int, int]:
    """(distmem.estimate's peak, the naive baseline's): the baseline is what a sum of sizes gives,
    every weight, the head's gradients and Adam's two slots, and every leaf module's output at the
    batch (read from the door's own table, as ``estimate_zoo_torch.py``'s baseline)."""
    from distmem.estimate import estimate

    model = frozen(name, "meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate(model, batch, "adam", input_shape=(3, 224, 224), precision=precision,
                       device="cuda", method="model")
    outputs = sum(int(r.output_bytes_per_sample) for r in est.layers if not r.name.endswith(" (own ops)")) * batch
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    naive = sum(p.numel() for p in model.parameters()) * 4 + trainable * 4 * 3 + outputs
    return int(est.train_bytes(batch)), int(naive)


def memtracker(name: str, batch: int, precision: str) -> int:
    """The peer: PyTorch's MemTracker under FakeTensorMode, two steps, the second's peak."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if precision == "mixed_bfloat16" else torch.float16
    peaks = []
    with FakeTensorMode():
        model = frozen(name, "cuda").train()
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
        mt = MemTracker()
        mt.track_external(opt)  # the model too would hook every parameter: frozen ones take no hook
        with mt:
            for i in range(2):
                x = torch.randn(batch, 3, 224, 224, device="cuda")
                y = torch.randint(0, 1000, (batch,), device="cuda")
                with torch.autocast("cuda", dtype=dtype):
                    loss = F.cross_entropy(model(x).float(), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss
                peaks.append(int(mt.get_tracker_snapshot("peak")[dev]["Total"]))
                if i == 0:
                    mt.reset_mod_stats()
    return max(peaks)


def stats(errs: List[float]) -> Dict[str, Any]:
    return {"cases": len(errs), "mean_abs": round(sum(abs(e) for e in errs) / len(errs), 4) if errs else None,
            "worst": round(min(errs), 4) if errs else None, "max": round(max(errs), 4) if errs else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=64, help="the held-out models' batch")
    p.add_argument("--fitted-on", default=None, help="a JSON of the probe the rule was read from, kept in the output")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"bench": "estimate_half_forward", "error": "needs a CUDA GPU"}))
        return 2
    t0 = time.time()
    rows: List[Dict[str, Any]] = []
    for name in FITTED + HELD_OUT:
        for batch in BATCHES.get(name, (args.batch,)):
            for precision in PRECISIONS:
                row: Dict[str, Any] = {"model": name, "batch": batch, "precision": precision,
                                       "half": "fit" if name in FITTED else "held_out"}
                try:
                    truth = true_peak(name, batch, precision)
                    ours, naive = modelled(name, batch, precision)
                    row.update(true_mib=round(truth / MiB, 1), model_mib=round(ours / MiB, 1),
                               error=round(ours / truth - 1, 4), naive_mib=round(naive / MiB, 1),
                               naive_error=round(naive / truth - 1, 4))
                except Exception as exc:  # noqa: BLE001 - a case that cannot run is booked, not hidden
                    row["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                if "error" in row:
                    try:
                        peer = memtracker(name, batch, precision)
                        row.update(peer_mib=round(peer / MiB, 1), peer_error=round(peer / truth - 1, 4))
                    except Exception as exc:  # noqa: BLE001 - the peer's failure is booked beside ours
                        row["peer_failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                with open(args.out + ".partial", "w", encoding="utf-8") as f:
                    json.dump(rows, f)
    out: Dict[str, Any] = {"bench": "estimate_half_forward", "device": torch.cuda.get_device_name(0),
                           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                           "seconds": round(time.time() - t0, 1), "rows": rows}
    for half in ("fit", "held_out"):
        ok = [r for r in rows if r["half"] == half and "error" in r]
        out[half] = {"distmem": stats([r["error"] for r in ok]), "naive": stats([r["naive_error"] for r in ok]),
                     "memtracker": stats([r["peer_error"] for r in ok if "peer_error" in r]),
                     "memtracker_failed": sum(1 for r in ok if "peer_failed" in r)}
    if args.fitted_on and os.path.exists(args.fitted_on):
        with open(args.fitted_on, encoding="utf-8") as f:
            out["fitted_on"] = json.load(f)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    os.remove(args.out + ".partial")
    held = out["held_out"]
    ours, naive = held["distmem"]["mean_abs"], held["naive"]["mean_abs"]
    line = {"bench": "estimate_half_forward", "figure": ours, "baseline": naive,
            "peer": held["memtracker"]["mean_abs"], "peer_failed": held["memtracker_failed"],
            "worst": held["distmem"]["worst"],
            "what": "held-out mean absolute error against the GPU's forward peak of frozen backbones: "
                    "distmem.estimate (method='model'), the naive sum of sizes, PyTorch's MemTracker",
            "ratio": round(ours / naive, 3) if ours and naive else None}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
