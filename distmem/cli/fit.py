"""``distmem fit``: which layouts of a model fit every rank of a fleet, best first.

    distmem fit --model torchvision:resnet50 --global-batch-size 512 --gpus 4x12GiB
    distmem fit --model keras:ResNet50 --global-batch-size 256 --gpus 8x80GiB --hosts 2 --precision fp32
    distmem fit --layers costs.json --layers-batch-size 1 --global-batch-size 2048 --gpus 8x80GiB --hosts 8 --json
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, Dict, List, Optional

from .. import defaults, settings
from ..console import say_back
from ..discover.runtime import FRAMEWORK_ALIASES, FRAMEWORKS
from ..errors import ConfigError
from .checks import at_least, did_you_mean

__all__ = ["add_arguments", "run", "main"]


def _ints(text: Optional[str], what: str) -> Optional[List[int]]:
    if not text:
        return None
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--{what} {text!r}: give whole numbers separated by commas, e.g. 1,2,4") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--{what} {text!r}: give whole numbers of at least 1, separated by commas, e.g. 1,2,4")
    return values


def _overhead(given: Optional[str]) -> Optional[str]:
    """--overhead, else DISTMEM_OVERHEAD; ``auto`` (and no value) lets fit model it per layout."""
    value = given if given is not None else settings.overhead()
    if value == "measure":
        raise ConfigError("--overhead measure probes a GPU in init(); distmem fit models the overhead per layout: "
                          "give a size (768MiB) or auto")
    return None if value in (None, "auto") else value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``distmem fit``'s options to ``p``."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="SPEC",
                     help="torchvision:NAME, keras:NAME or module.path:factory (estimated per layer, no GPU)")
    src.add_argument("--layers", metavar="FILE.json",
                     help="per-layer costs: a JSON list of {name, state_bytes, activation_bytes, output_bytes}")
    p.add_argument("--layers-batch-size", type=at_least(1), default=1, help="the batch --layers was measured at (default 1)")
    p.add_argument("--global-batch-size", type=at_least(1), required=True, help="samples per optimizer step, whole job")
    p.add_argument("--gpus", required=True, help="GPUs of each host, e.g. 8x80GiB or 4x80GiB,4x40GiB")
    p.add_argument("--hosts", type=at_least(1), default=None,
                   help="hosts with --gpus each (default 1; a per-host fleet a=...;b=... names its hosts)")
    p.add_argument("--framework", choices=FRAMEWORKS + sorted(FRAMEWORK_ALIASES), default=None,
                   help="whose allocator and overhead to model (default: the model's; one the model contradicts is refused)")
    p.add_argument("--precision", default="auto",
                   help="auto (tries fp32 and bf16), float32, mixed_bfloat16 or mixed_float16")
    p.add_argument("--optimizer", default="adam", help="optimizer whose state is counted (default adam)")
    p.add_argument("--input-shape", default=None, help="one sample without the batch axis, e.g. 3,224,224")
    p.add_argument("--schedules", default="1f1b,gpipe", help="pipeline schedules to try (default 1f1b,gpipe)")
    p.add_argument("--pipelines", default=None, help="pipeline degrees to try, e.g. 1,2,4 (default: all)")
    p.add_argument("--micro-batches", default=None, help="micro-batch sizes to allow, e.g. 8,16 (default: all)")
    p.add_argument("--ranks-per-gpu", default="1,2", help="ranks sharing one GPU to try (default 1,2)")
    p.add_argument("--shardings", default="auto", metavar="LIST",
                   help="sharded data parallel to try beside replicated state, torch models only: auto "
                        "(zero1,zero2,fsdp2,fsdp2_keep; none for a Keras model), none, or a comma list of them "
                        "(default auto)")
    p.add_argument("--units", default=None, metavar="CLASS,...|PATH,...",
                   help="FSDP2 units as fully_shard is applied: module class names (LlamaDecoderLayer) or module paths "
                        "(model.layers.0); 'root' for none (default: the model's repeated block)")
    p.add_argument("--recompute", choices=["auto", "on", "off"], default="auto",
                   help="activation recomputation in pipelines (default: try both)")
    p.add_argument("--headroom", default=None,
                   help="allocator margin over its peak under a hard limit: 10%% or 0.1 (default 10%%)")
    p.add_argument("--reserve", default=None, help="kept free on every GPU (default 256MiB)")
    p.add_argument("--overhead", default=None,
                   help="memory outside the allocator per process (default: modelled per layout, NCCL included)")
    p.add_argument("--foreign", default="0", help="memory other jobs hold on each GPU")
    p.add_argument("--nccl-buffsize", default=None, help="NCCL_BUFFSIZE the job runs with (default NCCL's 4 MiB)")
    p.add_argument("--ranks-per-host", type=at_least(1), default=None,
                   help="ranks each host already runs (what strategy='auto' searches for a launched job); default: "
                        "every layout that keeps the GPUs busy")
    p.add_argument("--memory", default=None, choices=["auto", "growth", "limit"],
                   help="how limits are applied (default DISTMEM_MEMORY, else auto): under growth the default "
                        "headroom also holds torch's cache")
    p.add_argument("--top", type=at_least(1), default=10, help="layouts that fit to list (default 10)")
    p.add_argument("--rejected", type=at_least(0), default=5, help="best rejected layouts to list (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON for tools instead of the table")


def _check_pipelines(args: argparse.Namespace, pipelines: Optional[List[int]], per_gpu: List[int]) -> None:
    """--pipelines none of whose degrees divides any job this fleet makes: one line with the divisors."""
    if not pipelines:
        return
    from ..discover.gpus import fleet_hosts, parse_fleet

    hosts = [h if h != "*" else None for h in fleet_hosts(args.gpus, "--gpus")]
    gpus = sum(len(parse_fleet(args.gpus, h, "--gpus")) for h in hosts) * (args.hosts or 1 if len(hosts) == 1 else 1)
    ranks = sorted({gpus * k for k in per_gpu})
    if any(r % p == 0 for p in pipelines for r in ranks):
        return
    divisors = sorted({d for r in ranks for d in range(1, r + 1) if r % d == 0})
    raise ConfigError(f"--pipelines {args.pipelines}: no pipeline degree given divides the "
                      f"{' or '.join(map(str, ranks))} ranks of {gpus} GPU(s) (--ranks-per-gpu "
                      f"{','.join(map(str, per_gpu))}); give degrees among {', '.join(map(str, divisors))}")


def _options(args: argparse.Namespace) -> Dict[str, Any]:
    if args.global_batch_size < 1:
        raise ConfigError(f"--global-batch-size {args.global_batch_size}: give the samples per step, at least 1")
    if args.hosts is not None and args.hosts < 1:
        raise ConfigError(f"--hosts {args.hosts}: give at least one host")
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: list at least one layout that fits (default 10)")
    if args.rejected < 0:
        raise ConfigError(f"--rejected {args.rejected}: give 0 or more rejected layouts to list (default 5)")
    from ..estimate.loader import parse_shape
    from ..estimate.optimizers import OPTIMIZER_NAMES

    if args.optimizer.lower() not in OPTIMIZER_NAMES:
        raise ConfigError(f"--optimizer {args.optimizer!r} is not one distmem counts{did_you_mean(args.optimizer.lower(), OPTIMIZER_NAMES)}; "
                          f"use one of {', '.join(OPTIMIZER_NAMES)}")
    if args.input_shape is not None:
        parse_shape(args.input_shape)  # before any model is loaded
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    opts: Dict[str, Any] = dict(global_batch_size=args.global_batch_size, gpus=args.gpus, hosts=args.hosts,
                                framework=args.framework, precision=args.precision, optimizer=args.optimizer,
                                schedules=schedules, pipelines=_ints(args.pipelines, "pipelines"),
                                micro_batches=_ints(args.micro_batches, "micro-batches"),
                                ranks_per_gpu=_ints(args.ranks_per_gpu, "ranks-per-gpu"),
                                recompute={"auto": "auto", "on": True, "off": False}[args.recompute],
                                headroom=args.headroom, reserve=args.reserve if args.reserve is not None else
                                defaults.RESERVE, overhead=_overhead(args.overhead), memory=args.memory or settings.memory(),
                                foreign=args.foreign, nccl_buffsize=args.nccl_buffsize, top=args.top,
                                rejected=args.rejected, fixed_local_size=args.ranks_per_host,
                                shardings=args.shardings)
    if args.units is not None:
        if args.layers:
            raise ConfigError("--units names the modules of --model; with --layers each layer is one FSDP2 unit")
        opts["units"] = args.units
    from ..estimate.loader import spec_framework
    from ..plan.fit.solve import shard_choices

    # a bad name refused before any model is loaded (a keras: spec's shardings too)
    shard_choices(args.shardings, spec_framework(args.model or "") or "torch")
    _check_pipelines(args, opts["pipelines"], opts["ranks_per_gpu"] or [1, 2])
    if args.layers:
        from ..plan.strategies.text import layers_file

        opts["layers"] = layers_file(args.layers)
        opts["layers_batch_size"] = args.layers_batch_size
        opts["name"] = args.layers
    else:
        opts["model"] = args.model
        opts["input_shape"] = args.input_shape
    return opts


def run(args: argparse.Namespace) -> int:
    """Run ``distmem fit`` with parsed ``args``; 0 when a layout fits, 3 when none does."""
    from ..plan.fit import fit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the estimator's own warnings are summarised in the result
        result = fit(**_options(args))
    say_back()  # the sizes read in decimal units, before the layouts they sized
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=str))
    else:
        print(result.table())
    return 0 if result.fits else 3


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m distmem.cli.fit``: the same as ``distmem fit``."""
    from . import main as distmem_main

    return distmem_main(["fit", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
