"""Measurements kept by what determines them, so two calls with the same inputs plan the same bytes.

A measurement's key hashes everything its peaks depend on: the framework and its version, the
model (a spec with what it names: a ``module:factory``'s source file, an ``hf:`` config file, the
builders' versions; or for a live model its structure: every layer's or module's type, name,
weight shapes, dtypes and trainability, its inputs' shapes and dtypes, the source of every class
it is made of and its configuration), the small batches, the optimizer (class and configuration),
the precision, the loss (a function by its code, constants and the values it closes over, so two
lambdas or an edited function are two losses), the steps and the device kind. A
measurement is kept in this process and, unless ``DISTMEM_MEASURE_CACHE=off``, as a JSON file in
``DISTMEM_MEASURE_CACHE`` (default ``~/.cache/distmem/measurements``, created private to the user),
so a later process — another rank on the same host, the same job started again — reads the same
peaks instead of measuring again. A measurement made on one rank can be handed to the others as
the plain dict an estimate carries (``Estimate.measurement``; ``estimate(..., measurement=)``).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Dict, Optional

__all__ = ["measurement_key", "model_fingerprint", "code_fingerprint", "load", "store", "CACHE_VAR"]

CACHE_VAR = "DISTMEM_MEASURE_CACHE"
_MEMORY: Dict[str, Dict[str, Any]] = {}


def _describe(obj: Any) -> str:
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return repr(obj)
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    cfg = None
    for attr in ("get_config", "defaults"):
        got = getattr(obj, attr, None)
        try:
            cfg = got() if callable(got) else got
        except Exception:  # noqa: BLE001 - an object without a readable configuration
            cfg = None
        if cfg is not None:
            break
    text = json.dumps(cfg, sort_keys=True, default=str) if cfg is not None else ""
    return f"{type(obj).__module__}.{type(obj).__qualname__}{text}" if text else \
        getattr(obj, "__qualname__", None) or type(obj).__qualname__


def _file_digest(path: Optional[str]) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return ""


def _source_of(obj: Any) -> str:
    """The digest of the file that defines ``obj`` (a class or function): its code as it is now."""
    import inspect
    try:
        return _file_digest(inspect.getsourcefile(obj))
    except (TypeError, OSError):
        return ""


def _code_text(code: Any) -> str:
    consts = [(_code_text(c) if hasattr(c, "co_code") else repr(c)) for c in code.co_consts]
    return f"{code.co_code.hex()}|{consts}|{code.co_names}|{code.co_varnames}"


def code_fingerprint(obj: Any) -> str:
    """What a loss, an input function or any callable computes, as text: a name as given; a
    function by its code, constants, defaults and the values it closes over (two lambdas, or one
    edited, differ); an object by its class's source and its settings."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return repr(obj)
    fn = getattr(obj, "__func__", obj)
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = [_describe(getattr(c, "cell_contents", None)) for c in (getattr(fn, "__closure__", None) or ())]
        return hashlib.sha256(f"{fn.__module__}.{fn.__qualname__}|{_code_text(code)}|"
                              f"{repr(getattr(fn, '__defaults__', None))}|{cells}".encode()).hexdigest()[:24]
    cls = obj if isinstance(obj, type) else type(obj)
    settings = {k: _describe(v) for k, v in sorted(vars(obj).items())
                if isinstance(v, (str, int, float, bool, type(None)))} if not isinstance(obj, type) else {}
    return f"{cls.__module__}.{cls.__qualname__}:{_source_of(cls)}:{settings}"


def _spec_fingerprint(spec: str) -> str:
    """A spec with what it names: the source file of a ``module:factory``, an ``hf:`` config
    file, and the builders' versions."""
    import importlib.util
    kind, _, rest = spec.partition(":")
    extra = []
    if kind.lower() in ("hf", "huggingface", "transformers"):
        path = os.path.expanduser(rest)
        extra.append(_file_digest(os.path.join(path, "config.json") if os.path.isdir(path) else path))
        extra.append(_version("transformers"))
    elif kind.lower() in ("torchvision", "tv"):
        extra.append(_version("torchvision"))
    elif "." in kind or kind.isidentifier():
        module = spec.rpartition(":")[0]
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError, AttributeError):
            found = None
        extra.append(_file_digest(getattr(found, "origin", None)))
    return "|".join([spec] + extra)


