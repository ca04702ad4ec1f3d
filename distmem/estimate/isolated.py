"""Estimates of model specs in a child process, so that building the model cannot start the
framework's GPUs before ``distmem.init()`` applies its plan.

``distmem.init(strategy="pipeline", model="keras:ResNet50")`` must build the model to estimate its
layers. In this process that would create TensorFlow's eager context - on a GPU node every visible
GPU is then initialised, and the limits ``init()`` is about to set are refused ("Virtual devices
cannot be modified after being initialized"): distmem would make its own call too late. So a spec
that may build a Keras model (``keras:``, a saved ``.keras``/``.h5`` file, or a
``module.path:factory`` of either framework) is estimated in a child Python with no GPU visible
(the estimate is analytic: it models the GPU allocator without one), and the result comes back
pickled. Torch specs (``torchvision:``, ``hf:``) build on the meta device and stay in-process;
so does everything once TensorFlow has already started here, or with
``DISTMEM_ESTIMATE_IN_PROCESS=1``.
"""
from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
from typing import Any, Dict, Optional

from ..console import progress
from ..errors import ConfigError, DistmemError

__all__ = ["needs_child", "call", "start_child", "tf_context_started", "IN_PROCESS_VAR", "CHILD_TIMEOUT_S"]

IN_PROCESS_VAR = "DISTMEM_ESTIMATE_IN_PROCESS"
CHILD_TIMEOUT_S = 900.0
_TORCH_KINDS = ("torchvision", "tv", "hf", "huggingface", "transformers")


def tf_context_started() -> bool:
    """True once TensorFlow created its eager context in this process (its first op, model build,
    device listing or strategy). Never creates it."""
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context
    except ImportError:
        return False
    ctx = context.context_safe() if hasattr(context, "context_safe") else getattr(context, "_context", None)
    return ctx is not None and getattr(ctx, "_context_handle", None) is not None


def needs_child(spec: Any) -> bool:
    """True for a model spec string whose build may start TensorFlow in this process."""
    if not isinstance(spec, str) or os.environ.get(IN_PROCESS_VAR) == "1":
        return False
    kind = spec.partition(":")[0].lower()
    if kind in _TORCH_KINDS:
        return False
    return not tf_context_started()


def call(target: str, kwargs: Dict[str, Any], *, timeout: Optional[float] = None,
         hide_gpus: bool = True) -> Any:
    """``module:function(**kwargs)`` in a child Python (estimates in-process there); its return
    value, or the DistmemError it raised, re-raised here. ``hide_gpus``: the child sees no GPU
    (an analytic estimate models the GPU allocator without one); False for a measurement, which
    runs on the GPUs this process would use."""
    env = {IN_PROCESS_VAR: "1"}
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:  # a child that sees the GPUs takes what it uses, never the whole device
        env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    limit = CHILD_TIMEOUT_S if timeout is None else timeout
    progress(f"estimating {kwargs.get('model')} in a child process"
             + (f" at batch {kwargs['batch_size']}" if kwargs.get("batch_size") else "")
             + (f" (method {kwargs['method']})" if kwargs.get("method") else ""))
    try:
        done = start_child(target, kwargs, env, limit)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"estimating {kwargs.get('model')!r} in a child process took over {limit:.0f} s; pass "
                          "layers= (a LayerCost list) or stages= instead, or set DISTMEM_ESTIMATE_IN_PROCESS=1 "
                          "to estimate in this process (before the framework starts)") from None
    try:
        ok, value = pickle.loads(done.stdout) if done.stdout else (False, None)
    except Exception:  # noqa: BLE001 - a child that died before answering
        ok, value = False, None
    if ok:
        return value
    if isinstance(value, DistmemError):
        raise value
    tail = done.stderr.decode(errors="replace").strip().splitlines()[-5:]
    raise ConfigError(f"estimating {kwargs.get('model')!r} in a child process failed (exit {done.returncode}: "
                      f"{' | '.join(tail) or value}); run `distmem estimate --model ...` to see why, or set "
                      "DISTMEM_ESTIMATE_IN_PROCESS=1 to estimate in this process")


def start_child(target: str, kwargs: Dict[str, Any], env_overrides: Dict[str, str],
                timeout: float) -> "subprocess.CompletedProcess[bytes]":
    """Every child this package starts starts here: a Python running :func:`_child` on
    ``(target, kwargs)``, with ``env_overrides`` over this process's environment; its pickled
    answer on stdout. Raises ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    from .. import children  # an isolated sys.path: never a module from the working folder

    user_module = str(kwargs.get("model", "")).partition(":")[0]  # module.path:factory is found where it is here
    # a live module's classes (``modules``) are found where they are here too
    return children.run(module=__name__, input=pickle.dumps((target, kwargs)), capture_output=True,
                        env=dict(os.environ, **env_overrides), timeout=timeout,
                        extra_paths=children.import_folders(user_module, *kwargs.get("modules", ())))


def _child() -> int:
    target, kwargs = pickle.loads(sys.stdin.buffer.read())
    module, _, name = target.partition(":")
    answer = sys.stdout.buffer
    sys.stdout = sys.stderr  # anything the model code prints must not mix with the answer
    try:
        value = (True, getattr(importlib.import_module(module), name)(**kwargs))
    except DistmemError as exc:
        value = (False, exc)
    except Exception as exc:  # noqa: BLE001 - reported to the parent with its type
        value = (False, f"{type(exc).__name__}: {exc}")
    answer.write(pickle.dumps(value))
    answer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_child())
