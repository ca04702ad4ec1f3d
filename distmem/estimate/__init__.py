"""Per-layer memory estimates of a training step: Keras models (analytic rules replayed over the
layer graph) and torch modules (one step simulated on the meta device). No GPU needed.

>>> est = estimate(model, batch_size=64, optimizer="adam")
>>> est.peak_bytes                        # allocator peak of one training step
>>> est.footprint_bytes("torch")          # what a GPU memory limit must allow
>>> est.layer_costs()                     # List[LayerCost] for the partitioners
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..console import progress
from ..errors import ConfigError

from .keras import estimate_keras
from .torch import estimate_torch
from .loader import framework_of, load_model, parse_shape, spec_framework
from .precision import Precision, resolve_precision
from .table import Estimate, LayerEstimate

__all__ = ["estimate", "estimate_keras", "estimate_torch", "load_model", "Estimate", "LayerEstimate",
           "Precision", "resolve_precision"]


def estimate(model: Any, batch_size: Optional[int] = None, optimizer: Any = "adam", *, input_shape: Any = None,
             method: str = "auto", measurement: Optional[Dict[str, Any]] = None, **options: Any) -> Estimate:
    """Estimate a Keras model, a ``torch.nn.Module`` or a spec (``"keras:ResNet50"``,
    ``"torchvision:resnet50"``, ``"hf:gpt2"``, ``"module.path:factory"``) at ``batch_size`` (None:
    the batch of ``example_input=`` where one is given, else 32).

    ``method``: ``"auto"`` (default) measures where it can — Keras: real training steps at
    ``batch_size`` where its step fits the memory at hand (``memory_at_hand=`` bytes, default half
    the host's available memory on CPU, 90% of the GPU's free memory), with a quarter and a half of
    it, else at the three largest batches that fit, carried to ``batch_size``
    (:class:`~distmem.estimate.measure.extrapolate.Ladder`); torch: two small batches
    (:func:`~distmem.estimate.measure.extrapolate.measure_batches`) carried by the model — and
    falls back to the model alone where it cannot (no GPU for torch, a step that does not run),
    saying so in a warning and in ``Estimate.measurement``. ``Estimate.bound()`` says which it was
    and how far the real peak can be from the figure;
    ``"measure"`` measures or raises; ``"model"`` never runs the model (Keras: analytic, torch:
    simulated on the meta device). Where the measured steps run: a spec in a child process that
    rebuilds it (before this process's framework starts a GPU); a live Keras model in this process
    (weights restored); a live torch module in a forked child before CUDA starts here, on a copy
    after. A measurement is cached by what determines it (``measure.cache``), so the same call
    gives the same bytes; ``measurement=`` (an earlier ``Estimate.measurement``) reuses one made
    elsewhere, e.g. on another rank.

    Keyword options go to :func:`estimate_keras` or :func:`estimate_torch` (``precision=``,
    ``device=``, ``example_input=``...)."""
    from .measure.measured import METHODS, measured_estimate
    if method not in METHODS:
        raise ConfigError(f"method={method!r}: use one of {', '.join(METHODS)} ('auto' measures where it can)")
    progress(f"estimating {options.get('name') or (model if isinstance(model, str) else type(model).__name__)} at "
             f"batch {batch_size}" + (f", {options['precision']}" if options.get("precision") else "")
             + {"auto": " (a few training steps measured where the hardware allows, else the model)",
                "measure": " (a few training steps measured)", "model": " (the model alone)"}[method])
    shape = parse_shape(input_shape)
    spec = model if isinstance(model, str) else None
    built: Dict[str, Any] = {}

    def loaded() -> Any:
        if "model" not in built:
            built["model"] = load_model(model, shape)
        return built["model"]
    framework = spec_framework(spec) if spec is not None else framework_of(model)
    if framework is None:  # a factory: what it returns decides
        framework = framework_of(loaded())
    if batch_size is None and framework == "torch" and options.get("example_input") is not None:
        from .torch.inputs import example_batch
        batch_size = example_batch(model if spec is None else None, options["example_input"],
                                   options.get("batch_dim", 0))
    batch_size = 32 if batch_size is None else batch_size

    def prior(device: str, allocator_floor: Optional[int] = None, partial: bool = False) -> Estimate:
        m = loaded()
        opts = {k: v for k, v in options.items() if k != "memory_at_hand"}
        if framework == "torch":
            dev = "cpu" if device == "cpu" else "cuda"
            try:
                return estimate_torch(m, batch_size=batch_size, optimizer=optimizer, input_shape=shape,
                                      **dict(opts, device=dev))
            except ConfigError as exc:
                if not partial:
                    raise ConfigError(f"{exc}; a GPU measures such a model: estimate it where one is visible "
                                      "(method='auto' or 'measure')") from None
                from .torch.estimate import state_estimate
                return state_estimate(m, batch_size=batch_size, optimizer=optimizer, device=dev,
                                      precision=options.get("precision"), name=options.get("name"), why=str(exc))
        if allocator_floor is not None:
            opts["allocator_floor"] = allocator_floor
        return estimate_keras(m, batch_size=batch_size, optimizer=optimizer,
                              **dict(opts, device="cpu" if device == "cpu" else "gpu"))
    # a spec is measured by a child that rebuilds it; a live model where it lives
    return measured_estimate(framework, model if spec is None else None, spec, int(batch_size), optimizer,
                             options, shape, method, measurement, prior)
