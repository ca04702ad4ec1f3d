"""The ``distmem plan`` options of the pipeline, model and tenants strategies, and the planner
keyword arguments they turn into. The planners themselves (distmem.plan) take no argparse."""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Dict, Optional, Tuple

from ..discover.gpus import Inventory
from ..discover.identity import Topology
from ..errors import ConfigError
from ..plan.model import plan_model
from ..plan.partition import SCHEDULES, layers_from_dicts
from ..plan.pipeline import RANK_ORDERS, plan_pipeline
from ..plan.tenants import DEFAULT_MAX_TENANTS, parse_tenants
from ..plan.types import Plan

__all__ = ["add_once", "add_layer_arguments", "add_pipeline_arguments", "add_model_arguments", "add_tenant_arguments",
           "layer_options_from_args", "common_options", "pipeline_options", "model_options", "tenant_options", "pipeline_plan",
           "model_plan", "STRATEGY_ARGUMENTS"]


def add_once(parser: argparse.ArgumentParser, *flags: str, **kwargs: Any) -> None:
    """Add an option unless another strategy's module already did (both add to one parser)."""
    if any(f in parser._option_string_actions for f in flags):  # noqa: SLF001 - argparse has no public test
        return
    parser.add_argument(*flags, **kwargs)


def add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``--strategy pipeline`` and ``--strategy model``: where per-layer costs come from."""
    add_once(parser, "--layers", metavar="FILE.json",
         help="per-layer costs: a JSON list of {name, state_bytes, activation_bytes, output_bytes} "
              "(pipeline/model)")
    add_once(parser, "--model", metavar="SPEC", help="model to estimate per layer, e.g. keras:ResNet50 (pipeline/model)")
    add_once(parser, "--input-shape", metavar="H,W,C", help="model input shape without the batch axis, e.g. 96,96,3")
    add_once(parser, "--optimizer", default=None, help="optimizer for the estimate (sgd, momentum, adam)")
    add_once(parser, "--input-bytes", default="0", help="model input per (micro-)batch, held by the first stage/device")
    add_once(parser, "--headroom", default="10%", help="added to each computed demand for the allocator's cache "
         "(default 10%%, TensorFlow's BFC margin; use 52%% for torch's caching allocator) (pipeline/model)")


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--stages --num-stages --micro-batch-size --num-micro-batches --schedule --recompute
    --rank-order`` plus the shared layer options; safe to call on a parser that has some of them."""
    add_layer_arguments(parser)
    add_once(parser, "--stages", metavar="SIZES", help="explicit per-stage demand, e.g. 9GiB,7GiB,7GiB,5GiB (pipeline)")
    add_once(parser, "--num-stages", type=int, default=None, help="pipeline stages (default: ranks per node)")
    add_once(parser, "--micro-batch-size", type=int, default=None, help="samples per micro-batch (estimator's batch)")
    add_once(parser, "--num-micro-batches", type=int, default=None, help="micro-batches per step (default: stages)")
    add_once(parser, "--schedule", choices=list(SCHEDULES), default="1f1b", help="pipeline schedule (default 1f1b)")
    add_once(parser, "--recompute", action="store_true", help="activation recomputation (pipeline)")
    add_once(parser, "--rank-order", choices=list(RANK_ORDERS), default="pipeline",
         help="pipeline: consecutive ranks form one pipeline; replica: consecutive ranks share a stage")


