"""Numeric precision of a training step: what dtype weights, gradients, optimizer state and
activations are held in. Pure. The one table of precision names and their aliases: the estimator,
``distmem fit`` and its tables all read it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

__all__ = ["Precision", "PRECISIONS", "PRECISION_ALIASES", "dtype_bytes", "resolve_precision"]

#: Bytes per element of the dtypes a training step holds; keys are the names TensorFlow, Keras 3
#: and torch print (``tf.float16.name``, ``str(torch.float16)`` without the ``torch.`` prefix).
_DTYPE_BYTES = {
    "float64": 8, "double": 8, "complex64": 8, "int64": 8, "uint64": 8, "long": 8,
    "float32": 4, "float": 4, "int32": 4, "uint32": 4, "int": 4, "complex32": 4,
    "float16": 2, "half": 2, "bfloat16": 2, "int16": 2, "uint16": 2, "short": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex128": 16, "string": 8, "resource": 8, "variant": 8,
}


def dtype_bytes(dtype: object, default: int = 4) -> int:
    """Bytes per element of a TensorFlow, Keras, NumPy or torch dtype (or its name)."""
    name = getattr(dtype, "name", None) or str(dtype)
    if not isinstance(name, str):
        name = str(dtype)
    name = name.replace("torch.", "")
    return _DTYPE_BYTES.get(name, default)


@dataclass(frozen=True)
class Precision:
    """How a training step stores its numbers.

    ``compute_bytes``: bytes per activation element (what layers compute in). ``weight_bytes``:
    bytes per stored weight element — the fp32 master weights under mixed precision.
    ``cast_weights``: each layer reads its fp32 weights through a cast to the compute dtype, and the
    cast copy is kept for the backward pass (Keras ``mixed_*`` policies, torch autocast).
    ``loss_scaling``: gradients are unscaled and checked for overflow as one group before any
    update (fp16), so every weight gradient is alive at once.
    """

    name: str
    compute_bytes: int
    weight_bytes: int = 4
    cast_weights: bool = False
    loss_scaling: bool = False
    short: str = ""  #: the name tables print: fp32, fp16, bf16

    @property
    def mixed(self) -> bool:
        return self.cast_weights


PRECISIONS = {
    "float32": Precision("float32", 4, short="fp32"),
    "mixed_float16": Precision("mixed_float16", 2, 4, cast_weights=True, loss_scaling=True, short="fp16"),
    "mixed_bfloat16": Precision("mixed_bfloat16", 2, 4, cast_weights=True, loss_scaling=False, short="bf16"),
}
#: Other spellings of the names above. ``mixed`` and ``amp`` are float16: torch.autocast's default
#: dtype on CUDA and the first of Keras's mixed policies.
PRECISION_ALIASES = {"fp32": "float32", "32": "float32", "fp16": "mixed_float16", "float16": "mixed_float16",
            "mixed": "mixed_float16", "mixed_fp16": "mixed_float16", "amp": "mixed_float16",
            "bf16": "mixed_bfloat16", "bfloat16": "mixed_bfloat16", "mixed_bf16": "mixed_bfloat16"}


def resolve_precision(value: Optional[object]) -> Precision:
    """A :class:`Precision` from ``None`` (float32), a name (``"mixed_float16"``, ``"bf16"``...),
    ``True`` (mixed float16) or a Precision."""
    if isinstance(value, Precision):
        return value
    if value is None or value is False:
        return PRECISIONS["float32"]
    if value is True:
        return PRECISIONS["mixed_float16"]
    name = str(value).strip().lower()
    name = PRECISION_ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise ConfigError(f"unknown precision {value!r}; use one of {', '.join(PRECISIONS)} "
                          f"(or {', '.join(sorted(PRECISION_ALIASES))})")
    return PRECISIONS[name]
