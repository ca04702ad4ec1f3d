"""The measured estimate: real steps at small batches where they can run, the model carrying them to
the target batch (``extrapolate``), the model alone where nothing can be measured (said so)."""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from ...console import progress
from ...errors import ConfigError
from ..table import Estimate, LayerEstimate
from . import cache
from .extrapolate import RULE, extrapolate, measure_batches, residual_terms

__all__ = ["METHODS", "MEASURE_STEPS", "measured_estimate", "measure", "with_measurement"]

METHODS = ("auto", "measure", "model")

#: Steps measured per small batch; the largest peak is kept (the first included, as the accuracy
#: benchmark's reference keeps it).
MEASURE_STEPS = 2

#: Bump when what a measurement means changes, so older cached ones are not reused.
_FORMAT = 1


def _versions(framework: str) -> str:
    try:
        if framework == "torch":
            import torch
            return f"torch {torch.__version__}"
        import tensorflow as tf
        return f"tensorflow {tf.__version__}"
    except ImportError:
        return "?"


def _key(framework: str, model: Any, batches: Sequence[int], optimizer: Any, opts: Dict[str, Any],
         input_shape: Any) -> str:
    from .cache import measurement_key, model_fingerprint
    from .cache import code_fingerprint
    return measurement_key(format=_FORMAT, framework=framework, version=_versions(framework),
                           model=model_fingerprint(model), batches=list(batches), optimizer=optimizer,
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


def measure(framework: str, model: Any, spec: Optional[str], batches: Sequence[int], optimizer: Any,
            opts: Dict[str, Any], input_shape: Any) -> Dict[str, Any]:
    """Real steps at ``batches``: a spec in a child process that rebuilds it (started before this
    process's framework touches a GPU), a live model where it lives (``keras_steps``,
    ``torch_steps``). ``{"device", "points": [[batch, peak], ...], "how", "seconds", ...}``."""
    t0 = time.time()
    progress(f"measuring {MEASURE_STEPS} training steps at batch {' and '.join(map(str, batches))}"
             + (" in a child process" if spec is not None else ""))
    if spec is not None:
        from .. import isolated
        got = isolated.call("distmem.estimate.measure.child:measure_spec",
                            dict(model=spec, framework=framework, batches=list(batches), optimizer=optimizer,
                                 options=_picklable(opts), input_shape=input_shape), hide_gpus=False)
        how = f"a child process rebuilt {spec} and ran {MEASURE_STEPS} training steps per batch"
    elif framework == "torch":
        from .torch_steps import measure_torch
        got = measure_torch(model, batches, example_input=opts.get("example_input"), input_shape=input_shape,
                            input_dtype=opts.get("input_dtype"), batch_dim=opts.get("batch_dim", 0),
                            optimizer=optimizer, precision=opts.get("precision"), loss=opts.get("loss", "auto"),
                            steps=MEASURE_STEPS, param_dtype=opts.get("param_dtype"))
        how = got.get("in_process") or (f"a spawned child rebuilt the module from its state and code and ran "
                                        f"{MEASURE_STEPS} training steps per batch on the GPU, on the inputs as given")
    else:
        from .keras_steps import keras_step_peaks
        got = keras_step_peaks(model, batches, optimizer, steps=MEASURE_STEPS, precision=opts.get("precision"))
        how = f"{MEASURE_STEPS} training steps per batch of the model itself in this process (weights restored)"
    return {"device": got["device"], "points": [[int(b), int(got["peaks"][b])] for b in sorted(got["peaks"])],
            "steps": {str(b): v for b, v in got["steps"].items()}, "how": how, "loss": got.get("loss"),
            "gpu": got.get("gpu"), "seconds": round(time.time() - t0, 3)}


def _picklable(opts: Dict[str, Any]) -> Dict[str, Any]:
    import pickle
    out = {k: v for k, v in opts.items() if k in ("precision", "loss", "input_dtype", "param_dtype")}
    if callable(out.get("loss")):
        try:
            pickle.dumps(out["loss"])
        except Exception:  # noqa: BLE001 - a lambda or a closure: the child cannot import it
            raise ConfigError("the loss function cannot be sent to the measuring child of a model spec (a lambda or "
                              "a function inside a function); define it at module level, or use method='model'") \
                from None
    return out


def measured_estimate(framework: str, model: Any, spec: Optional[str], batch_size: int, optimizer: Any,
                      opts: Dict[str, Any], input_shape: Any, method: str, measurement: Optional[Dict[str, Any]],
                      prior_fn: Callable[[str], Estimate]) -> Estimate:
    """The estimate ``method`` asks for. ``prior_fn(device)``: the model's estimate for a device
    (``"cpu"``, ``"gpu"``/``"cuda"``). Falls back to the model under ``"auto"`` when nothing can be
    measured, with the reason in a warning and in ``Estimate.measurement["fallback"]``."""
    device = opts.get("device") or ("cuda" if framework == "torch" else "gpu")
    if method == "model":
        return prior_fn(device)
    batches = measure_batches(batch_size)
    key = _key(framework, spec if spec is not None else model, batches, optimizer, opts, input_shape)
    try:  # first, so that a spec's child measures before this process builds the model
        got = _obtain(framework, model, spec, batches, optimizer, opts, input_shape, key, measurement)
    except ConfigError as exc:
        if method == "measure":
            raise
        target = prior_fn(device)
        note = f"not measured ({exc}); the estimate is the model's alone"
        target.warnings.append(note)
        target.measurement = {"fallback": str(exc), "method_asked": method}
        warnings.warn(f"distmem.estimate: {note}", stacklevel=3)
        return target
    target = _prior_or_why(prior_fn, device)
    on = "cpu" if str(got["device"]).upper().startswith("CPU") else ("cuda" if framework == "torch" else "gpu")
    prior = target if _same_device(on, target.device) else prior_fn(on)
    return with_measurement(target, prior, got)


def _prior_or_why(prior_fn: Callable[[str], Estimate], device: str) -> Estimate:
    """The model's estimate; where the model cannot run (a step the simulation cannot take), the
    model's state alone (``prior_fn(device, partial=True)``), marked ``model_ran=False``."""
    import inspect
    try:
        return prior_fn(device)
    except ConfigError:
        if "partial" not in inspect.signature(prior_fn).parameters:
            raise
        return prior_fn(device, partial=True)  # type: ignore[call-arg]


def _same_device(a: str, b: str) -> bool:
    return (a == "cpu") == (str(b).lower() == "cpu")


def _obtain(framework, model, spec, batches, optimizer, opts, input_shape, key, measurement):
    if measurement is not None:
        if measurement.get("key") != key:
            raise ConfigError(f"the measurement given (key {measurement.get('key')}) is of another model, batch, "
                              f"optimizer or precision than this estimate (key {key}); measure again")
        return dict(measurement, reused=True)
    got = cache.load(key)
    if got is not None:
        return dict(got, reused=True)
    got = measure(framework, model, spec, batches, optimizer, opts, input_shape)
    got["key"] = key
    cache.store(key, got)
    return dict(got, reused=False)


def with_measurement(target: Estimate, prior: Estimate, got: Dict[str, Any]) -> Estimate:
    """``target`` (the model at the job's device) carried by the residual of ``prior`` (the model
    at the measured device) against the measured points: peaks, breakdowns and rows. Where the
    model could not run the step (``model_ran`` False) or guessed values the step reads
    (``data_dependent``), the measured points' own line (rule ``measured``)."""
    rule = RULE["torch" if target.framework == "torch" else "keras"]
    trusted = getattr(prior, "model_ran", True) and not getattr(prior, "data_dependent", False)
    if not trusted:
        # the model could not run the step, or ran it on values it had to guess: the measured
        # points' own line, the model kept for the state and the table
        rule = "measured"
    points = [(int(b), int(y), int(prior.train_bytes(int(b)) if trusted else 0)) for b, y in got["points"]]
    terms = residual_terms(points, rule)

    def peak_fn(batch: int, train: bool) -> Dict[str, Any]:
        detail = target.peak_detail(batch) if train else {"peak": target.inference_bytes(batch)}
        if train:
            detail["modelled_peak"] = int(detail["peak"])
            detail["peak"] = max(0, extrapolate(terms, int(detail["peak"]), batch))
        return detail

    def parts_fn(batch: int) -> Dict[str, int]:
        parts = target.breakdown(batch)
        parts["measured, not modelled"] = peak_fn(batch, True)["peak"] - sum(parts.values())
        return parts

    fixed = int(round(terms["fixed"]))
    measurement = dict(got, rule=rule, terms=terms,
                       modelled=[[b, m] for b, _, m in points], measured_on=got["device"],
                       prior="the model" if trusted else getattr(prior, "why_not_modelled", "") or
                       "none: the model read values it does not have")
    est = Estimate(framework=target.framework, model=target.model, batch_size=target.batch_size,
                   precision=target.precision, optimizer=target.optimizer,
                   layers=_rows(target.layers, terms), method="measured", device=target.device,
                   input_bytes_per_sample=target.input_bytes_per_sample, warnings=list(target.warnings),
                   extra_persistent_bytes=target.extra_persistent_bytes + max(0, fixed),
                   _peak_fn=peak_fn, _parts_fn=parts_fn)
    est.measurement = measurement
    return est


def _rows(rows: List[LayerEstimate], terms: Dict[str, float]) -> List[LayerEstimate]:
    """Table rows with the measured per-sample residual (and a ratio's share) spread over the rows'
    kept activations in proportion to them, so stage sums follow the measured slope."""
    from dataclasses import replace
    ratio, per_sample = float(terms["ratio"]), float(terms["per_sample"])
    total = sum(r.activation_bytes_per_sample for r in rows)
    out = []
    for r in rows:
        share = r.activation_bytes_per_sample / total if total else 0.0
        ps = r.activation_bytes_per_sample * ratio + per_sample * share
        out.append(replace(r, activation_bytes_per_sample=max(0, int(round(ps))),
                           activation_fixed_bytes=max(0, int(round(r.activation_fixed_bytes * ratio)))))
    return out
