"""What the measuring child process runs: rebuild the model there, on the device the job will use,
and measure its steps (``distmem.estimate.isolated.call`` starts it, a fresh interpreter: never a
fork of the caller, whatever the caller did with CUDA)."""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["measure_spec", "measure_module"]


def _cuda() -> Any:
    import torch
    from ...errors import ConfigError
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device is visible to the measuring child, and torch's CPU allocator keeps "
                          "no statistics")
    return torch


def measure_spec(model: str, framework: str, plan: Dict[str, Any], optimizer: Any, options: Dict[str, Any],
                 input_shape: Optional[Sequence[int]]) -> Dict[str, Any]:
    """Build ``model`` (a spec) here and return its measured peaks as ``plan`` says (``keras_steps`` /
    ``torch_steps``). ``optimizer`` and ``options`` come as ``measured.portable`` made them (an
    optimizer object as its class and configuration) and are rebuilt here. Keras on CPU counts every
    buffer, as distmem's TensorFlow adapter sets it up (``TF_CPU_ALLOCATOR_USE_BFC``); torch is built
    on the GPU with random weights."""
    if framework != "torch":  # before anything imports TensorFlow: it reads them when it loads
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from ..loader import load_model
    from .measured import MEASURE_STEPS, measure_keras
    from .portable import rebuild
    optimizer = rebuild(optimizer)
    options = rebuild(options)
    if framework == "torch":
        torch = _cuda()
        from ..torch.inputs import real_inputs
        from .torch_steps import as_param_dtype, dtype_or_none, torch_step_peaks
        built = as_param_dtype(load_model(model, input_shape, device="cuda"), options.get("param_dtype"))
        cast = dtype_or_none(options.get("param_dtype"))
        return torch_step_peaks(built, plan["batches"], inputs=lambda b: real_inputs(built, None, input_shape, b,
                                                                                      options.get("input_dtype"),
                                                                                      "cuda", cast=cast),
                                optimizer=optimizer, precision=options.get("precision"),
                                loss=options.get("loss", "auto"), steps=MEASURE_STEPS)
    precision = options.get("precision")
    if precision:
        import tensorflow as tf
        from ..precision import resolve_precision
        tf.keras.mixed_precision.set_global_policy(resolve_precision(precision).name)
    built = load_model(model, input_shape)
    return measure_keras(built, plan, optimizer, options, input_shape)


def _main_as_mp_main(path: Optional[str]) -> Optional[Any]:
    """The caller's script loaded under ``__mp_main__`` (what ``multiprocessing``'s spawn does), so
    classes and functions it defines unpickle here; its ``if __name__ == "__main__":`` part does
    not run."""
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = mod
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.append(folder)  # its own imports, after everything else (never the working folder)
    spec.loader.exec_module(mod)
    return mod


def measure_module(model: str, payload: str, main: Optional[str], modules: List[str], batches: Sequence[int],
                   input_shape: Any, input_dtype: Any, batch_dim: Any, precision: Any, steps: int,
                   param_dtype: Any, device: str = "cuda") -> Dict[str, Any]:
    """A live module handed over as ``torch.save`` of its state and code (``payload``), rebuilt on
    the GPU here (``device``; ``"cpu"``: measured by the profiler, the tests' stand-in) with the
    user's inputs and loss, and its peaks measured."""
    if device == "cpu":
        import torch
    else:
        torch = _cuda()
    from ...errors import ConfigError
    from ..torch.inputs import real_inputs
    from .torch_steps import as_param_dtype, dtype_or_none, torch_step_peaks
    mp_main = _main_as_mp_main(main)
    saved = sys.modules.get("__main__")
    if mp_main is not None:
        sys.modules["__main__"] = mp_main
    try:
        got = torch.load(payload, map_location=device, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - the remedy depends on what could not be found
        raise ConfigError(f"the measuring child could not rebuild {model} ({type(exc).__name__}: {str(exc)[:200]}); "
                          "its classes must be importable (a module, or the running script with its work under "
                          "if __name__ == '__main__':), or give a spec (module:factory)") from None
    finally:
        if mp_main is not None and saved is not None:
            sys.modules["__main__"] = saved
    built = as_param_dtype(got["model"].to(device), param_dtype)
    if got.get("compiled"):
        built = torch.compile(built)
    cast = dtype_or_none(param_dtype)
    example = got.get("example_input")
    return torch_step_peaks(built, batches, inputs=lambda b: real_inputs(built, example, input_shape, b, input_dtype,
                                                                          device, batch_dim=batch_dim, cast=cast),
                            optimizer=got.get("optimizer"), precision=precision, loss=got.get("loss", "auto"),
                            steps=steps, device=device)
