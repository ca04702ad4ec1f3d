"""Turn a model spec from the command line into a built model, on CPU or torch's meta device.

Specs: ``keras:MobileNetV2`` (a ``keras.applications`` model, ``weights=None``),
``torchvision:resnet50`` (a ``torchvision.models`` builder, ``weights=None``, built on the meta
device so nothing is allocated), ``hf:NAME`` (a Hugging Face ``transformers`` model built from its
config with random weights on the meta device; NAME is a local folder or ``config.json``, a name in
the local Hugging Face cache, or a ``transformers`` model type such as ``gpt2`` or ``t5``; nothing
is downloaded), ``module.path:factory`` (your own function returning a Keras model or a
``torch.nn.Module``; it gets ``input_shape=`` if it accepts it), or a saved Keras model
(``model.keras``, ``model.h5``, a SavedModel folder). A given input shape that contradicts a Keras
model's own fixed input is an error naming both.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Optional, Sequence, Tuple

from ..errors import ConfigError

__all__ = ["load_model", "parse_shape", "framework_of", "spec_framework",
           "DEFAULT_KERAS_INPUT_SHAPE", "DEFAULT_HF_SEQUENCE"]

#: Keras applications' own default input (height, width, channels).
DEFAULT_KERAS_INPUT_SHAPE = (224, 224, 3)

#: Tokens per sample of an ``hf:`` model when no input shape is given (capped by the model's own
#: maximum positions).
DEFAULT_HF_SEQUENCE = 512


def _closest(name: str, known: Sequence[str]) -> str:
    """`` (did you mean X?); N known, e.g. A, B, C`` - the nearest names first, not the whole list."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    close += [k for k in known if k.lower() == name.lower() and k not in close]
    head = f" (did you mean {' or '.join(close)}?)" if close else ""
    return head + (f"; {len(known)} known, e.g. {', '.join(list(known)[:6])}" if known else "")


def parse_shape(text: Any) -> Optional[Tuple[int, ...]]:
    """``"96,96,3"`` / ``"96x96x3"`` / ``(96, 96, 3)`` -> ``(96, 96, 3)``; ``None`` stays ``None``."""
    if text is None or text == "":
        return None
    if isinstance(text, (list, tuple)):
        parts = list(text)
    else:
        parts = [p for p in str(text).replace("x", ",").replace(" ", "").split(",") if p]
    try:
        shape = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ConfigError(f"input shape {text!r}: expected whole numbers separated by commas, e.g. 96,96,3 "
                          f"(one sample, no batch dimension)") from None
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(f"input shape {text!r}: every dimension must be a positive integer, e.g. 96,96,3")
    return shape


def spec_framework(spec: str) -> Optional[str]:
    """``"torch"`` or ``"keras"`` where a spec names its framework (``torchvision:``, ``hf:``,
    ``keras:``, a ``.keras``/``.h5`` file); None for a ``module:factory`` spec, known once built."""
    kind = spec.partition(":")[0].lower()
    if kind in ("torchvision", "tv", "hf", "huggingface", "transformers"):
        return "torch"
    if kind in ("keras", "tf", "tensorflow") or spec.lower().endswith((".keras", ".h5", ".hdf5")):
        return "keras"
    return None


