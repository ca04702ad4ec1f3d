"""How the command line's text becomes a strategy option's value (the ``parse`` of
:func:`distmem.plan.strategy.option`): each reader names the flag and the accepted form on error."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from ... import untrusted
from ...errors import ConfigError
from ..partition import layers_from_dicts

__all__ = ["comma_list", "whole_number", "shape", "layers_file"]


def comma_list(text: str) -> List[str]:
    """``"9GiB, 7GiB"`` -> ``["9GiB", "7GiB"]``."""
    return [s.strip() for s in str(text).split(",") if s.strip()]


def whole_number(what: str, least: int = 1) -> Callable[[str], int]:
    """A reader of a whole number >= ``least`` for option ``what``."""
    def read(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            value = None  # type: ignore[assignment]
        if value is None or value < least:
            raise ConfigError(f"{what}={text!r}: give a whole number, at least {least}")
        return value
    read.__name__ = f"whole_number_{what}"
    return read


def shape(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``"96,96,3"`` (or ``96x96x3``) -> ``(96, 96, 3)``: a model input without the batch axis."""
    if not text:
        return None
    try:
        dims = tuple(int(x) for x in str(text).replace("x", ",").split(",") if x.strip())
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise ConfigError(f"input_shape={text!r}: write positive sizes separated by commas, e.g. 96,96,3")
    return dims


def layers_file(path: str) -> List[Any]:
    """Per-layer costs from a JSON file: a list of ``{name, state_bytes, activation_bytes,
    output_bytes}``, ``{"layers": [...]}``, or what ``distmem estimate --per-layer --json`` writes."""
    try:  # checked: no link, no FIFO, at most 64 MiB, this user's own in a folder others can write
        data = untrusted.read_json(path, max_bytes=64 * 1024**2, what="the layer costs file")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--layers {path}: cannot read a JSON list of layer costs ({exc}); write "
                          "[{\"name\": ..., \"state_bytes\": ..., \"activation_bytes\": ..., \"output_bytes\": ...}, "
                          "...] or pass what `distmem estimate --per-layer --json` writes") from None
    rows = data
    if isinstance(data, dict):
        # {"layers": [...]}, or what `distmem estimate --per-layer --json` writes (its "layers" is a count)
        rows = data["layers"] if isinstance(data.get("layers"), list) else data.get("per_layer")
    if not isinstance(rows, list):
        raise ConfigError(f"--layers {path}: expected a JSON list of layer costs (or an object with a 'layers' "
                          f"list), got {type(rows).__name__}")
    return layers_from_dicts(rows, what=f"--layers {path}")
