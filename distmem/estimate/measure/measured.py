"""The measured estimate: real steps where they can run — at the target batch where its step fits
the memory at hand (Keras), at small batches otherwise — carried to other batches (``carry``) by a
rule that must agree with what the model can physically hold, and the model alone where nothing can
be measured (said so). Every figure carries its :class:`~distmem.estimate.table.Bound`. A spec is
measured by a child process that rebuilds it (``child``, its arguments made ``portable``)."""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Dict, Optional

from ...console import progress
from ...errors import ConfigError
from ..table import Estimate, path_margin
from . import cache
from .carry import with_measurement
from .extrapolate import measure_batches
from .portable import portable, portable_options

__all__ = ["METHODS", "MEASURE_STEPS", "PLANS", "measured_estimate", "measure", "measure_keras", "keras_ladder"]

METHODS = ("auto", "measure", "model")

#: Steps measured per small batch of the fixed plan (torch); the largest peak is kept (the first
#: included, as the accuracy benchmark's reference keeps it).
MEASURE_STEPS = 2

#: What each framework measures: ``"ladder"`` — the target batch where it fits the memory at hand,
#: with a quarter and a half of it, else the three largest that fit (``extrapolate.Ladder``);
#: ``"small"`` — a quarter and a half of the target (``extrapolate.measure_batches``), which torch's
#: benchmark chose (its figures: bench/results/estimate_heldout_torch.json).
PLANS = {"keras": "ladder", "torch": "small"}

#: Bump when what a measurement means changes, so older cached ones are not reused.
_FORMAT = 3


def _versions(framework: str) -> str:
    try:
        if framework == "torch":
            import torch
            return f"torch {torch.__version__}"
        import tensorflow as tf
        return f"tensorflow {tf.__version__}"
    except ImportError:
        return "?"


def _fw(framework: str) -> str:
    return "torch" if framework == "torch" else "keras"


def _key(framework: str, model: Any, plan: Dict[str, Any], optimizer: Any, opts: Dict[str, Any],
         input_shape: Any) -> str:
    from .cache import measurement_key, model_fingerprint
    from .cache import code_fingerprint
    return measurement_key(format=_FORMAT, framework=framework, version=_versions(framework),
                           model=model_fingerprint(model), plan=repr(sorted(plan.items())),
                           optimizer=portable(optimizer, "optimizer"),
                           precision=opts.get("precision"), loss=code_fingerprint(opts.get("loss", "auto")),
                           steps=MEASURE_STEPS, input_shape=list(input_shape or ()),
                           example=_example_text(opts.get("example_input")),
                           where=_where(framework, model),
                           **{k: repr(opts[k]) for k in ("param_dtype", "batch_dim") if opts.get(k) is not None})


def _where(framework: str, model: Any) -> str:
    """The device a measurement would run on, as far as it is known without starting a framework:
    a live Keras model's (TensorFlow runs already), else the GPUs this process may see."""
    if framework == "keras" and not isinstance(model, str):
        from .keras_steps import keras_device
        return keras_device()
    return "CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "*")


def _example_text(example: Any) -> str:
    if example is None:
        return ""
    if callable(example) and not hasattr(example, "shape"):
        from .cache import code_fingerprint
        return code_fingerprint(example)
    if hasattr(example, "shape"):
        return f"{tuple(example.shape)}:{getattr(example, 'dtype', '')}"
    if isinstance(example, dict):
        return repr({k: _example_text(v) for k, v in sorted(example.items())})
    if isinstance(example, (list, tuple)):
        return repr([_example_text(v) for v in example])
    return repr(example)


# ------------------------------------------------------------------ measuring

def _plan(framework: str, batch_size: int, opts: Dict[str, Any]) -> Dict[str, Any]:
    if PLANS[_fw(framework)] == "ladder":
        plan: Dict[str, Any] = {"kind": "ladder", "target": int(batch_size)}
        if opts.get("memory_at_hand") is not None:
            from ...units import parse_bytes
            plan["memory"] = parse_bytes(opts["memory_at_hand"], what="memory_at_hand")
        return plan
    return {"kind": "small", "batches": list(measure_batches(batch_size))}


