"""``distmem estimate``: per-layer training memory of a model, as a table or JSON.

    distmem estimate --model keras:MobileNetV2 --input-shape 96,96,3 --batch-size 64 --optimizer adam
    distmem estimate --model torchvision:resnet50 --batch-size 32 --mixed-precision --per-layer
    distmem estimate --model hf:gpt2 --input-shape 1024 --batch-size 8 --precision bf16
    distmem estimate --model mypkg.models:build --input-shape 128 --json
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import List, Optional, Sequence

from ..console import forget_caught_interrupt, from_interrupt, say_back
from ..errors import DistmemError
from ..units import format_bytes
from .loader import load_model, parse_shape
from .optimizers import OPTIMIZER_NAMES
from .table import Estimate

__all__ = ["add_arguments", "run", "main", "load_model", "render_table"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``distmem estimate``'s options to ``parser``."""
    parser.add_argument("--model", required=True,
                        help="keras:NAME (keras.applications), torchvision:NAME, hf:NAME (a transformers config: "
                             "local folder or config.json, local cache, or model type such as gpt2; random weights, "
                             "nothing downloaded), or module.path:factory (your function returning a Keras model "
                             "or a torch.nn.Module)")
    parser.add_argument("--input-shape", default=None,
                        help="one sample, no batch dimension: H,W,C for Keras (default 224,224,3), "
                             "C,H,W for torch (default 3,224,224), tokens for hf: (default 512)")
    parser.add_argument("--batch-size", type=int, default=32, help="training batch size (default 32)")
    parser.add_argument("--optimizer", default="adam",
                        help=f"optimizer whose state is counted: {', '.join(OPTIMIZER_NAMES)} (default adam)")
    prec = parser.add_mutually_exclusive_group()
    prec.add_argument("--mixed-precision", action="store_true",
                      help="fp16 compute with fp32 master weights and loss scaling (mixed_float16)")
    prec.add_argument("--precision", default=None,
                      help="float32 | mixed_float16 | mixed_bfloat16 (default: the model's own)")
    parser.add_argument("--device", default=None, choices=("gpu", "cuda", "cpu"),
                        help="whose allocator the peak models: gpu (default) or cpu (TensorFlow's CPU "
                             "allocator statistics, as the accuracy benchmark measures)")
    parser.add_argument("--method", default="auto", choices=("auto", "measure", "model"),
                        help="auto (default): run real training steps on the device the job will use (GPU, else "
                             "CPU for Keras; torch needs a GPU) - Keras at the batch itself where it fits the memory "
                             "at hand, torch at two small batches carried by the model - or the model alone where "
                             "nothing can run (said); measure: measure or fail; model: never run the model (Keras "
                             "analytic, torch simulated on the meta device)")
    parser.add_argument("--calibrate", action="store_true",
                        help="superseded by the measured path, kept as its alias: --method measure (the model's own "
                             "steps, its compiled loss or one that fits any output, custom layers included)")
    parser.add_argument("--per-layer", action="store_true", help="print one row per layer")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _row(cells: Sequence[str], widths: Sequence[int], right: Sequence[bool]) -> str:
    return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()


def render_table(est: Estimate, per_layer: bool = False) -> str:
    """The estimate as plain text: totals, then optionally one row per layer."""
    b = est.batch_size
    fw = "torch" if est.framework == "torch" else "tensorflow"
    lines = [f"{est.model}: {est.framework}, batch {b}, {est.precision}, optimizer {est.optimizer.get('name')} "
             f"({est.optimizer.get('slots_per_weight')} slot(s) per weight), method {est.method}, "
             f"peak modelled for {est.device}",
             ""]
    parts = est.breakdown()
    bound = est.bound()
    totals = [
        ("parameters", f"{est.params:,}"),
        ("weights", format_bytes(est.param_bytes)),
        ("gradients", format_bytes(est.grad_bytes)),
        ("optimizer state", format_bytes(est.optimizer_bytes)),
        (f"activations kept (batch {b})", format_bytes(est.activation_bytes())),
        ("training peak (allocator)", format_bytes(est.peak_bytes)),
        (f"  {est.bound_text()}", f"high figure {format_bytes(bound.high_bytes)}"),
    ] + [(f"  of which {k}", format_bytes(v)) for k, v in parts.items()] + [
        (f"GPU footprint ({fw}: +{100 * est.estimate_margin:.0f}% estimate margin, cache, context)",
         format_bytes(est.footprint_bytes(fw))),
        ("inference peak (allocator)", format_bytes(est.inference_bytes())),
    ]
    w = max(len(k) for k, _ in totals)
    lines += [f"{k.ljust(w)}  {v}" for k, v in totals]
    lines += _measurement_lines(est)
    if per_layer:
        head = ["#", "layer", "type", "params", "weights", "grads", "optimizer", f"act@{b}", f"out@{b}", "dtype"]
        right = [True, False, False, True, True, True, True, True, True, False]
        rows = [[str(i), r.name, r.kind, f"{r.params:,}", format_bytes(r.param_bytes), format_bytes(r.grad_bytes),
                 format_bytes(r.optimizer_bytes), format_bytes(r.activation_bytes(b)),
                 format_bytes(r.output_bytes_per_sample * b), r.dtype + (" *" if r.note else "")]
                for i, r in enumerate(est.layers)]
        widths = [max(len(x[k]) for x in [head] + rows) for k in range(len(head))]
        lines += ["", _row(head, widths, right)] + [_row(x, widths, right) for x in rows]
        if any(r.note for r in est.layers):
            lines.append("* sized by a fallback; see the warnings")
    if est.warnings:
        lines += ["", f"{len(est.warnings)} warning(s):"] + [f"  {w_}" for w_ in est.warnings]
    return "\n".join(lines)


