"""The measured estimate: real steps where they can run — at the target batch where its step fits
the memory at hand (Keras), at small batches otherwise — carried to other batches by a rule
(``extrapolate``) that must agree with what the model can physically hold, and the model alone
where nothing can be measured (said so). Every figure carries its :class:`~distmem.estimate.table.Bound`."""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from ...errors import ConfigError
from ...units import format_bytes
from ..table import Bound, Estimate, LayerEstimate, path_margin
from . import cache
from .extrapolate import (RULE, extrapolate, least_squares, measure_batches, physical_interval,
                          residual_terms)

__all__ = ["METHODS", "MEASURE_STEPS", "CARRY_RULE", "PLANS", "measured_estimate", "measure", "with_measurement",
           "portable", "rebuild", "keras_ladder"]

METHODS = ("auto", "measure", "model")

#: Steps measured per small batch of the fixed plan (torch); the largest peak is kept (the first
#: included, as the accuracy benchmark's reference keeps it).
MEASURE_STEPS = 2

#: What each framework measures: ``"ladder"`` — the target batch where it fits the memory at hand,
#: with a quarter and a half of it, else the three largest that fit (``extrapolate.Ladder``);
#: ``"small"`` — a quarter and a half of the target (``extrapolate.measure_batches``), which torch's
#: benchmark chose (its figures: bench/results/estimate_heldout_torch.json).
PLANS = {"keras": "ladder", "torch": "small"}

#: The rule a framework carries its measured points with once it has three or more of them (chosen
#: on the fit half of its benchmark, docs/estimate.md); with fewer, :data:`extrapolate.RULE`.
CARRY_RULE = {"keras": "lsq", "torch": "blend"}

#: Where the figure and the model's disagree by more than this factor either way, a warning names
#: both: the model does not see part of what this model does.
DISAGREEMENT = 2.0

#: Where the model's difference between the measured device and the target's is more than this
#: share of a figure, the figure counts as modelled, not measured.
MODEL_SHARE = 0.25

#: Bump when what a measurement means changes, so older cached ones are not reused.
_FORMAT = 2


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
    return measurement_key(format=_FORMAT, framework=framework, version=_versions(framework),
                           model=model_fingerprint(model), plan=repr(sorted(plan.items())),
                           optimizer=portable(optimizer, "optimizer"),
                           precision=opts.get("precision"), loss=opts.get("loss", "auto"),
                           input_shape=list(input_shape or ()),
                           example=_example_text(opts.get("example_input")),
                           where=_where(framework, model))


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
    if hasattr(example, "shape"):
        return f"{tuple(example.shape)}:{getattr(example, 'dtype', '')}"
    if isinstance(example, dict):
        return repr({k: _example_text(v) for k, v in sorted(example.items())})
    if isinstance(example, (list, tuple)):
        return repr([_example_text(v) for v in example])
    return repr(example)


# ------------------------------------------------------------------ arguments for a child process

def portable(value: Any, what: str) -> Any:
    """``value`` as something a child process can rebuild: itself where it is plain data (a name,
    a number, a class by its import path), ``{"distmem_rebuild": "module:Class", "config": ...}``
    for an object with a ``get_config()`` its class rebuilds (a Keras optimizer or loss: the live
    object holds weak references and variables, so it cannot be pickled), a function by its import
    path. Anything else is refused with the argument named (``what``)."""
    import pickle
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(portable(v, what) for v in value)
    if isinstance(value, dict) and "distmem_rebuild" not in value:
        return {k: portable(v, what) for k, v in value.items()}
    cls = type(value)
    get_config = getattr(value, "get_config", None)
    if callable(get_config) and hasattr(cls, "from_config") and not isinstance(value, type):
        try:
            cfg = get_config()
            pickle.dumps(cfg)
            return {"distmem_rebuild": f"{cls.__module__}:{cls.__qualname__}", "config": cfg}
        except Exception:  # noqa: BLE001 - a configuration that is not plain data: tried as it is below
            pass
    if isinstance(value, type) or callable(value):
        name = getattr(value, "__qualname__", "")
        module = getattr(value, "__module__", "")
        if module and name and "<" not in name:
            return {"distmem_rebuild": f"{module}:{name}"}
    try:
        pickle.dumps(value)
        return value
    except Exception as exc:  # noqa: BLE001 - said with the argument's name
        raise ConfigError(f"{what}={value!r} cannot be sent to the process that measures a model spec "
                          f"({type(exc).__name__}: {exc}); give it by name (e.g. optimizer='adam'), as an object "
                          f"with get_config(), or build the model and pass it (it is then measured in this "
                          f"process)") from None