def measure(framework: str, model: Any, spec: Optional[str], plan: Dict[str, Any], optimizer: Any,
            opts: Dict[str, Any], input_shape: Any) -> Dict[str, Any]:
    """Real steps as ``plan`` says: a spec in a child process that rebuilds it (started before this
    process's framework touches a GPU), a live model where it lives (``keras_steps``,
    ``torch_steps``). ``{"device", "points": [[batch, peak], ...], "how", "seconds", ...}``."""
    t0 = time.time()
    progress(_saying(plan) + (" in a child process" if spec is not None else ""))
    if spec is not None:
        from .. import isolated
        got = isolated.call("distmem.estimate.measure.child:measure_spec",
                            dict(model=spec, framework=framework, plan=plan,
                                 optimizer=portable(optimizer, "optimizer"), options=portable_options(opts),
                                 input_shape=input_shape), hide_gpus=False)
        how = f"a child process rebuilt {spec} and ran its training steps"
    elif framework == "torch":
        from .torch_steps import measure_torch
        got = measure_torch(model, plan["batches"], example_input=opts.get("example_input"), input_shape=input_shape,
                            input_dtype=opts.get("input_dtype"), batch_dim=opts.get("batch_dim", 0),
                            optimizer=optimizer, precision=opts.get("precision"), loss=opts.get("loss", "auto"),
                            steps=MEASURE_STEPS, param_dtype=opts.get("param_dtype"))
        how = got.get("in_process") or (f"a spawned child rebuilt the module from its state and code and ran "
                                        f"{MEASURE_STEPS} training steps per batch on the GPU, on the inputs as given")
    else:
        got = measure_keras(model, plan, optimizer, opts, input_shape)
        how = "training steps of the model itself in this process (weights restored)"
    return {"device": got["device"], "points": [[int(b), int(got["peaks"][b])] for b in sorted(got["peaks"])],
            "steps": {str(b): v for b, v in got["steps"].items()}, "how": how, "loss": got.get("loss"),
            "gpu": got.get("gpu"), "floor": int(got.get("floor") or 0), "ladder": got.get("ladder"),
            "seconds": round(time.time() - t0, 3)}


def _saying(plan: Dict[str, Any]) -> str:
    if plan["kind"] == "ladder":
        return (f"measuring training steps at batch {plan['target']} where its step fits the memory at hand, "
                "else at the largest batches that fit")
    return f"measuring {MEASURE_STEPS} training steps at batch {' and '.join(map(str, plan['batches']))}"


def measure_keras(model: Any, plan: Dict[str, Any], optimizer: Any, opts: Dict[str, Any],
                  input_shape: Any) -> Dict[str, Any]:
    """A Keras model's steps as ``plan`` says, here (in this process or the measuring child)."""
    from .keras_steps import keras_step_peaks
    precision = opts.get("precision")
    if precision:
        from ..keras.graph import policy_precision
        from ..precision import resolve_precision
        asked, own = resolve_precision(precision).name, policy_precision(model).name
        if asked != own:
            raise ConfigError(f"precision={precision!r} asks for {asked}, but the model's layers compute in {own}: its "
                              f"steps cannot show {asked}; build it under keras.mixed_precision.set_global_policy"
                              f"({asked!r}) or give a spec (it is rebuilt under the precision)")
    if plan["kind"] == "ladder":
        batches: Any = keras_ladder(model, plan["target"], optimizer, precision=precision,
                                    memory_given=plan.get("memory"))
    else:
        batches = plan["batches"]
    return keras_step_peaks(model, batches, optimizer, precision=precision, input_shape=input_shape)


