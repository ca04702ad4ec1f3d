"""What an optimizer holds per weight, read from the optimizer object itself.

Slot counts are never looked up by the optimizer's name: the estimator builds a private copy of
the optimizer the user passes (same class, same configuration) on a few small probe weights and
counts the state it creates. A custom optimizer is therefore sized like a built-in one, and Adam
with ``amsgrad=True`` or RMSprop with ``centered=True`` get their extra slots.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ..errors import ConfigError

__all__ = ["OptimizerInfo", "keras_optimizer", "torch_optimizer", "KERAS_UPDATE_TEMPORARIES",
           "KERAS_UPDATE_TEMPORARIES_BY_OPTIMIZER", "keras_update_temporaries",
           "KERAS_EARLY_UPDATE_TEMPORARIES", "keras_early_update_temporaries", "keras_decays_weights",
           "keras_major_version",
           "OPTIMIZER_NAMES"]

#: Weight-sized temporaries alive at once while a Keras optimizer updates one variable. Keras
#: writes its update rules as element-wise framework ops (Adam: ``m * alpha`` and
#: ``sqrt(v) + epsilon`` exist together before the division), and TensorFlow copies a variable
#: whose buffer a pending read still holds before updating it in place. Measured on a single 1M
#: weight Dense layer under Adam (TF 2.15, CPU): peak = weights + m + v + gradient + 2 x weights.
KERAS_UPDATE_TEMPORARIES = 2

#: The same, per optimizer (``bench/estimate/keras_update_temporaries.py``: one 2048 x 2048 Dense layer,
#: peak less weight, slots and gradient, in weights; TensorFlow's BFC CPU allocator, TF 2.15 and
#: 2.21: bench/results/estimate_keras_update_temporaries_tf2*.jsonl), by Keras major version. Plain
#: SGD updates in place (no temporary); momentum holds ``m * momentum`` before the add; Adam and
#: AdamW two; RMSprop two in tf.keras 2 and three in Keras 3 (its rule keeps ``velocity + eps``,
#: its square root and ``lr * g`` together). Keys: class name (``"SGD+momentum"`` for SGD with a
#: non-zero momentum); an optimizer not measured gets :data:`KERAS_UPDATE_TEMPORARIES` (Keras 2) or
#: the largest measured (Keras 3).
KERAS_UPDATE_TEMPORARIES_BY_OPTIMIZER = {
    2: {"SGD": 0, "SGD+momentum": 1, "RMSprop": 2, "Adam": 2, "AdamW": 2},
    3: {"SGD": 0, "SGD+momentum": 1, "RMSprop": 3, "Adam": 2, "AdamW": 2},
}


#: Of those, the ones that do not depend on the gradient (momentum: ``m * momentum``; RMSprop:
#: ``rho * velocity``): TensorFlow's executor runs them when the step starts, so each weight's is
#: alive from then until its update. Seen in the profiler's memory trace: ResNet50 with momentum
#: SGD holds ``SGD/mul`` buffers of the conv5 weights (9 MiB each) while the backward is still at the
#: classifier; MobileNet with RMSprop, 24 MiB of ``RMSprop/mul``/``Square`` at its peak.
KERAS_EARLY_UPDATE_TEMPORARIES = {"SGD+momentum": 1, "RMSprop": 1}


def _keras_update_key(optimizer: Any) -> str:
    name = type(optimizer).__name__
    if name == "SGD":
        momentum = getattr(optimizer, "momentum", 0.0)
        try:
            momentum = float(momentum)
        except (TypeError, ValueError):
            momentum = 1.0  # a schedule or tensor: count the momentum path
        if momentum:
            name = "SGD+momentum"
    return name


def keras_early_update_temporaries(optimizer: Any) -> int:
    """How many of :func:`keras_update_temporaries` exist from the step's start (see above)."""
    return KERAS_EARLY_UPDATE_TEMPORARIES.get(_keras_update_key(optimizer), 0)


def keras_decays_weights(optimizer: Any) -> bool:
    """Whether a Keras optimizer applies decoupled weight decay (``weight_decay`` set: AdamW's
    default, or any Keras optimizer given ``weight_decay=``).

    Keras applies it as ``variable.assign_sub(variable * wd * lr)`` (Keras 2 and 3), which does not
    depend on the gradient: TensorFlow's executor runs it when the step starts. Where the forward's
    read of the variable is still held for the backward (a kernel, whose input gradient reads it),
    the assignment copies the variable first, so a second weight-sized buffer lives until that
    layer's backward. Seen in the profiler's memory trace of ConvNeXtTiny at 64 px under AdamW
    (TF 2.15 CPU): ``AdamW/AssignSubVariableOp`` temporaries, eighteen 2.25 MiB copies of stage 2's
    pointwise kernels alive while the backward is at stage 3. A single Dense layer on the model's
    input (``bench/estimate/keras_update_temporaries.py``) shows none: nothing there reads the kernel back.
    """
    wd = getattr(optimizer, "weight_decay", None)
    if wd is None:
        return False
    try:
        return float(wd) != 0.0
    except (TypeError, ValueError):
        return True  # a schedule or a tensor: assume it decays