def framework_of(model: Any) -> str:
    """``"torch"`` for a ``torch.nn.Module``, ``"keras"`` for a Keras model."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return "torch"
    if hasattr(model, "layers") and hasattr(model, "count_params"):
        return "keras"
    raise ConfigError(f"cannot size a {type(model).__module__}.{type(model).__name__}: distmem estimates Keras "
                      f"models and torch.nn.Module objects")


def _keras_app(name: str, shape: Optional[Tuple[int, ...]]):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
        apps = tf.keras.applications
    except ImportError:
        try:
            import keras
            apps = keras.applications
        except ImportError:
            raise ConfigError(f"keras:{name} needs TensorFlow (or Keras 3); install tensorflow") from None
    fn = getattr(apps, name, None)
    if fn is None or not callable(fn):
        known = sorted(n for n in dir(apps) if n[:1].isupper())
        raise ConfigError(f"keras:{name} is not a keras.applications model{_closest(name, known)}")
    shape = shape or DEFAULT_KERAS_INPUT_SHAPE
    try:
        return fn(weights=None, input_shape=shape)
    except ValueError as exc:
        raise ConfigError(f"keras:{name} cannot be built for input shape {shape} ({exc}); give "
                          f"--input-shape H,W,C that the model accepts (e.g. 96,96,3 or 224,224,3)") from None


def _torchvision(name: str, shape: Optional[Tuple[int, ...]], device: str = "meta"):
    missing = [m for m in ("torch", "torchvision") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"torchvision:{name} needs {' and '.join(missing)}, which this Python "
                          f"({sys.executable}) does not have; pip install {' '.join(missing)} "
                          f"(or distmem[torch])")
    try:
        import torch
        import torchvision
    except ImportError as exc:  # installed but broken (e.g. a torchvision built for another torch)
        raise ConfigError(f"torchvision:{name}: importing {exc.name or 'torch/torchvision'} failed ({exc}); "
                          "install the torchvision release that matches this torch") from None
    builders = torchvision.models
    fn = getattr(builders, name, None)
    if fn is None or not callable(fn):
        try:
            fn = lambda **kw: builders.get_model(name, **kw)  # noqa: E731
            builders.get_model_builder(name)
        except (ValueError, AttributeError):
            known = sorted(builders.list_models()) if hasattr(builders, "list_models") else []
            raise ConfigError(f"torchvision:{name} is not a torchvision model builder{_closest(name, known)}") from None
    try:
        with torch.device(device):  # on meta: no weights are allocated or initialised
            model = fn(weights=None)
    except (NotImplementedError, RuntimeError):  # a builder that computes its widths with tensors
        model = fn(weights=None)
        if device != "meta":
            model = model.to(device)
    model._distmem_input_shape = tuple(shape) if shape else (3, 224, 224)
    return model


def _hf_config(name: str):
    """The ``transformers`` config for ``name`` without touching the network: a local folder or
    json file, then the local Hugging Face cache, then a model type's default config."""
    import transformers
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        return transformers.AutoConfig.from_pretrained(os.path.dirname(path) or ".") \
            if os.path.basename(path) == "config.json" else transformers.PretrainedConfig.from_json_file(path)
    if os.path.isdir(path):
        try:
            return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"hf:{name}: the folder has no usable config.json ({type(exc).__name__}: {exc})") from None
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # a cache lookup only: never a download
    try:
        return transformers.AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception:
        pass
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old
    mapping = getattr(getattr(transformers.models, "auto").configuration_auto, "CONFIG_MAPPING", {})
    if name in mapping:
        return mapping[name]()
    raise ConfigError(f"hf:{name} cannot be resolved without a download: it is not a local folder or config.json, "
                      f"not in the local Hugging Face cache (HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}), "
                      f"and not a transformers model type (e.g. gpt2, bert, llama, t5). Fetch its config once "
                      f"(huggingface-cli download {name} config.json) or give the path to a config.json")


