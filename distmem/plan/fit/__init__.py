"""``distmem fit``: which layouts of a model fit every rank of a fleet, best first. Pure but for the
estimator it calls. The search is in four rooms: what is searched (:mod:`.space`), what prices a
layout (:mod:`.costs`, :mod:`.evaluate`), the search itself (:mod:`.solve`) and its table (:mod:`.render`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...discover.gpus import Gpu, Inventory, fleet_hosts, fleet_inventory
from ...errors import ConfigError
from .costs import Costs, EstimateCosts, LayerListCosts
from .evaluate import Candidate, StageFit, nccl_communicators_of
from .solve import PRECISION_CHOICES, FitResult, precision_choices, solve_fit
from .space import ParallelLayout

__all__ = ["fit", "fit_without_costs", "costs_from_model", "solve_fit", "FitResult", "Candidate", "StageFit",
           "ParallelLayout", "Costs", "EstimateCosts", "LayerListCosts", "PRECISION_CHOICES",
           "nccl_communicators_of"]


def _gpus_of(gpus: Any, hosts: Optional[int]) -> Tuple[List[Gpu], str, int]:
    """(one host's GPUs to hold layouts against, the fleet's name, the number of hosts). A per-host
    fleet (``a=2x80GiB;b=2x40GiB``) holds every GPU position to its smallest across the hosts
    (:func:`distmem.plan.request.worst_host`), so a layout that fits fits every host."""
    if hosts is not None and (isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1):
        raise ConfigError(f"hosts={hosts!r}: give a whole number of hosts >= 1")
    if isinstance(gpus, Inventory):
        return list(gpus.gpus), gpus.source, hosts or 1
    if isinstance(gpus, (list, tuple)) and gpus and all(isinstance(g, Gpu) for g in gpus):
        return list(gpus), "gpus", hosts or 1
    if not isinstance(gpus, str):
        raise ConfigError(f"gpus={gpus!r}: give a fleet such as '8x80GiB' (per host) or an Inventory")
    from ..request import job_hosts, worst_host

    parts = fleet_hosts(gpus, "gpus")
    named = [h for h in parts if h != "*"]
    if not named:
        return list(fleet_inventory(gpus, what="gpus").gpus), gpus, hosts or 1
    count = hosts if hosts is not None else len(named)
    if count > len(named) and "*" not in parts:
        raise ConfigError(f"--hosts {count} but the fleet {gpus!r} declares {len(named)} host(s) ({', '.join(named)}) "
                          "and no default; add *=COUNTxSIZE for the others or name every host")
    names = job_hosts(gpus, count)
    return worst_host([list(fleet_inventory(gpus, h, what="gpus").gpus) for h in names]), gpus, count


def costs_from_model(model: Any, precisions: Sequence[str], *, optimizer: Any = "adam", input_shape: Any = None,
                     batch_size: int = 8, device: Optional[str] = None, method: str = "auto", units: Any = None,
                     param_dtype: Any = None, **estimate_options: Any) -> Dict[str, Costs]:
    """One :class:`EstimateCosts` per precision through ``distmem.estimate`` (imported here, not at
    module level, so the solver stays free of frameworks). A spec is handed to the estimator as
    given (a measurement rebuilds it); a torch model's FSDP2 units are found here
    (:func:`distmem.estimate.torch.units.fsdp_units`: ``units=`` as given, else its repeated
    block). ``param_dtype``: FSDP2's ``MixedPrecisionPolicy`` param_dtype, the dtype the step runs in."""
    import importlib

    est_mod = importlib.import_module("distmem.estimate")
    out: Dict[str, Costs] = {}
    loaded = est_mod.load_model(model, est_mod.parse_shape(input_shape)) if isinstance(model, str) else model
    found = None
    if est_mod.loader.framework_of(loaded) == "torch":
        found = importlib.import_module("distmem.estimate.torch.units").fsdp_units(loaded, units)
    elif units is not None or param_dtype is not None:
        raise ConfigError("units= and param_dtype= describe FSDP2 (torch's fully_shard); this model is a Keras model")
    for prec in precisions:
        opts = dict(estimate_options)
        if device is not None:
            opts["device"] = device
        if param_dtype is not None:
            opts["param_dtype"] = param_dtype
        # a spec is measured by a child that rebuilds it under each precision; a live model as it is
        est = est_mod.estimate(model if isinstance(model, str) and method != "model" else loaded,
                               batch_size=batch_size, optimizer=optimizer, input_shape=input_shape,
                               precision=prec, method=method, **opts)
        out[prec] = EstimateCosts(est, units=found)
    return out