def _measurement_lines(est: Estimate) -> List[str]:
    """How the figure was made: what was measured (batches, steps, cost), carried or refused, and
    where its bound comes from."""
    b = est.batch_size
    m = est.measurement or {}
    bound = est.bound()
    lines = [""]
    if m.get("points"):
        steps = m.get("steps") or {}
        pts = ", ".join(f"{format_bytes(y)} at batch {pb}" + (f" (worst of {len(steps[str(pb)])} steps)"
                                                               if len(steps.get(str(pb), [])) > 1 else "")
                        for pb, y in m["points"])
        lines.append(f"measured on {m.get('device')}: {pts}; cost {m.get('seconds')} s"
                     f"{' (reused: measured earlier)' if m.get('reused') else ''} ({m.get('how')})")
        if m.get("at_target"):
            lines.append(f"batch {b} was measured; other batches are carried from the measured ones by the "
                         f"'{m.get('rule')}' rule")
        else:
            lines.append(f"carried to batch {b} by the '{m.get('rule')}' rule")
        for nb, why in ((m.get("ladder") or {}).get("not_run") or {}).items():
            lines.append(f"batch {nb} not run: {why}")
    elif m.get("fallback"):
        lines.append(f"not measured: {m['fallback']}")
    lines.append(f"bound ({bound.source}): {format_bytes(bound.low_bytes)} .. {format_bytes(bound.high_bytes)}, "
                 f"from {bound.basis}; planners use the high figure")
    return lines


def run(args: argparse.Namespace) -> int:
    """Run ``distmem estimate`` with parsed ``args``; returns the exit status."""
    # A DistmemError goes up to the ``distmem`` command's one rule: one line, status 1.
    if args.batch_size < 1:
        raise DistmemError(f"--batch-size {args.batch_size}: give a whole number of samples, at least 1")
    if not str(args.model).strip():
        raise DistmemError("--model '': give a model, e.g. torchvision:resnet50 or keras:MobileNetV2")
    if str(args.optimizer).lower() not in OPTIMIZER_NAMES:  # before any framework is imported
        import difflib

        close = difflib.get_close_matches(str(args.optimizer).lower(), OPTIMIZER_NAMES, n=2)
        raise DistmemError(f"--optimizer {args.optimizer!r} is not one distmem counts"
                           + (f" (did you mean {' or '.join(close)}?)" if close else "")
                           + f"; use one of {', '.join(OPTIMIZER_NAMES)}")
    shape = parse_shape(args.input_shape)
    precision = "mixed_float16" if args.mixed_precision else args.precision
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the estimate lists its own warnings
        est = _estimate(args, shape, precision)
    say_back()  # sizes read in decimal units, before the result
    if args.json:
        print(json.dumps(est.to_dict(per_layer=args.per_layer), indent=2))
        for w_ in est.warnings:  # the JSON holds them too; a reader of the terminal sees them here
            print(f"warning: {w_}", file=sys.stderr)
    else:  # the table ends with its warnings: once
        print(render_table(est, per_layer=args.per_layer))
    return 0


def _estimate(args: argparse.Namespace, shape, precision) -> Estimate:
    from . import estimate
    method = "measure" if args.calibrate else args.method
    if args.calibrate and args.method == "model":
        raise DistmemError("--calibrate measures the model's steps (it is --method measure); it cannot go with "
                           "--method model, which never runs the model")
    torch_spec = args.model.partition(":")[0].lower() in ("torchvision", "tv", "hf", "huggingface", "transformers")
    device = None if args.device is None else ("cpu" if args.device == "cpu" else ("cuda" if torch_spec else "gpu"))
    options = {"precision": precision, "name": args.model}
    if device is not None:
        options["device"] = device
    return estimate(args.model, args.batch_size, args.optimizer, input_shape=shape, method=method, **options)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m distmem.estimate.cli``: ``distmem estimate`` under the same rule (an input it cannot
    use: one line, status 1; Ctrl-C: one line, status 130)."""
    parser = argparse.ArgumentParser(prog="distmem estimate", description=__doc__.split("\n")[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except BaseException as exc:  # noqa: BLE001 - a Ctrl-C however wrapped, and distmem's own errors
        if from_interrupt(exc):
            sys.stderr.write("distmem estimate: interrupted\n")
            forget_caught_interrupt()
            return 130
        if isinstance(exc, DistmemError):
            sys.stderr.write(f"distmem estimate: error: {exc}\n")
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