def _hf(name: str, shape: Optional[Tuple[int, ...]], device: str = "meta"):
    try:
        import torch
        import transformers
    except ImportError:
        raise ConfigError(f"hf:{name} needs torch and transformers; install them (pip install transformers)") from None
    cfg = _hf_config(name)
    arch = next((getattr(transformers, a, None) for a in (getattr(cfg, "architectures", None) or [])
                 if getattr(transformers, a, None) is not None), None)
    candidates = [arch] if arch is not None else []
    auto = transformers
    if getattr(cfg, "is_encoder_decoder", False):
        candidates.append(auto.AutoModelForSeq2SeqLM)
    candidates += [auto.AutoModelForCausalLM, auto.AutoModelForMaskedLM, auto.AutoModel]
    model, errors = None, []
    for cls in candidates:
        try:
            with torch.device(device):  # on meta: no weights are allocated or initialised
                model = cls._from_config(cfg) if hasattr(cls, "_from_config") else cls.from_config(cfg)
            break
        except Exception as exc:  # this head does not exist for the config: try the next one
            errors.append(f"{getattr(cls, '__name__', cls)}: {exc}")
    if model is None:
        raise ConfigError(f"hf:{name}: no transformers model class builds from its config ({'; '.join(errors)[:400]})")
    limit = int(getattr(cfg, "max_position_embeddings", 0) or getattr(cfg, "n_positions", 0) or DEFAULT_HF_SEQUENCE)
    seq = int(shape[0]) if shape else min(DEFAULT_HF_SEQUENCE, limit)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if vocab < 1:
        raise ConfigError(f"hf:{name}: its config has no vocab_size, so token inputs cannot be made; estimate it "
                          f"through the API with example_input=")
    encdec = bool(getattr(cfg, "is_encoder_decoder", False))

    def example_input(batch: int):
        ids = torch.zeros((batch, seq), dtype=torch.long)
        out = {"input_ids": ids}
        if encdec:
            out["decoder_input_ids"] = torch.zeros((batch, max(1, seq // 2)), dtype=torch.long)
        return out
    model.example_input = example_input
    model._distmem_input_shape = (seq,)
    return model


def _import_user_module(module_name: str):
    """``module_name`` imported from the user's own path - ``PYTHONPATH``, site-packages, the
    script's folder - never from the working folder: run from a shared folder, a module of that
    name another user left there would otherwise run as this user (``python -m`` and ``-c`` put
    the working folder first). An installed or already imported module is used as it is."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    from .. import children

    hidden = children.working_folder_entries()
    if not hidden:
        return importlib.import_module(module_name)
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if p not in hidden]
    try:
        return importlib.import_module(module_name)
    finally:
        # What the import added stays (a package extending the path); the working folder comes back.
        sys.path[:] = saved + [p for p in sys.path if p not in saved]


def _user_factory(spec: str, shape: Optional[Tuple[int, ...]]):
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"model spec {spec!r}: use keras:NAME, torchvision:NAME or module.path:factory")
    try:
        module = _import_user_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"model spec {spec!r}: cannot import {module_name!r} ({exc}); the working folder is never "
                          f"searched (a module of that name someone left in a shared folder would run as you): add "
                          f"the folder that holds it to PYTHONPATH by its absolute path, e.g. "
                          f"PYTHONPATH={os.getcwd()}, or install it") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"model spec {spec!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        return fn
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    try:
        model = fn(input_shape=shape) if shape is not None and "input_shape" in params else fn()
    except Exception as exc:
        raise ConfigError(f"model spec {spec!r}: {attr}() failed ({type(exc).__name__}: {exc})") from None
    if shape is not None and hasattr(model, "layers"):
        _check_keras_input(model, shape, f"model spec {spec!r}")
    if shape is not None and not hasattr(model, "layers"):
        try:
            model._distmem_input_shape = tuple(shape)
        except AttributeError:
            pass
    return model


def _check_keras_input(model: Any, shape: Tuple[int, ...], what: str) -> None:
    """A Keras model with a fixed input: ``shape`` (one sample) must be it, where the model fixes a
    dimension; otherwise the estimate would silently be of the model's own input."""
    try:
        own = model.input_shape
    except (AttributeError, ValueError, RuntimeError):  # not built, or several inputs
        return
    if not isinstance(own, tuple) or (own and isinstance(own[0], tuple)):
        return  # several inputs: nothing single to compare
    sample = tuple(own[1:])
    if len(sample) != len(shape) or any(d is not None and d != g for d, g in zip(sample, shape)):
        fixed = ",".join("?" if d is None else str(d) for d in sample)
        free = " (N where the model leaves a dimension free)" if None in sample else ""
        raise ConfigError(f"{what}: --input-shape {','.join(map(str, shape))} contradicts the model's own input "
                          f"({fixed}, one sample, H,W,C for images); give --input-shape {fixed.replace('?', 'N')}"
                          f"{free} or leave it out")


def _saved_keras(path: str, shape: Optional[Tuple[int, ...]]):
    """A saved Keras model (``.keras``, ``.h5``, or a SavedModel folder), loaded without compiling."""
    try:
        import tensorflow as tf
        load = tf.keras.models.load_model
    except ImportError:
        raise ConfigError(f"model file {path!r} needs TensorFlow (or Keras 3) to load; install tensorflow") from None
    try:
        model = load(path, compile=False)
    except Exception as exc:  # noqa: BLE001 - a file Keras cannot read
        raise ConfigError(f"model file {path!r} could not be loaded by Keras ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); give a .keras or .h5 file saved with model.save()") from None
    if shape is not None:
        _check_keras_input(model, shape, f"model file {path!r}")
    return model


def load_model(spec: Any, input_shape: Optional[Sequence[int]] = None, *, device: str = "meta") -> Any:
    """A built model for ``spec`` (``keras:NAME``, ``torchvision:NAME``, ``hf:NAME``,
    ``module.path:factory``); a model object is returned unchanged. ``input_shape``: one sample, no
    batch dimension — for Keras (height, width, channels), for torchvision (channels, height,
    width), for ``hf:`` (tokens,). ``device``: where ``torchvision:``/``hf:`` models are built
    (``"meta"``: shapes only, nothing allocated; ``"cuda"`` to run them)."""
    if not isinstance(spec, str):
        return spec
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up lines, before it imports
    shape = parse_shape(input_shape)
    if spec.lower().endswith((".keras", ".h5", ".hdf5")) or (os.path.isdir(spec) and
                                                              os.path.exists(os.path.join(spec, "saved_model.pb"))):
        if not os.path.exists(spec):
            raise ConfigError(f"model file {spec!r} does not exist (relative to {os.getcwd()})")
        return _saved_keras(spec, shape)
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ConfigError(f"model spec {spec!r}: use keras:NAME (e.g. keras:MobileNetV2), torchvision:NAME "
                          f"(e.g. torchvision:resnet50), hf:NAME (e.g. hf:gpt2) or module.path:factory")
    if kind.lower() in ("keras", "tf", "tensorflow"):
        return _keras_app(rest, shape)
    if kind.lower() in ("torchvision", "tv"):
        return _torchvision(rest, shape, device)
    if kind.lower() in ("hf", "huggingface", "transformers"):
        return _hf(rest, shape, device)
    return _user_factory(spec, shape)