def rebuild(value: Any) -> Any:
    """The object :func:`portable` described (in the child)."""
    import importlib
    if isinstance(value, list):
        return [rebuild(v) for v in value]
    if isinstance(value, tuple):
        return tuple(rebuild(v) for v in value)
    if isinstance(value, dict) and "distmem_rebuild" in value:
        module, _, name = value["distmem_rebuild"].partition(":")
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj.from_config(value["config"]) if "config" in value else obj
    if isinstance(value, dict):
        return {k: rebuild(v) for k, v in value.items()}
    return value


def _portable_opts(opts: Dict[str, Any]) -> Dict[str, Any]:
    return {k: portable(v, k) for k, v in opts.items() if k in ("precision", "loss", "input_dtype", "memory_at_hand")}


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
    if spec is not None:
        from .. import isolated
        got = isolated.call("distmem.estimate.measure.child:measure_spec",
                            dict(model=spec, framework=framework, plan=plan,
                                 optimizer=portable(optimizer, "optimizer"), options=_portable_opts(opts),
                                 input_shape=input_shape), hide_gpus=False)
        how = f"a child process rebuilt {spec} and ran its training steps"
    elif framework == "torch":
        from ..torch.inputs import example_inputs
        from .torch_steps import measure_torch
        ex, dt = opts.get("example_input"), opts.get("input_dtype")
        got = measure_torch(model, plan["batches"], inputs=lambda b: example_inputs(model, ex, input_shape, b, dt),
                            optimizer=optimizer, precision=opts.get("precision"), loss=opts.get("loss", "auto"),
                            steps=MEASURE_STEPS)
        how = f"{MEASURE_STEPS} training steps per batch of a copy of the module on the GPU"
    else:
        got = measure_keras(model, plan, optimizer, opts, input_shape)
        how = "training steps of the model itself in this process (weights restored)"
    return {"device": got["device"], "points": [[int(b), int(got["peaks"][b])] for b in sorted(got["peaks"])],
            "steps": {str(b): v for b, v in got["steps"].items()}, "how": how, "loss": got.get("loss"),
            "gpu": got.get("gpu"), "floor": int(got.get("floor") or 0), "ladder": got.get("ladder"),
            "seconds": round(time.time() - t0, 3)}


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
    """The estimate ``method`` asks for. ``prior_fn(device, allocator_floor=None)``: the model's
    estimate for a device (``"cpu"``, ``"gpu"``/``"cuda"``; ``allocator_floor``: the bytes below
    which the measured device's statistics skip a buffer). Falls back to the model under ``"auto"``
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
        target = prior_fn(device)
        prior = target if _same_device(on, target.device) and not got.get("floor") else \
            prior_fn(on, allocator_floor=int(got.get("floor") or 0))
    except ConfigError as exc:  # a model the model path cannot read (a subclassed Keras model)
        from ..keras.estimate import weights_only_estimate
        if framework == "torch" or model is None:
            raise
        target = weights_only_estimate(model, batch_size, optimizer, device=device, reason=str(exc),
                                       name=opts.get("name"))
        prior = target
    return with_measurement(target, prior, got)


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


# ------------------------------------------------------------------ from points to an estimate

class _Carry:
    """The figure at any batch from measured points (bytes), with its source and bound: measured
    where a point is, carried by the framework's rule elsewhere — refused, loudly, where the rule's
    figure is outside what the measured points allow (``extrapolate.physical_interval``)."""

    def __init__(self, target: Estimate, prior: Estimate, got: Dict[str, Any]):
        fw = _fw(target.framework)
        self.target, self.prior = target, prior
        self.points: List[Tuple[int, int]] = [(int(b), int(y)) for b, y in got["points"]]
        self.measured = dict(self.points)
        self.modelled = [(b, y, int(prior.train_bytes(b))) for b, y in self.points]
        self.rule = CARRY_RULE[fw] if len(self.points) >= 3 else RULE[fw]
        # the three largest: the affine law holds best nearest the target (BFC regions at tiny batches)
        self.terms = residual_terms(self.modelled[-3:] if len(self.points) >= 3 else self.modelled, self.rule)
        self.moved = prior is not target
        self.on = str(got["device"])
        self.notes: Dict[int, str] = {}
        self._memo: Dict[int, Tuple[int, str, str]] = {}

    def _move(self, batch: int) -> int:
        """What the model says the target device adds over the measured one (bytes)."""
        if self.prior is self.target:
            return 0
        return int(self.target.train_bytes(batch)) - int(self.prior.train_bytes(batch))

    def at(self, batch: int) -> Tuple[int, str, str]:
        """``(bytes, source, note)`` at ``batch``."""
        if batch in self._memo:
            return self._memo[batch]
        floor = self.target.state_floor
        note = ""
        if batch in self.measured:
            value, source = self.measured[batch], "measured"
        else:
            source = "carried"
            value = extrapolate(self.terms, int(self.prior.train_bytes(batch)), batch)
            lo, hi = physical_interval(self.points, batch, self.prior.state_floor)
            if not lo <= value <= hi:
                alpha, beta = least_squares(self.points[-3:])
                line = min(max(int(round(alpha + beta * batch)), lo), hi)
                pts = ", ".join(f"{format_bytes(y)} at batch {b}" for b, y in self.points)
                note = (f"the '{self.rule}' carry to batch {batch} gives {format_bytes(max(value, 0))}, outside "
                        f"what the measured peaks allow ({pts}: {format_bytes(lo)} .. {format_bytes(hi)}); refused, "
                        f"the measured peaks' own line gives {format_bytes(line)}")
                value = line
        if self.moved:
            move = self._move(batch)
            value += move
            if abs(move) > MODEL_SHARE * max(value, 1):
                # what the measured device could not show (buffers below its allocator's floor, another
                # device's kernels) is most of the figure: it is the model's
                source = "modelled"
        value = max(int(value), floor)
        self._memo[batch] = (value, source, note)
        return self._memo[batch]

    def bound(self, batch: int) -> Bound:
        value, source, note = self.at(batch)
        extra = f"measured on {self.on}" + ("; the target device's difference modelled" if self.moved else "")
        if note:
            extra += "; the rule's carry was refused"
        return Bound.around(value, path_margin(self.target.framework, source), source, self.target.state_floor,
                            extra)


def with_measurement(target: Estimate, prior: Estimate, got: Dict[str, Any]) -> Estimate:
    """``target`` (the model at the job's device) with the measured points ``got`` as its figures:
    measured where a point is, carried elsewhere (:class:`_Carry`), each with its bound; peaks,
    breakdowns and rows. ``prior``: the model at the measured device (``target`` itself there)."""
    carry = _Carry(target, prior, got)
    b0 = target.batch_size

    def peak_fn(batch: int, train: bool) -> Dict[str, Any]:
        detail = target.peak_detail(batch) if train else {"peak": target.inference_bytes(batch)}
        if train:
            detail["modelled_peak"] = int(detail["peak"])
            value, source, _ = carry.at(batch)
            detail["peak"], detail["source"] = value, source
        return detail

    def parts_fn(batch: int) -> Dict[str, int]:
        return _parts(target.breakdown(batch), carry.at(batch)[0])

    value, source, note = carry.at(b0)
    modelled = int(target.train_bytes(b0))
    warns = list(target.warnings)
    if note:
        warns.append(note)
        warnings.warn(f"distmem.estimate: {note}", stacklevel=4)
    if modelled and not 1 / DISAGREEMENT <= value / modelled <= DISAGREEMENT:
        warns.append(f"the figure at batch {b0} ({SOURCES_TEXT[source]}, {format_bytes(value)}) is "
                     f"{value / modelled:.2f}x the model's ({format_bytes(modelled)}): the model does not see part of "
                     f"what this model does; the figure is the {source} one")
    ratio = _slope_ratio(carry, target, b0)
    measurement = dict(got, rule=carry.rule, terms=carry.terms, at_target=b0 in carry.measured,
                       modelled=[[b, m] for b, _, m in carry.modelled], measured_on=got["device"])
    if note:
        measurement["refused"] = note
    est = Estimate(framework=target.framework, model=target.model, batch_size=b0,
                   precision=target.precision, optimizer=target.optimizer,
                   layers=_rows(target.layers, ratio), method="measured", device=target.device,
                   input_bytes_per_sample=target.input_bytes_per_sample, warnings=warns,
                   extra_persistent_bytes=target.extra_persistent_bytes + _fixed_excess(carry, target, b0),
                   _peak_fn=peak_fn, _parts_fn=parts_fn, _bound_fn=carry.bound)
    est.measurement = measurement
    return est


SOURCES_TEXT = {"measured": "measured at the target batch", "carried": "carried from measured points",
                "modelled": "modelled"}

#: Parts of a modelled breakdown that do not grow with the batch and are exact (a measurement below
#: the model's figure takes its difference from the others).
_STATE_PARTS = ("weights", "optimizer state", "workspaces")


def _parts(parts: Dict[str, int], value: int) -> Dict[str, int]:
    """The model's breakdown made to sum to the measured ``value``: what the model missed as its own
    part ``measured, not modelled``; what it over-counted taken from the parts that grow with the
    batch, in proportion (never below zero, never from weights or optimizer state)."""
    parts = {k: int(v) for k, v in parts.items()}
    excess = value - sum(parts.values())
    if excess >= 0:
        parts["measured, not modelled"] = excess
        return parts
    movable = {k: v for k, v in parts.items() if k not in _STATE_PARTS and v > 0}
    total = sum(movable.values())
    cut = min(-excess, total)
    for k, v in movable.items():
        parts[k] = v - int(cut * v / total) if total else v
    short = sum(parts.values()) - value
    for k in sorted(movable, key=lambda k: -parts[k]):
        take = min(short, parts[k])
        parts[k] -= take
        short -= take
    if short > 0:  # the figure is at the state floor and the modelled state parts exceed it
        parts["measured, not modelled"] = -short
    return parts


def _slope_ratio(carry: _Carry, target: Estimate, b0: int) -> float:
    """The figure's growth per sample over the model's, near the estimate's batch (1 where either is
    flat or they disagree beyond a factor 4: then the model's rows are kept as they are)."""
    lo = max(1, b0 // 2) if b0 > 1 else 2
    hi = b0 if b0 > 1 else 4
    if hi == lo:
        return 1.0
    dv = carry.at(hi)[0] - carry.at(lo)[0]
    dm = int(target.train_bytes(hi)) - int(target.train_bytes(lo))
    if dv <= 0 or dm <= 0:
        return 1.0
    r = dv / dm
    return r if 0.25 <= r <= 4.0 else 1.0


def _fixed_excess(carry: _Carry, target: Estimate, b0: int) -> int:
    """The part of the figure's excess over the model that does not grow with the batch (bytes, >= 0):
    kept for the process like a workspace."""
    lo = max(1, b0 // 2)
    if lo == b0:
        return max(0, carry.at(b0)[0] - int(target.train_bytes(b0)))
    r_lo = carry.at(lo)[0] - int(target.train_bytes(lo))
    r_hi = carry.at(b0)[0] - int(target.train_bytes(b0))
    slope = (r_hi - r_lo) / (b0 - lo)
    return max(0, int(round(r_lo - slope * lo)))


def _rows(rows: List[LayerEstimate], ratio: float) -> List[LayerEstimate]:
    """Table rows with kept activations per sample scaled by the figure's growth per sample over the
    model's, so stage sums follow the measured slope."""
    if ratio == 1.0:
        return list(rows)
    return [replace(r, activation_bytes_per_sample=max(0, int(round(r.activation_bytes_per_sample * ratio))),
                    activation_fixed_bytes=r.activation_fixed_bytes) for r in rows]


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
