"""Real training steps of a Keras model at small batches, measured by TensorFlow's allocator.

The step is the model's own: its forward with ``training=True``, its compiled loss where it has one
(labels made from each output's shape and the loss's kind: class indices for a sparse loss, values
in [0, 1) otherwise), else a generic loss that fits any output structure (the mean square of every
floating output, summed: several outputs, sequences, segmentation maps), the gradient of every
trainable weight, and the update by a private copy of the optimizer (same class, same
configuration; loss scaling under ``mixed_float16``, as Keras's ``compile`` adds). It runs on the
model object itself, in this process, without re-serialising it (a ``Lambda``, a custom layer,
``tf.recompute_grad`` inside a layer all run as they do in training); the weights are put back
afterwards, the user's optimizer and compiled state are not touched.
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Dict, List, Sequence

from ...errors import ConfigError

__all__ = ["keras_step_peaks", "keras_device"]


def keras_device() -> str:
    """The device TensorFlow places a step on here: ``"GPU:0"`` when it has one, else ``"CPU:0"``."""
    import tensorflow as tf
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _losses_of(model, K) -> List[Any]:
    """One loss per output: the compiled one (a name, object, function, list or dict), or None."""
    names = list(getattr(model, "output_names", None) or [])
    n = len(model.outputs)
    loss = getattr(model, "loss", None)
    if loss is None:
        return [None] * n
    if isinstance(loss, dict):
        return [loss.get(nm) for nm in names] if names else list(loss.values())[:n]
    if isinstance(loss, (list, tuple)):
        return list(loss) + [None] * (n - len(loss))
    return [loss] * n


def _loss_fn(loss, K):
    if loss is None:
        return None
    return K.losses.get(loss) if isinstance(loss, (str, dict)) else loss


def _loss_name(fn) -> str:
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__).lower()


def _labels(model, batch: int, fns: Sequence[Any], np) -> List[Any]:
    rng = np.random.default_rng(1)
    ys = []
    for out, fn in zip(model.outputs, fns):
        shape = [int(d or 1) for d in tuple(out.shape)[1:]]
        if fn is not None and "sparse" in _loss_name(fn) and shape:
            ys.append(rng.integers(0, max(1, shape[-1]), [batch] + shape[:-1]).astype("int32"))
        else:
            ys.append(rng.random([batch] + shape, dtype=np.float32))
    return ys


def _inputs(model, batch: int, np) -> List[Any]:
    rng = np.random.default_rng(0)
    xs = []
    for t in model.inputs:
        shape = [batch] + [int(d or 1) for d in tuple(t.shape)[1:]]
        dtype = getattr(t.dtype, "name", None) or str(t.dtype)
        if "int" in dtype:
            xs.append(rng.integers(0, 2, shape).astype(dtype))
        else:
            xs.append(rng.random(shape, dtype=np.float32).astype(dtype))
    return xs


def _optimizer(optimizer: Any, K, scaled: bool):
    from ..optimizers import keras_optimizer
    _, opt = keras_optimizer(optimizer)
    fresh = type(opt).from_config(opt.get_config())
    if scaled and "LossScale" not in type(fresh).__name__:
        fresh = K.mixed_precision.LossScaleOptimizer(fresh)
    return fresh


def _step_fn(model, opt, fns, tf):
    """The training step as a ``tf.function``: forward, loss, gradients, update (scaled where the
    optimizer scales)."""
    variables = model.trainable_variables

    def total_loss(ys, preds):
        preds = preds if isinstance(preds, (list, tuple)) else [preds]
        parts = []
        for y, p, fn in zip(ys, preds, fns):
            p = tf.cast(p, tf.float32)
            if fn is None:
                parts.append(tf.reduce_mean(tf.square(p - y)))
            else:
                parts.append(tf.reduce_mean(fn(y, p)))
        return tf.add_n(parts)

    @tf.function(reduce_retracing=True)
    def step(xs, ys):
        with tf.GradientTape() as tape:
            preds = model(xs if len(xs) > 1 else xs[0], training=True)
            loss = total_loss(ys, preds)
            if hasattr(opt, "scale_loss"):  # Keras 3 (identity unless it scales)
                loss = opt.scale_loss(loss)
            elif hasattr(opt, "get_scaled_loss"):  # tf.keras 2's LossScaleOptimizer
                loss = opt.get_scaled_loss(loss)
        grads = tape.gradient(loss, variables)
        if hasattr(opt, "get_unscaled_gradients") and not hasattr(opt, "scale_loss"):
            grads = opt.get_unscaled_gradients(grads)
        opt.apply_gradients(zip(grads, variables))
        return loss
    return step


def _own_step(model, opt, tf):
    """A compiled model's own ``train_step`` (its compiled loss and metrics), with ``opt`` standing in
    for its optimizer while it runs; None where the model is not compiled."""
    compiled = getattr(model, "_is_compiled", None)  # tf.keras 2
    if compiled is None:
        compiled = getattr(model, "compiled", False)  # Keras 3
    if not compiled or getattr(model, "loss", None) is None:
        return None
    own = model.train_step

    @tf.function(reduce_retracing=True)
    def step(xs, ys):
        return own((xs if len(xs) > 1 else xs[0], ys if len(ys) > 1 else ys[0]))
    return step


@contextlib.contextmanager
def _standing_in(model, opt):
    """``opt`` as ``model.optimizer`` for the block; the model's own optimizer and metric states
    back afterwards."""
    had = "optimizer" in model.__dict__ or hasattr(model, "optimizer")
    saved = getattr(model, "optimizer", None)
    try:
        model.optimizer = opt
        yield
    finally:
        if had:
            model.optimizer = saved
        try:
            model.reset_metrics()
        except Exception:  # noqa: BLE001 - a model without metrics
            pass


def keras_step_peaks(model: Any, batches: Sequence[int], optimizer: Any = "adam", *, steps: int = 2,
                     precision: Any = None, foreign: bool = True) -> Dict[str, Any]:
    """Allocator peaks of ``steps`` real training steps of ``model`` at each of ``batches`` (the
    largest per batch, the first step included, as a memory limit must allow), on the device
    TensorFlow uses here. ``foreign``: subtract what this process held before beyond the model's
    own weights (another model, earlier tensors), so a model measured inside a busy process reads
    as in a fresh one. Returns ``{"device", "peaks": {batch: bytes}, "steps": {batch: [...]},
    "loss", "seconds"}``."""
    import numpy as np
    import tensorflow as tf
    K = tf.keras
    t0 = time.time()
    dev = keras_device()
    info = tf.config.experimental.get_memory_info
    weights = model.get_weights()
    policy = str(getattr(getattr(model, "dtype_policy", None), "name", "") or "")
    scaled = "mixed_float16" in (str(precision or "") or policy) or policy == "mixed_float16"
    fns = [_loss_fn(l, K) for l in _losses_of(model, K)]
    # before the optimizer's slots exist: they are the step's, not foreign; garbage collected first,
    # so what is foreign does not shrink under the steps (a peak below it would read as nothing)
    gc.collect()
    other = max(0, int(info(dev)["current"]) - sum(int(w.nbytes) for w in weights)) if foreign else 0
    try:
        opt = _optimizer(optimizer, K, scaled)
        if hasattr(opt, "build"):
            opt.build(model.trainable_variables)
        step = _own_step(model, opt, tf) or _step_fn(model, opt, fns, tf)
        peaks: Dict[int, int] = {}
        per_step: Dict[int, List[int]] = {}
        with _standing_in(model, opt):
            _run(model, batches, step, fns, steps, dev, other, peaks, per_step, np, tf)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model whose step cannot run here: said, not hidden
        raise ConfigError(f"could not run training steps of Keras model {getattr(model, 'name', '?')} to measure "
                          f"it ({type(exc).__name__}: {str(exc)[:300]}); use method='model' for the analytic "
                          f"estimate alone") from None
    finally:
        model.set_weights(weights)
    loss = "compiled" if any(f is not None for f in fns) else "generic (mean square of every output)"
    return {"device": dev, "peaks": peaks, "steps": per_step, "loss": loss,
            "seconds": round(time.time() - t0, 3)}


def _run(model, batches, step, fns, steps, dev, other, peaks, per_step, np, tf) -> None:
    info = tf.config.experimental.get_memory_info
    for b in batches:
        xs = [tf.constant(a) for a in _inputs(model, int(b), np)]
        ys = [tf.constant(a) for a in _labels(model, int(b), fns, np)]
        seen = []
        for _ in range(max(1, steps)):
            tf.config.experimental.reset_memory_stats(dev)
            step(xs, ys)
            seen.append(max(0, int(info(dev)["peak"]) - other))
        per_step[int(b)] = seen
        peaks[int(b)] = max(seen)
        del xs, ys