def fit(model: Any = None, *, global_batch_size: int, gpus: Any, hosts: Optional[int] = None,
        framework: Optional[str] = None, precision: Any = "auto", optimizer: Any = "adam",
        input_shape: Any = None, layers: Optional[Sequence[Any]] = None, layers_batch_size: Optional[int] = None,
        costs: Optional[Dict[str, Costs]] = None, estimate_batch_size: Optional[int] = None,
        device: Optional[str] = None, name: Optional[str] = None, estimate: str = "auto", units: Any = None,
        example_input: Any = None, loss: Any = "auto", **options: Any) -> FitResult:
    """Which layouts of ``model`` at ``global_batch_size`` fit every rank of ``hosts`` hosts of
    ``gpus`` (``"8x80GiB"`` per host, an Inventory, or a list of Gpu), best first.

    The model is a torch module, a Keras model or a spec (``"torchvision:resnet50"``,
    ``"keras:ResNet50"``, ``"pkg.mod:factory"``), estimated once per precision
    (``precision="auto"`` tries float32 and mixed_bfloat16); or ``layers=`` a LayerCost list (or
    dicts) for ONE sample batch of ``layers_batch_size``. Other options go to :func:`solve_fit`
    (``headroom``, ``reserve``, ``overhead``, ``foreign``, ``schedules``, ``recompute``,
    ``ranks_per_gpu``, ``pipelines``, ``micro_batches``, ``nccl``, ``nccl_buffsize``, ``top``,
    ``rejected``). ``estimate``: how the model is estimated (``"auto"``: measured where the hardware
    is at hand, ``"measure"``, ``"model"``). ``units``: the FSDP2 units of a torch model (class names,
    module paths or a policy callable; default its repeated block), as ``fully_shard`` is applied."""
    gl, source, hosts = _gpus_of(gpus, hosts)
    from ..request import refuse_framework_mismatch

    refuse_framework_mismatch(framework, model)  # before anything is estimated, where the model says
    precisions = precision_choices(precision)
    if isinstance(options.get("wrapper"), str):
        # a replicating wrapper by name, as the strategies take it ("ddp", "ddp_bucket_view",
        # "horovod", "tf_distribute", "none"); its degree is each layout's data parallelism
        from ..wrappers import plan_wrapper

        options["wrapper"] = plan_wrapper(options["wrapper"], world_size=2, on_gpu=True, env={},
                                          framework=framework or "")
    if costs is None:
        if (model is None) == (layers is None):
            raise ConfigError("fit needs exactly one of model= (a torch/Keras model or a spec such as "
                              "'torchvision:resnet50') or layers=[LayerCost, ...] with layers_batch_size=")
        if layers is not None:
            from ..partition import layers_from_dicts

            if len(precisions) != 1:
                precisions = [precisions[0]]
            rows = layers_from_dicts(layers)
            costs = {precisions[0]: LayerListCosts(rows, int(layers_batch_size or 1), precision=precisions[0],
                                                   framework=framework or "torch")}
        else:
            b = estimate_batch_size or max(1, min(8, global_batch_size))
            more = {k: v for k, v in (("example_input", example_input), ("loss", loss))
                    if v is not None and not (k == "loss" and v == "auto")}
            costs = costs_from_model(model, precisions, optimizer=optimizer, input_shape=input_shape,
                                     batch_size=b, device=device, method=estimate, units=units, **more)
    fw = next(iter(costs.values())).framework
    refuse_framework_mismatch(framework, model, fw)  # a module:factory spec says it once built
    fw = framework or fw
    label = name or (model if isinstance(model, str) else type(model).__name__ if model is not None else "layers")
    return solve_fit(costs, global_batch_size=global_batch_size, gpus=gl, hosts=hosts, model_name=str(label),
                     framework=fw, fleet=source if not isinstance(gpus, str) else gpus, **options)


def fit_without_costs(model: Any = None, **kwargs: Any) -> FitResult:
    """:func:`fit`, its result without the per-precision costs (they hold the estimator's replay
    functions): what a child process hands back to ``strategy="auto"``."""
    result = fit(model, **kwargs)
    result.costs = {}
    return result
