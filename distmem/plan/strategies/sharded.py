"""Sharded data parallel: every rank a replica of the step on its own micro-batch, the model state
sharded over ``degree`` ranks (FSDP2's ``fully_shard``, ZeRO-1/2), each rank's limit its demand plus
headroom.

A rank's demand is the estimator's peak for one replica's step at ``batch_size`` samples with the
state the sharding leaves it and the buffers it holds (:func:`distmem.plan.wrappers.rank_peak`:
FSDP2's shards, gathered units and reduce-scatter input; ZeRO's owned partition of the optimizer
state, and of the gradients at stage 2). The demand comes from ``model=`` (estimated once per job,
on rank 0, like every strategy's) or ``layers=`` (per-layer costs at ``batch_size``: the gradients
are taken as the optimizer's share of each layer's state, :func:`distmem.plan.wrappers.grad_fraction`).
Each limit is :meth:`distmem.plan.budget.Budget.limit_for` of the demand and must fit the rank's
equal share of its GPU, as a pipeline stage's does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

from ...errors import ConfigError, DoesNotFitError
from ...units import SizeLike, format_bytes, plural
from ..budget import growth_note, idle_warnings, slot
from ..strategy import Strategy, option
from ..types import Allocation, Plan
from ..wrappers import SHARDINGS, grad_fraction, mixed_precision, sharding_wrapper
from .text import layers_file, shape, whole_number

if TYPE_CHECKING:
    from ..request import Context

__all__ = ["ShardedOptions", "STRATEGY", "sharded_demand"]


@dataclass
class ShardedOptions:
    model: Any = option(None, metavar="SPEC", help="model to estimate, e.g. torchvision:resnet50 or a torch module")
    layers: Optional[Sequence[Any]] = option(
        None, metavar="FILE.json", parse=layers_file,
        help="per-layer costs at --batch-size instead of --model (a JSON list of {name, state_bytes, "
             "activation_bytes, output_bytes})")
    batch_size: Optional[int] = option(None, parse=whole_number("batch_size"),
                                       help="samples per rank per step (the micro-batch; default 8)")
    sharding: str = option("fsdp2", choices=SHARDINGS,
                           help="zero1 (optimizer state), zero2 (+ gradients), fsdp2 (fully_shard, reshard after "
                                "forward) or fsdp2_keep (reshard_after_forward=False)")
    degree: Optional[int] = option(None, parse=whole_number("degree"),
                                   help="ranks the state is sharded over (default: every rank of the job)")
    prefetch: int = option(1, parse=int, help="FSDP2 units all-gathered ahead of the one computing (default 1)")
    optimizer: Any = option("adam", help="optimizer whose state is counted (sgd, momentum, adam; default adam)")
    precision: Any = option("float32", help="float32, mixed_bfloat16 or mixed_float16 (the estimate's)")
    input_shape: Optional[Sequence[int]] = option(None, metavar="H,W,C", parse=shape,
                                                  help="one sample without the batch axis, e.g. 3,224,224")
    headroom: Optional[SizeLike] = option(
        None, metavar="PCT", help="added to each rank's demand for the allocator (default 10%%); 0 keeps it")
    units: Any = option(None, metavar="CLASS,...|PATH,...",
                        help="FSDP2 units, as fully_shard is applied: module class names (LlamaDecoderLayer), module "
                             "paths (model.layers.0) or, in Python, a policy callable; 'root' for none (default: the "
                             "model's repeated block, every module of its class a unit, the root holding the rest)")
    param_dtype: Optional[str] = option(None, choices=("float32", "bfloat16", "float16"),
                                        help="FSDP2 MixedPrecisionPolicy(param_dtype=...): parameters gathered and the "
                                             "step computed in it, the shards and optimizer in float32 (default: none)")
    reduce_dtype: Optional[str] = option(None, choices=("float32", "bfloat16", "float16"),
                                         help="FSDP2 MixedPrecisionPolicy(reduce_dtype=...): the gradients' "
                                              "reduce-scatter dtype (default: param_dtype)")


def _degree(ctx: "Context", opts: ShardedOptions) -> int:
    size = ctx.topo.size
    d = size if opts.degree is None else opts.degree
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ConfigError(f"degree={opts.degree!r}: give the ranks the state is sharded over, a whole number >= 1")
    if size % d:
        raise ConfigError(f"degree={d} does not divide the job's {plural(size, 'rank')}: the state is sharded over "
                          f"groups of {d} ranks (HSDP replicates the groups); use a divisor of {size}")
    return d


def sharded_demand(ctx: "Context", opts: ShardedOptions, degree: int) -> Tuple[int, Dict[str, int], List[str]]:
    """(one rank's peak in bytes, its parts, the rule applied): the same on every rank of the job."""
    if (opts.model is None) == (opts.layers is None):
        raise ConfigError("strategy='sharded' needs exactly one of model= (a torch module or a spec such as "
                          "'torchvision:resnet50') or layers=[LayerCost, ...] with batch_size= (the batch they were "
                          "measured at); on the command line --model SPEC or --layers FILE.json")
    if opts.sharding not in SHARDINGS:
        raise ConfigError(f"sharding={opts.sharding!r} is not one of {', '.join(SHARDINGS)}")
    if isinstance(opts.prefetch, bool) or not isinstance(opts.prefetch, int) or opts.prefetch < 0:
        raise ConfigError(f"prefetch={opts.prefetch!r}: give the FSDP2 units gathered ahead, a whole number >= 0")
    if (opts.param_dtype or opts.reduce_dtype) and not opts.sharding.startswith("fsdp2"):
        raise ConfigError(f"param_dtype/reduce_dtype are FSDP2's MixedPrecisionPolicy; sharding={opts.sharding!r} "
                          "runs the model as it is: give precision='mixed_bfloat16' for autocast, or sharding='fsdp2'")
    if opts.reduce_dtype and not opts.param_dtype:
        raise ConfigError(f"reduce_dtype={opts.reduce_dtype!r} without param_dtype: give param_dtype too (FSDP2 "
                          "reduces in param_dtype unless told otherwise)")
    if opts.layers is not None and (opts.units is not None or opts.param_dtype):
        raise ConfigError("units= and param_dtype= need model= (the module is what is wrapped); with layers= each "
                          "layer is one unit, in the dtype its costs were given in")
    batch = int(opts.batch_size or 8)

    def compute() -> Tuple[int, Dict[str, int], List[str]]:
        from ..fit import costs_from_model
        from ..fit.costs import LayerListCosts
        from ..fit.solve import precision_choices
        from ..partition import layers_from_dicts

        prec = precision_choices(opts.precision)[0]
        if opts.layers is not None:
            costs: Any = LayerListCosts(layers_from_dicts(list(opts.layers)), batch, precision=prec,
                                        gradient_fraction=grad_fraction(opts.optimizer))
        else:
            costs = costs_from_model(opts.model, [prec], optimizer=opts.optimizer, input_shape=opts.input_shape,
                                     batch_size=batch, method=ctx.estimate_method, units=opts.units,
                                     param_dtype=opts.param_dtype)[prec]
            _torch_model(opts.model, costs.framework)
        wrapper = sharding_wrapper(opts.sharding, degree, prefetch=opts.prefetch,
                                   **mixed_precision(opts.param_dtype, opts.reduce_dtype, _master_bytes(costs)))
        peak, parts = costs.rank_peak(batch, False, wrapper)
        from ..wrappers import wrapper_demand

        return int(peak), {k: int(v) for k, v in parts.items()}, wrapper_demand(wrapper, costs.model_state()).rules

    if opts.model is not None:
        _torch_model(opts.model, "")  # a Keras spec or model, on every rank before anything is estimated
    return ctx.agreed(compute)


def _torch_model(model: Any, framework: str) -> None:
    """ConfigError where the model is a Keras one (by its spec or object before it is estimated,
    ``framework`` after): FSDP2 and ZeRO shard a torch model's state."""
    if not framework:
        from ...estimate.loader import framework_of, spec_framework

        if isinstance(model, str):
            framework = spec_framework(model) or ""
        else:
            try:
                framework = framework_of(model)
            except ConfigError:
                framework = ""
    if framework in ("keras", "tensorflow"):
        raise ConfigError(f"strategy='sharded' shards a torch model's state (FSDP2's fully_shard, ZeRO-1/2), and "
                          f"{model if isinstance(model, str) else type(model).__name__} is a Keras model: TensorFlow "
                          "replicates the state on every rank; use strategy='data' (with wrapper='horovod' or "
                          "'tf_distribute'), or 'pipeline'/'model' to split the model")


def _master_bytes(costs: Any) -> float:
    """Bytes per element of the model's parameters as held (the sharded master copy)."""
    est = getattr(costs, "est", None)
    if est is None or not getattr(est, "params", 0):
        return 4.0
    return float(est.param_bytes) / float(est.params)


def plan(ctx: "Context", opts: ShardedOptions) -> Plan:
    budget = ctx.budget
    degree = _degree(ctx, opts)
    demand, parts, rules = sharded_demand(ctx, opts, degree)
    want = budget.limit_for(demand)
    enforce = budget.enforced(always=True)
    allocations: List[Allocation] = []
    warnings: List[str] = []
    used: Dict[str, Set[str]] = {}
    for pl in ctx.places:
        alloc = Allocation(pl.rank, pl.local_rank, pl.host, "sharded", "cpu", replica=pl.rank, demand_bytes=demand,
                           breakdown=dict({k.replace(" ", "_").replace(",", "") + "_bytes": v for k, v in parts.items() if v},
                                          planned_bytes=want, headroom_bytes=want - demand),
                           notes=[f"{opts.sharding} over {degree}, shard group {pl.rank // degree}: " + "; ".join(rules)],
                           headroom=budget.headroom)
        if pl.gpu is not None:
            gpu, k = pl.gpu, pl.shared_by
            used.setdefault(pl.host, set()).add(gpu.uuid)
            share = budget.share(gpu, k)
            if demand > share:
                remedies = [f"shard over more ranks (degree {degree} -> {degree * 2} halves the state)"
                            if degree < ctx.topo.size or opts.sharding != "fsdp2" else "",
                            "sharding='fsdp2' (parameters and gradients too)" if opts.sharding != "fsdp2" else "",
                            "a smaller batch_size (activations are each rank's own)", "fewer ranks per GPU"
                            if k > 1 else "", "or a larger GPU"]
                raise DoesNotFitError(
                    f"a rank of {opts.sharding} over {degree} needs {format_bytes(demand)} ("
                    + ", ".join(f"{n} {format_bytes(v)}" for n, v in parts.items() if v)
                    + f") but rank {pl.rank}'s GPU {gpu.index} ({format_bytes(gpu.total_bytes)}"
                    + (f", shared by {k} ranks" if k > 1 else "") + f") offers {format_bytes(share)} after reserve "
                    f"{format_bytes(budget.reserve_of(gpu))}, foreign {format_bytes(budget.foreign_of(gpu))} and "
                    f"per-process overhead {format_bytes(budget.overhead_bytes)}; use "
                    + ", ".join(r for r in remedies if r))
            limit = min(want, share)
            if limit < want and not warnings:
                warnings.append(f"headroom cut to {format_bytes(share - demand)} (wanted {budget.headroom:.0%} of "
                                f"{format_bytes(demand)}) to fit GPU {gpu.index}'s {format_bytes(share)}")
            alloc.breakdown["planned_bytes"] = limit
            alloc.breakdown["headroom_bytes"] = limit - demand
            alloc.mode = "limit" if enforce else "growth"
            alloc.devices = [slot(gpu, limit, enforce=enforce, shared_by=k, label=f"{opts.sharding} shard")]
            note = growth_note(k) if budget.memory == "growth" else None
            if note:
                alloc.notes.append(note)
        allocations.append(alloc)
    warnings += idle_warnings(ctx.seen_gpus(), used)
    extras: Dict[str, Any] = {"sharded": {
        "sharding": opts.sharding, "degree": degree, "groups": ctx.topo.size // degree, "batch_size": opts.batch_size,
        "demand_bytes": demand, "planned_bytes": want, "parts": parts, "rules": rules, "headroom": budget.headroom,
        "source": "model" if opts.model is not None else "layers",
        "units": next((r.split(". ", 1)[0][len("FSDP2 units: "):] for r in rules if r.startswith("FSDP2 units: ")),
                      None), "param_dtype": opts.param_dtype, "reduce_dtype": opts.reduce_dtype}}
    options = dict(sharding=opts.sharding, degree=degree, batch_size=opts.batch_size, prefetch=opts.prefetch,
                   optimizer=str(opts.optimizer), precision=str(opts.precision),
                   units=opts.units if opts.units is None or isinstance(opts.units, (str, list, tuple)) else
                   getattr(opts.units, "__qualname__", "a policy"), param_dtype=opts.param_dtype,
                   reduce_dtype=opts.reduce_dtype)
    return ctx.make_plan("sharded", allocations, options, extras=extras, warnings=warnings)


STRATEGY = Strategy("sharded", "sharded data parallel (FSDP2, ZeRO-1/2): each rank's shard plus buffers, plus headroom",
                    ShardedOptions, plan, derives_limits=True)