def _shape(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    if not text:
        return None
    try:
        return tuple(int(x) for x in str(text).replace("x", ",").split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--input-shape {text!r}: write sizes separated by commas, e.g. 96,96,3") from None


def layer_options_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """``layers=`` / ``model=`` and their estimate options from the shared CLI flags."""
    out: Dict[str, Any] = {}
    path = getattr(args, "layers", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--layers {path}: cannot read a JSON list of layer costs ({exc})") from None
        out["layers"] = layers_from_dicts(data["layers"] if isinstance(data, dict) and "layers" in data else data)
    if getattr(args, "model", None):
        out["model"] = args.model
        out["input_shape"] = _shape(getattr(args, "input_shape", None))
        if getattr(args, "optimizer", None):
            out["optimizer"] = args.optimizer
    out["input_bytes"] = getattr(args, "input_bytes", 0) or 0
    out["headroom"] = getattr(args, "headroom", "10%") or "10%"
    return out


def pipeline_options(args: argparse.Namespace) -> Dict[str, Any]:
    """Keyword arguments for :func:`plan_pipeline` from parsed CLI flags (no topology, no devices)."""
    out = layer_options_from_args(args)
    if getattr(args, "stages", None):
        out = {"stages": [s.strip() for s in args.stages.split(",") if s.strip()], "headroom": out["headroom"]}
    elif "layers" not in out and "model" not in out:
        raise ConfigError("--strategy pipeline needs --stages 9GiB,7GiB,..., --layers FILE.json or --model SPEC")
    for key in ("num_stages", "micro_batch_size", "num_micro_batches"):
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    out["schedule"] = getattr(args, "schedule", "1f1b") or "1f1b"
    out["recompute"] = bool(getattr(args, "recompute", False))
    out["rank_order"] = getattr(args, "rank_order", "pipeline") or "pipeline"
    if "stages" in out:
        for key in ("micro_batch_size",):
            out.pop(key, None)
    return out


def common_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The options every strategy takes (memory, reserve, overhead, foreign), where given."""
    return {k: getattr(args, k) for k in ("memory", "reserve", "overhead", "foreign")
            if getattr(args, k, None) is not None}


def pipeline_plan(args: argparse.Namespace, topo: Topology, inv: Inventory) -> Plan:
    """The pipeline plan the CLI prints: the common options plus the pipeline's own."""
    return plan_pipeline(topo, inv, **common_options(args), **pipeline_options(args))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--gpus-per-rank --batch-size`` plus the layer options shared with pipeline."""
    add_layer_arguments(parser)
    add_once(parser, "--gpus-per-rank", type=int, default=None,
         help="devices each rank owns (model; default visible GPUs // ranks per node)")
    add_once(parser, "--batch-size", type=int, default=None, help="batch size for the estimate (model)")


def model_options(args: argparse.Namespace) -> Dict[str, Any]:
    """Keyword arguments for :func:`plan_model` from parsed CLI flags."""
    out = layer_options_from_args(args)
    if "layers" not in out and "model" not in out:
        raise ConfigError("--strategy model needs --layers FILE.json or --model SPEC (e.g. keras:ResNet50)")
    for key in ("gpus_per_rank", "batch_size"):
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    return out


def model_plan(args: argparse.Namespace, topo: Topology, inv: Inventory) -> Plan:
    """The model-parallel plan the CLI prints: the common options plus the model strategy's own."""
    return plan_model(topo, inv, **common_options(args), **model_options(args))


def add_tenant_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--tenants`` and ``--max-tenants``."""
    add_once(parser, "--tenants", metavar="NAME=SIZE,...",
         help="tenants: named slices of one GPU, e.g. bert=6GiB,resnet=8GiB (size 'auto': an equal share of the rest)")
    add_once(parser, "--max-tenants", type=int, default=DEFAULT_MAX_TENANTS,
         help=f"tenants: most slices per GPU (default {DEFAULT_MAX_TENANTS})")


def tenant_options(args: argparse.Namespace) -> Dict[str, Any]:
    """Keyword arguments for :func:`plan_tenants` from parsed CLI flags."""
    if not getattr(args, "tenants", None):
        raise ConfigError("--strategy tenants needs --tenants NAME=SIZE,..., e.g. --tenants bert=6GiB,resnet=8GiB")
    return {"tenants": parse_tenants(args.tenants),
            "max_tenants": getattr(args, "max_tenants", None) or DEFAULT_MAX_TENANTS}


#: strategy -> (register its options on a parser, planner keyword arguments from parsed options)
STRATEGY_ARGUMENTS: Dict[str, Tuple[Callable[[argparse.ArgumentParser], None],
                                    Callable[[argparse.Namespace], Dict[str, Any]]]] = {
    "pipeline": (add_pipeline_arguments, pipeline_options),
    "model": (add_model_arguments, model_options),
    "tenants": (add_tenant_arguments, tenant_options),
}
