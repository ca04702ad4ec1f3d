"""What a call hands the process that measures a model spec, as something that process can rebuild:
plain data as it is, an object with ``get_config()`` (a Keras optimizer or loss, which holds weak
references and variables and cannot be pickled) as its class and configuration, a function or
class by its import path; anything else refused with the argument named."""
from __future__ import annotations

from typing import Any, Dict

from ...errors import ConfigError

__all__ = ["portable", "rebuild", "portable_options"]


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
        local = "<" in getattr(value, "__qualname__", "")
        raise ConfigError(f"{what}={value!r} cannot be sent to the process that measures a model spec "
                          f"({type(exc).__name__}: {exc}); give it by name (e.g. optimizer='adam'), as an object "
                          f"with get_config(), "
                          + ("as a function defined at module level (not a lambda or a function inside a "
                             "function), " if local else "")
                          + "or build the model and pass it (it is then measured in this process), or use "
                          "method='model'") from None


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


def portable_options(opts: Dict[str, Any]) -> Dict[str, Any]:
    return {k: portable(v, k) for k, v in opts.items()
            if k in ("precision", "loss", "input_dtype", "param_dtype", "memory_at_hand")}
