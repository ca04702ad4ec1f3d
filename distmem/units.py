"""One place that converts sizes: human strings at the edges, bytes everywhere inside.

Accepted forms: ``1234`` (bytes), ``"512MB"`` / ``"6GiB"`` / ``"1.5 TiB"`` (decimal SI and binary
IEC units, case-insensitive, ``B`` optional), ``"45%"`` (of a given total), and floats in (0, 1] as
fractions of a given total where the caller allows it. A number written as text means the same
number: ``"0.5"`` is the fraction 0.5 and ``"1234"`` 1234 bytes, in arguments, CLI flags and
``DISTMEM_*`` variables alike. Every size is bounded: at most :data:`MAX_BYTES` (2**63 - 1, what
a signed 64-bit byte count - the C cap's, CUDA's, the kernel's - can hold), never NaN or infinite.

A decimal unit (``k``, ``M``, ``G``, ``T``, with or without ``B``) is read as powers of 1000 and said
back once: every reading is kept, and :func:`said_back` hands each door (the command line, ``init()``,
``distmem-exec``) the line it shows, ``--gpus '2x16G': 16G = 16.0e9 B = 14.9 GiB``, so a user who
meant GiB sees the difference before it matters. Ratios (headroom, a margin) are read by
:func:`parse_ratio` under one rule: ``"10%"`` or ``0.1``; a bare number above 1 is refused, since
``10`` for 10% would mean +1000%.
"""
from __future__ import annotations

import math
import re
import threading
from typing import Dict, List, Optional, Union

from .errors import ConfigError

__all__ = ["parse_bytes", "check_size", "parse_ratio", "said_back", "format_bytes", "to_mib_floor", "plural", "KiB",
           "MiB", "GiB", "TiB", "SizeLike", "MAX_BYTES", "TOO_LARGE"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

SizeLike = Union[int, float, str]

#: The largest size any input may name (8 EiB less one byte): a signed 64-bit count of bytes. No
#: machine holds more, and every consumer (the native cap's ``uint64`` budget with its all-ones
#: "unlimited" sentinel, ``ctypes``, TensorFlow's MiB) can represent it exactly.
MAX_BYTES = 2**63 - 1
#: What every message about a size beyond :data:`MAX_BYTES` says (readers that rephrase keep it).
TOO_LARGE = "is more than any machine holds"


def _bounded(n: Union[int, float], what: str, value: object) -> int:
    """``n`` bytes as an int, or ConfigError naming ``value`` when it is not a finite size up to MAX_BYTES."""
    if n > MAX_BYTES or (isinstance(n, float) and not math.isfinite(n)):
        shown = value if isinstance(value, str) else repr(value)
        raise ConfigError(f"{what}: {shown} {TOO_LARGE}; a size must be at most "
                          f"{MAX_BYTES} bytes (8 EiB), e.g. '6GiB'")
    return int(n)

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": KiB, "kib": KiB, "mi": MiB, "mib": MiB, "gi": GiB, "gib": GiB, "ti": TiB, "tib": TiB,
}
#: The decimal units, by power of 1000: said back when read (see :func:`said_back`).
_DECIMAL = {"k": 1, "kb": 1, "m": 2, "mb": 2, "g": 3, "gb": 3, "t": 4, "tb": 4}
_NUMBER_RE = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*$")
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.I)


def parse_bytes(value: SizeLike, *, total: Optional[int] = None, what: str = "size",
                allow_fraction: bool = False) -> int:
    """Return ``value`` as a whole number of bytes.

    ``total`` is what a percentage (``"45%"``) or, with ``allow_fraction``, a float in (0, 1]
    refers to. ``what`` names the argument in error messages.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size such as 6GiB, 512MB or 45%, got {value!r}")
    given = value
    if isinstance(value, str) and _NUMBER_RE.match(value):
        # A number as text means that number, wherever it comes from: "0.5" is 0.5, "1234" is 1234.
        text = value.strip()
        if len(text) > 64:  # int() refuses 4300 digits with a bare ValueError; no size needs 20
            raise ConfigError(f"{what}: a number of {len(text)} characters {TOO_LARGE}; a size "
                              f"must be at most {MAX_BYTES} bytes (8 EiB), e.g. '6GiB'")
        value = float(text) if any(c in text for c in ".eE") else int(text)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: a size cannot be negative, got {value}")
        return _bounded(value, what, given)
    if isinstance(value, float):
        if allow_fraction and 0 < value <= 1:
            if total is None:
                raise ConfigError(f"{what}: the fraction {value} needs a device total to refer to; "
                                  "give bytes (e.g. '6GiB') instead")
            return int(total * value)
        if allow_fraction and value > 1 and value < 1024:
            raise ConfigError(f"{what}: a fraction must lie in (0, 1], got {value}; "
                              "for a size give bytes or a string such as '6GiB'")
        if value < 0 or not math.isfinite(value):
            raise ConfigError(f"{what}: a size must be a finite non-negative number, got {given!r}")
        if value <= 0 and allow_fraction:
            raise ConfigError(f"{what}: a fraction must lie in (0, 1], got {value}")
        if value < 1024 and not value.is_integer():
            # a number without a unit is bytes: 0.5 or 2.5 bytes is a fraction or GiB meant, never read as 0 or 2
            share = f"for {value:.0%} of each GPU write '{value * 100:g}%' where a share is taken, " if value < 1 else ""
            raise ConfigError(f"{what}: {given!r} is not a whole number of bytes (a number without a unit is bytes); "
                              f"{share}for {value:g} GiB write '{value:g}GiB'")
        return _bounded(value, what, given)
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a size such as 6GiB, 512MB or 45%, got {type(value).__name__} {value!r}")
    text = value.strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ConfigError(f"{what}: cannot read {value!r} as a percentage; write e.g. '45%'") from None
        if not 0 < pct <= 100:  # NaN fails this too
            raise ConfigError(f"{what}: a percentage must lie in (0, 100], got {value!r}")
        if total is None:
            raise ConfigError(f"{what}: {value!r} needs a device total to refer to; give bytes (e.g. '6GiB') instead")
        return int(total * pct / 100.0)
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}: cannot read {value!r} as a size; write e.g. '6GiB', '512MB', "
                          "'1.5TiB', a number of bytes, or a percentage such as '45%'")
    n = _bounded(float(m.group(1)) * _UNITS[m.group(2).lower()], what, value)
    power = _DECIMAL.get(m.group(2).lower())
    if power:
        _note_decimal(text, m.group(1), m.group(2), power, n, what)
    return n


_lock = threading.Lock()
_read: Dict[str, str] = {}  # text -> its line, every decimal size read in this process
_pending: List[str] = []  # lines not yet handed to a door


def _note_decimal(text: str, number: str, unit: str, power: int, n: int, what: str) -> None:
    key = text.replace(" ", "").lower()
    with _lock:
        if key in _read:
            return
        binary = unit[0].upper() + "iB" if unit[0].lower() != "k" else "KiB"
        line = (f"{what}: {text} = {float(number)!r}e{3 * power} B = {format_bytes(n)} ({unit} is decimal, "
                f"1000^{power}; {number}{binary} is {number} x 1024^{power})")
        _read[key] = line
        _pending.append(line)


def said_back() -> List[str]:
    """The decimal sizes read since the last call, one line each, each text once per process
    (``--gpus '2x16G': 16G = 16.0e9 B = 14.9 GiB (G is decimal, 1000^3; 16GiB is 16 x 1024^3)``).
    Every door that reads sizes shows them: the command line on stderr before its result,
    ``init()`` beside the rank's plan; ``DISTMEM_QUIET=1`` drops them with every other line."""
    with _lock:
        out = list(_pending)
        _pending.clear()
    return out