def keras_update_temporaries(optimizer: Any, keras_major: int = 2) -> int:
    """Weight-sized temporaries one update of ``optimizer`` (an unwrapped Keras optimizer) holds."""
    name = _keras_update_key(optimizer)
    table = KERAS_UPDATE_TEMPORARIES_BY_OPTIMIZER[3 if keras_major >= 3 else 2]
    default = KERAS_UPDATE_TEMPORARIES if keras_major < 3 else max(table.values())
    return table.get(name, default)

#: Names the CLI and ``optimizer="..."`` accept; each maps to the framework's own class, from whose
#: object the slots are then read.
OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad", "adamax", "nadam",
                   "adadelta", "lion", "adafactor")

_PROBE_SHAPES = ((6,), (4, 6))


@dataclass
class OptimizerInfo:
    """Per-weight optimizer state, in elements of the weight's dtype.

    ``slots_per_weight``: state elements per weight element (Adam 2, momentum SGD 1, plain SGD 0),
    ``None`` where the state is factored (Adafactor) and ``slot_elements`` gives it per shape.
    ``name``: the optimizer's class name, for display only.
    """

    name: str
    slots_per_weight: Optional[float]
    source: str = "probed"
    per_shape: Dict[Tuple[int, ...], int] = field(default_factory=dict)
    probe: Optional[Callable[[Tuple[int, ...]], int]] = None

    def slot_elements(self, shape: Sequence[int]) -> int:
        """State elements the optimizer keeps for one weight of ``shape``."""
        shape = tuple(int(d) for d in shape)
        n = math.prod(shape) if shape else 1
        if self.slots_per_weight is not None:
            return int(round(self.slots_per_weight * n))
        if shape not in self.per_shape:
            self.per_shape[shape] = self.probe(shape) if self.probe else 0
        return self.per_shape[shape]

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "slots_per_weight": self.slots_per_weight, "source": self.source}


def _finish(name: str, probe: Callable[[Tuple[int, ...]], int]) -> OptimizerInfo:
    ratios = [probe(s) / math.prod(s) for s in _PROBE_SHAPES]
    if all(abs(r - ratios[0]) < 1e-9 for r in ratios):
        return OptimizerInfo(name, ratios[0])
    return OptimizerInfo(name, None, probe=probe)  # factored state: probe each weight shape


# ---------------------------------------------------------------- Keras (2 and 3)

def _keras():
    try:
        import tensorflow as tf  # noqa: F401
        return tf.keras
    except ImportError:  # Keras 3 without TensorFlow (no TF backend): still usable for names
        import keras
        return keras


def keras_major_version() -> int:
    """The major version of the Keras TensorFlow runs (2 for tf.keras 2.x, 3 for Keras 3)."""
    try:
        return int(str(getattr(_keras(), "__version__", "2") or "2").split(".")[0])
    except (ImportError, ValueError):
        return 2


def _keras_from_name(name: str):
    k = _keras()
    key = name.strip().lower()
    if key == "momentum":
        return k.optimizers.SGD(momentum=0.9)
    table = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "rmsprop": "RMSprop", "adagrad": "Adagrad",
             "adamax": "Adamax", "nadam": "Nadam", "adadelta": "Adadelta", "lion": "Lion",
             "adafactor": "Adafactor", "ftrl": "Ftrl"}
    cls = getattr(k.optimizers, table.get(key, name), None)
    if cls is None:
        raise ConfigError(f"unknown optimizer {name!r} for Keras; use one of {', '.join(OPTIMIZER_NAMES)} "
                          f"or pass the optimizer object")
    return cls()


def _unwrap_keras(opt: Any) -> Any:
    for attr in ("inner_optimizer", "_optimizer", "base_optimizer"):
        inner = getattr(opt, attr, None)
        if inner is not None and inner is not opt and hasattr(inner, "get_config"):
            return _unwrap_keras(inner)
    return opt


#: Optimizers built from a name, and the probed state of a configuration, per process: a probe
#: builds copies of the optimizer and variables (~15 ms), which repeated estimates need not repeat.
_KERAS_BY_NAME: Dict[Tuple[str, int], Any] = {}
_KERAS_PROBED: Dict[Tuple[Any, str], Tuple[str, float]] = {}


def _config_key(opt: Any) -> Optional[Tuple[Any, str]]:
    try:
        config = opt.get_config()
        text = repr(sorted(config.items()))
    except Exception:
        return None
    return None if " at 0x" in text else (type(opt), text)  # an object in the config: no stable key