def _version(package: str) -> str:
    try:
        from importlib.metadata import version
        return f"{package} {version(package)}"
    except Exception:  # noqa: BLE001 - not installed: the spec cannot build anyway
        return ""


def model_fingerprint(model: Any) -> str:
    """A model's memory-relevant identity as text: a spec with what it names
    (:func:`_spec_fingerprint`), or a live model's structure, the source of its classes and its
    configuration; not its weights' values."""
    if isinstance(model, str):
        return _spec_fingerprint(model)
    parts = [f"{type(model).__module__}.{type(model).__qualname__}"]
    if hasattr(model, "named_modules"):  # torch
        classes = {}
        for name, m in model.named_modules():
            own = [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in m.named_parameters(recurse=False)]
            parts.append(f"{name}:{type(m).__qualname__}:{own}:{getattr(m, 'training', None)}")
            classes.setdefault(type(m), None)
        parts += [f"class {c.__module__}.{c.__qualname__} {_source_of(c)}" for c in classes]
        config = getattr(model, "config", None)
        to_json = getattr(config, "to_json_string", None)
        if callable(to_json):
            try:
                parts.append("config " + to_json(use_diff=False))
            except Exception:  # noqa: BLE001 - a config that cannot print itself: its repr
                parts.append("config " + repr(config))
        parts.append(str(getattr(model, "_distmem_input_shape", "")))
        return "\n".join(parts)
    for layer in getattr(model, "layers", []) or []:  # Keras
        ws = [(w.name, tuple(int(d) for d in w.shape), str(getattr(w.dtype, "name", w.dtype)), bool(w.trainable))
              for w in getattr(layer, "weights", []) or []]
        pol = getattr(getattr(layer, "dtype_policy", None), "name", "")
        parts.append(f"{layer.name}:{type(layer).__qualname__}:{pol}:{ws}")
    parts += [f"in {tuple(t.shape)} {t.dtype}" for t in getattr(model, "inputs", []) or []]
    parts += [f"out {tuple(t.shape)} {t.dtype}" for t in getattr(model, "outputs", []) or []]
    parts.append(f"loss {_describe(getattr(model, 'loss', None))}")
    return "\n".join(parts)


def measurement_key(**what: Any) -> str:
    """The hex digest naming a measurement of ``what`` (model fingerprint, batches, optimizer...)."""
    text = json.dumps({k: (v if isinstance(v, (str, int, float, bool, list, tuple)) or v is None else _describe(v))
                       for k, v in sorted(what.items())}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _folder() -> Optional[str]:
    where = os.environ.get(CACHE_VAR, "")
    if where.strip().lower() in ("off", "0", "none", "false"):
        return None
    return os.path.expanduser(where or os.path.join("~", ".cache", "distmem", "measurements"))


def load(key: str) -> Optional[Dict[str, Any]]:
    """The measurement kept under ``key`` (this process, then the cache folder), or None."""
    if key in _MEMORY:
        return dict(_MEMORY[key])
    folder = _folder()
    if folder is None:
        return None
    path = os.path.join(folder, key + ".json")
    try:
        st = os.lstat(path)
        if not os.path.isfile(path) or os.path.islink(path) or st.st_uid != os.getuid():
            return None  # only a plain file of this user is trusted
        with open(path, encoding="utf-8") as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    if got.get("key") != key:
        return None
    _MEMORY[key] = got
    return dict(got)


def store(key: str, measurement: Dict[str, Any]) -> None:
    """Keep ``measurement`` under ``key`` (this process, and the cache folder where it can be written)."""
    _MEMORY[key] = dict(measurement)
    folder = _folder()
    if folder is None:
        return
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(measurement, f, sort_keys=True)
        os.replace(tmp, os.path.join(folder, key + ".json"))
    except OSError:
        pass  # a read-only home: kept in this process only