def parse_ratio(value: object, *, what: str, upper: float = 10.0, default_hint: str = "0.1") -> float:
    """``value`` as a ratio in [0, ``upper``]: ``"10%"``, ``"0.1"`` or ``0.1`` (0 keeps the figure).

    One rule for every ratio (headroom, a margin): a bare number above 1 is refused, not read as
    +100 x itself - ``10`` meant as 10% would be +1000% - with both readings in the message; a
    ratio above 1 is written as a percentage (``"150%"``). ConfigError naming ``what`` otherwise."""
    text = value.strip() if isinstance(value, str) else None
    ratio: Optional[float] = None
    percent = bool(text and text.endswith("%"))
    try:
        if percent:
            ratio = float(text[:-1]) / 100.0  # type: ignore[index]
        elif text is not None:
            ratio = float(text)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            ratio = float(value)
    except ValueError:
        ratio = None
    shown = value if isinstance(value, str) else repr(value)
    if ratio is not None and math.isfinite(ratio) and ratio > 1 and not percent:
        raise ConfigError(f"{what}={shown}: a ratio above 1 is read as {ratio * 100:g}%, which looks like a "
                          f"percentage given as a number; for {ratio:g}% write '{ratio:g}%' (or {ratio / 100:g}), "
                          f"for {ratio * 100:g}% write '{ratio * 100:g}%'")
    if ratio is None or not math.isfinite(ratio) or not 0 <= ratio <= upper:
        raise ConfigError(f"{what}={shown}: give a percentage such as '10%' (0% to {upper * 100:g}%) or a ratio "
                          f"such as {default_hint}; 0 keeps the figure as it is")
    return ratio


def check_size(value: SizeLike, *, what: str = "size", allow_fraction: bool = False,
               allow_percent: bool = True) -> None:
    """Validate ``value``'s form and range without a device total (so a laptop rejects what a GPU node
    would): ConfigError naming ``what``, the value and the accepted forms."""
    if isinstance(value, str) and value.strip().endswith("%"):
        if not allow_percent:
            raise ConfigError(f"{what}={value!r}: a percentage is not accepted here; give bytes such as '6GiB'")
        parse_bytes(value, total=100, what=what)
        return
    probe = 1 << 50  # any total: checks a fraction's range
    parse_bytes(value, total=probe if allow_fraction else None, what=what, allow_fraction=allow_fraction)


def format_bytes(n: Optional[float], precision: int = 1) -> str:
    """``1610612736`` -> ``'1.5 GiB'``; ``None`` -> ``'-'``."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"


def to_mib_floor(n: int) -> int:
    """Bytes to whole MiB, rounding down (TensorFlow's ``memory_limit`` unit): never above the plan."""
    return int(n) // MiB


def plural(count: int, word: str, many: Optional[str] = None, *, bare: bool = False) -> str:
    """``plural(1, "rank")`` -> ``"1 rank"``, ``plural(4, "rank")`` -> ``"4 ranks"`` (``many`` for an
    irregular plural: ``plural(2, "replica", "replicas")``); ``bare=True`` leaves out the number, for
    a list that follows: ``f"{plural(len(r), 'rank', bare=True)} {r}"`` -> ``"ranks [1, 2]"``."""
    noun = word if count == 1 else (many or word + "s")
    return noun if bare else f"{count} {noun}"