def keras_optimizer(optimizer: Any) -> Tuple[OptimizerInfo, Any]:
    """(OptimizerInfo, the unwrapped optimizer) for a Keras optimizer object or name."""
    if optimizer is None:
        optimizer = "adam"
    if isinstance(optimizer, str):
        name_key = (optimizer.strip().lower(), keras_major_version())
        if name_key not in _KERAS_BY_NAME:
            _KERAS_BY_NAME[name_key] = _keras_from_name(optimizer)
        optimizer = _KERAS_BY_NAME[name_key]
    loss_scaled = optimizer is not _unwrap_keras(optimizer)
    opt = _unwrap_keras(optimizer)
    cls = type(opt)

    def clone():
        try:
            return cls.from_config(opt.get_config())
        except Exception as exc:  # a custom optimizer without a round-tripping config
            raise ConfigError(f"cannot copy optimizer {cls.__name__} to count its state ({exc}); give it "
                              f"get_config()/from_config(), or pass optimizer='adam' (or another name)") from None

    def probe(shape: Tuple[int, ...]) -> int:
        import numpy as np
        c = clone()
        var_cls = getattr(_keras(), "Variable", None)  # Keras 3 builds slots only for its own variables
        if var_cls is not None:
            var = var_cls(np.zeros(shape, "float32"))
        else:
            import tensorflow as tf
            var = tf.Variable(tf.zeros(shape, tf.float32))
        before = {id(v) for v in getattr(c, "variables", []) or []}
        if hasattr(c, "build") and not hasattr(c, "get_slot_names"):
            c.build([var])
            made = [v for v in c.variables if id(v) not in before]
        else:  # legacy optimizer: slots are created on demand
            c._create_all_weights([var])
            made = [c.get_slot(var, n) for n in c.get_slot_names()]
        return sum(math.prod(v.shape) for v in made if len(v.shape) > 0)

    key = _config_key(opt)
    if key is not None and key in _KERAS_PROBED:
        info = OptimizerInfo(*_KERAS_PROBED[key])
    else:
        info = _finish(cls.__name__, probe)
        if key is not None and info.slots_per_weight is not None:
            _KERAS_PROBED[key] = (info.name, info.slots_per_weight)
    info.source = "probed (loss-scaled)" if loss_scaled else "probed"
    return info, opt


# ---------------------------------------------------------------- PyTorch

def _torch_from_name(name: str, params):
    import torch
    key = name.strip().lower()
    if key == "momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    table = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "rmsprop": "RMSprop", "adagrad": "Adagrad",
             "adamax": "Adamax", "nadam": "NAdam", "adadelta": "Adadelta", "adafactor": "Adafactor",
             "radam": "RAdam"}
    cls = getattr(torch.optim, table.get(key, name), None)
    if cls is None:
        raise ConfigError(f"unknown optimizer {name!r} for torch; use one of "
                          f"{', '.join(n for n in OPTIMIZER_NAMES if n != 'lion')} or pass the optimizer object")
    return cls(params, lr=0.01) if cls is torch.optim.SGD else cls(params)


def torch_optimizer_factory(optimizer: Any) -> Callable[[Sequence[Any], Dict[str, Any]], Any]:
    """A function building a fresh optimizer like ``optimizer`` (object, class or name) over new
    parameters, with option overrides (``foreach=...``)."""
    import torch
    if optimizer is None:
        optimizer = "adam"
    if isinstance(optimizer, str):
        name = optimizer
        return lambda params, over: _apply_over(_torch_from_name(name, params), over)
    if isinstance(optimizer, tuple) and len(optimizer) == 2 and isinstance(optimizer[0], type):
        cls, defaults = optimizer[0], dict(optimizer[1])  # (class, options): an optimizer handed to a child
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        defaults = dict(getattr(optimizer, "defaults", {}) or {}) if not isinstance(optimizer, type) else {}
    accepted = set(inspect.signature(cls.__init__).parameters)
    kwargs = {k: v for k, v in defaults.items() if k in accepted and k != "params"}
    if "lr" in accepted and "lr" not in kwargs and cls is torch.optim.SGD:
        kwargs["lr"] = 0.01

    def build(params, over):
        kw = dict(kwargs)
        kw.update({k: v for k, v in over.items() if k in accepted})
        return cls(params, **kw)
    return build


def _apply_over(opt, over):
    for group in opt.param_groups:
        for k, v in over.items():
            if k in group:
                group[k] = v
    return opt


def torch_optimizer(optimizer: Any) -> OptimizerInfo:
    """OptimizerInfo for a torch optimizer object, class or name (probed with one CPU step)."""
    import torch
    build = torch_optimizer_factory(optimizer)

    def probe(shape: Tuple[int, ...]) -> int:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.full(shape, 1e-3)
        try:
            opt = build([p], {"foreach": False})
            opt.step()
        except Exception as exc:
            raise ConfigError(f"cannot run a probe step of optimizer {getattr(optimizer, '__name__', optimizer)!r} "
                              f"on a {list(shape)} CPU tensor to count its state ({exc}); pass optimizer='adam' "
                              f"(or another name) instead") from None
        # the step counter is a 0-d tensor (or a number), not per-weight state
        return sum(v.numel() for v in opt.state[p].values() if torch.is_tensor(v) and v.dim() > 0)

    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", type(optimizer).__name__)
    return _finish(str(name), probe)