def measured_estimate(framework: str, model: Any, spec: Optional[str], batch_size: int, optimizer: Any,
                      opts: Dict[str, Any], input_shape: Any, method: str, measurement: Optional[Dict[str, Any]],
                      prior_fn: Callable[..., Estimate]) -> Estimate:
    """The estimate ``method`` asks for. ``prior_fn(device, allocator_floor=None, partial=False)``:
    the model's estimate for a device (``"cpu"``, ``"gpu"``/``"cuda"``; ``allocator_floor``: the
    bytes below which the measured device's statistics skip a buffer; ``partial``: the model's state
    alone where its step cannot be modelled, marked ``model_ran=False``). Falls back to the model under ``"auto"``
    when nothing can be measured, with the reason in a warning and in
    ``Estimate.measurement["fallback"]``."""
    device = opts.get("device") or ("cuda" if framework == "torch" else "gpu")
    if method == "model":
        return prior_fn(device)
    plan = _plan(framework, batch_size, opts)
    key = _key(framework, spec if spec is not None else model, plan, optimizer, opts, input_shape)
    try:  # first, so that a spec's child measures before this process builds the model
        got = _obtain(framework, model, spec, plan, optimizer, opts, input_shape, key, measurement)
    except ConfigError as exc:
        if method == "measure":
            raise
        target = prior_fn(device)
        note = f"not measured ({exc}); the estimate is the model's alone"
        target.warnings.append(note)
        target.measurement = {"fallback": str(exc), "method_asked": method}
        warnings.warn(f"distmem.estimate: {note}", stacklevel=3)
        return target
    on = "cpu" if str(got["device"]).upper().startswith("CPU") else ("cuda" if framework == "torch" else "gpu")
    try:
        target = _prior_or_why(prior_fn, device)
        prior = target if _same_device(on, target.device) and not got.get("floor") else \
            _prior_or_why(prior_fn, on, allocator_floor=int(got.get("floor") or 0))
    except ConfigError as exc:  # a model the model path cannot read (a subclassed Keras model)
        from ..keras.estimate import weights_only_estimate
        if framework == "torch" or model is None:
            raise
        target = weights_only_estimate(model, batch_size, optimizer, device=device, reason=str(exc),
                                       name=opts.get("name"))
        prior = target
    return with_measurement(target, prior, got)


def _prior_or_why(prior_fn: Callable[..., Estimate], device: str, **kw: Any) -> Estimate:
    """The model's estimate; where the model cannot run (a step the simulation cannot take), the
    model's state alone (``prior_fn(device, partial=True)``), marked ``model_ran=False``."""
    import inspect
    try:
        return prior_fn(device, **kw)
    except ConfigError:
        if "partial" not in inspect.signature(prior_fn).parameters:
            raise
        return prior_fn(device, partial=True, **kw)


def _same_device(a: str, b: str) -> bool:
    return (a == "cpu") == (str(b).lower() == "cpu")


def _obtain(framework, model, spec, plan, optimizer, opts, input_shape, key, measurement):
    if measurement is not None:
        if measurement.get("key") != key:
            raise ConfigError(f"the measurement given (key {measurement.get('key')}) is of another model, batch, "
                              f"optimizer or precision than this estimate (key {key}); measure again")
        return dict(measurement, reused=True)
    got = cache.load(key)
    if got is not None:
        return dict(got, reused=True)
    got = measure(framework, model, spec, plan, optimizer, opts, input_shape)
    got["key"] = key
    cache.store(key, got)
    return dict(got, reused=False)


def keras_ladder(model: Any, target: int, optimizer: Any, *, precision: Any = None,
                 memory_given: Optional[int] = None) -> Ladder:
    """The :class:`~distmem.estimate.measure.extrapolate.Ladder` for measuring ``model`` at
    ``target`` here: the memory at hand on the device TensorFlow uses, and the analytic model's
    high figure there (its held-out worst under-estimate added) until something is measured; a
    model the analytic path cannot read (a subclassed one) is tried at the target."""
    import warnings

    from ..keras import estimate_keras
    from .extrapolate import Ladder
    from .keras_steps import keras_allocator_floor, keras_device
    from .memory import memory_at_hand
    dev = keras_device()
    memory, where = memory_at_hand(dev, memory_given)
    if memory <= 0:
        memory, where = 2 ** 62, f"unknown ({where})"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prior = estimate_keras(model, batch_size=target, optimizer=optimizer, precision=precision,
                                   device="cpu" if dev.upper().startswith("CPU") else "gpu",
                                   allocator_floor=keras_allocator_floor(dev))
        under = path_margin("keras", "modelled").under

        def predict_high(b: int) -> int:
            return int(prior.train_bytes(b) * (1 + under))
    except ConfigError:
        def predict_high(b: int) -> int:
            return 0
    ladder = Ladder(target, memory, predict_high)
    ladder.memory_source = where
    return ladder
