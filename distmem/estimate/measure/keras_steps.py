"""Real training steps of a Keras model, measured by TensorFlow's allocator.

The step is the model's own. A compiled model runs its own training as Keras builds it (its
``make_train_function``: the compiled loss, metrics and ``add_loss`` terms, a custom
``train_step`` too), fed labels made from each output's shape and its loss's kind (class indices
for a sparse loss, values in [0, 1) otherwise), in both the traces a job's training makes of it:
``train_on_batch`` (the batch dimension known when traced) and ``fit`` on a batched ``tf.data``
dataset (the batch dimension open), the second a retrace of the first's function, as in a job that
runs both; the worse is the step's peak.
Where the compiled loss cannot take such labels, or the model is not compiled, a generic loss
that fits any output structure (the mean square of every floating output, summed, plus the
model's own ``losses``): several outputs, sequences, segmentation maps, its forward with
``training=True``, the gradient of every trainable weight and the update. The optimizer is a
private copy of the user's (same class, same configuration; loss scaling under
``mixed_float16``, as Keras's ``compile`` adds), standing in as ``model.optimizer`` for the
steps. It runs on the model object itself, in this process, without re-serialising it (a
``Lambda``, a custom layer, a subclassed model, ``tf.recompute_grad`` inside a layer all run as
they do in training); the weights, the model's own optimizer, train function, history and step
counter are put back afterwards.
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...errors import ConfigError
from .extrapolate import Ladder

__all__ = ["keras_step_peaks", "keras_device", "keras_allocator_floor", "own_state_held_most", "TARGET_STEPS",
           "OTHER_STEPS", "TARGET_SECONDS", "TARGET_TRACES", "TRACE_STEPS"]


def keras_device() -> str:
    """The device TensorFlow places a step on here: ``"GPU:0"`` when it has one, else ``"CPU:0"``."""
    import tensorflow as tf
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def keras_allocator_floor(device: str) -> int:
    """Bytes below which this process's allocator statistics for ``device`` skip a buffer: on a CPU
    whose allocator is oneDNN's pool rather than TensorFlow's BFC allocator
    (``TF_CPU_ALLOCATOR_USE_BFC`` unset when TensorFlow started), :data:`TF_CPU_UNCOUNTED_BELOW`;
    else 0. Found by allocating a 4 KiB tensor and reading whether the statistics saw it (the
    environment may have changed since TensorFlow read it); the model of the measured device must
    leave out what the measurement could not see."""
    if not str(device).upper().startswith("CPU"):
        return 0
    import tensorflow as tf
    from ..keras.kernels import TF_CPU_UNCOUNTED_BELOW
    info = tf.config.experimental.get_memory_info
    with tf.device(device):
        before = int(info(device)["current"])
        probe = tf.fill([1024], tf.constant(1.0))
        seen = int(info(device)["current"]) > before
        del probe
    return 0 if seen else TF_CPU_UNCOUNTED_BELOW


def _losses_of(loss, names: Sequence[str], n: int) -> List[Any]:
    """One loss per output (``names``: each output's name, in the order the labels go): the compiled
    one (a name, object, function, list or dict), or None."""
    if loss is None:
        return [None] * n
    if isinstance(loss, dict):
        return [loss.get(nm) for nm in names]
    if isinstance(loss, (list, tuple)):
        return list(loss) + [None] * (n - len(loss))
    return [loss] * n


def _loss_fn(loss, K):
    if loss is None:
        return None
    return K.losses.get(loss) if isinstance(loss, (str, dict)) else loss


def _loss_name(fn) -> str:
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__).lower()


def _label_specs(outputs: Sequence[Any], fns: Sequence[Any], sparse: Optional[bool]) -> List[Any]:
    """``(shape without the batch, dtype, classes)`` of each output's labels: class indices for a
    sparse loss (``sparse=None``: as the loss's name says; True/False: forced), values otherwise."""
    out = []
    for o, fn in zip(outputs, fns):
        shape = [int(d or 1) for d in tuple(o.shape)[1:]]
        use_sparse = ("sparse" in _loss_name(fn)) if sparse is None and fn is not None else bool(sparse)
        if use_sparse and shape:
            out.append((shape[:-1], "int32", max(1, shape[-1])))
        else:
            out.append((shape, "float32", 0))
    return out


def _labels(specs, batch: int, np) -> List[Any]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, classes, [batch] + shape).astype(dtype) if classes else
            rng.random([batch] + shape, dtype=np.float32) for shape, dtype, classes in specs]


def _input_specs(model, input_shape: Optional[Sequence[int]]) -> List[Any]:
    """``(shape without the batch, dtype)`` of each model input: its ``inputs``, else (a subclassed
    model) the shape it was built with or ``input_shape``."""
    ins = list(getattr(model, "inputs", None) or [])
    if ins:
        return [([int(d or 1) for d in tuple(t.shape)[1:]], getattr(t.dtype, "name", None) or str(t.dtype))
                for t in ins]
    built = getattr(model, "_build_input_shape", None) or getattr(model, "_build_shapes_dict", None)
    if isinstance(built, dict) and len(built) == 1:
        built = next(iter(built.values()))
    if built is not None and not isinstance(built, dict):
        dims = tuple(getattr(d, "value", d) for d in tuple(built))
        if dims and all(isinstance(d, int) for d in dims[1:]):
            return [([int(d) for d in dims[1:]], "float32")]
    if input_shape:
        return [([int(d) for d in input_shape], "float32")]
    raise ConfigError(f"Keras model {getattr(model, 'name', '?')} has no known input shape (a subclassed model "
                      f"that was not built); call model.build((None, ...)) or pass input_shape=")


def _inputs(specs, batch: int, np) -> List[Any]:
    rng = np.random.default_rng(0)
    xs = []
    for shape, dtype in specs:
        if "int" in dtype:
            xs.append(rng.integers(0, 2, [batch] + shape).astype(dtype))
        else:
            xs.append(rng.random([batch] + shape, dtype=np.float32).astype(dtype))
    return xs


def _optimizer(optimizer: Any, K, scaled: bool):
    from ..optimizers import keras_optimizer
    _, opt = keras_optimizer(optimizer)
    fresh = type(opt).from_config(opt.get_config())
    if scaled and "LossScale" not in type(fresh).__name__:
        fresh = K.mixed_precision.LossScaleOptimizer(fresh)
    return fresh


def _signature(specs, tf):
    """One ``TensorSpec`` per tensor, the batch dimension open: one trace serves every batch."""
    return [tf.TensorSpec([None] + list(spec[0]), tf.as_dtype(spec[1])) for spec in specs]


def _generic_step(model, opt, in_specs, tf):
    """The training step with a loss that fits any outputs: the mean square of every floating
    output, summed, plus the model's own ``losses`` (regularisers, ``add_loss``); no labels."""
    variables = model.trainable_variables

    def step(xs):
        with tf.GradientTape() as tape:
            preds = model(xs if len(xs) > 1 else xs[0], training=True)
            parts = [tf.reduce_mean(tf.square(tf.cast(p, tf.float32))) for p in tf.nest.flatten(preds)
                     if getattr(p, "dtype", None) is not None and p.dtype.is_floating]
            parts += [tf.cast(x, tf.float32) for x in model.losses]
            loss = tf.add_n(parts)
            if hasattr(opt, "scale_loss"):  # Keras 3 (identity unless it scales)
                loss = opt.scale_loss(loss)
            elif hasattr(opt, "get_scaled_loss"):  # tf.keras 2's LossScaleOptimizer
                loss = opt.get_scaled_loss(loss)
        grads = tape.gradient(loss, variables)
        if hasattr(opt, "get_unscaled_gradients") and not hasattr(opt, "scale_loss"):
            grads = opt.get_unscaled_gradients(grads)
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
        return loss
    fn = tf.function(step, input_signature=[_signature(in_specs, tf)])
    return lambda xs, ys: fn(xs)


def _compiled(model) -> bool:
    compiled = getattr(model, "_is_compiled", None)  # tf.keras 2
    if compiled is None:
        compiled = getattr(model, "compiled", False)  # Keras 3
    return bool(compiled)


def _tuples(v):
    """``v`` with its lists made tuples: ``tf.data`` stacks a list into one tensor, Keras reads a
    tuple as the structure it is (several inputs, several outputs)."""
    if isinstance(v, (list, tuple)):
        return tuple(_tuples(e) for e in v)
    if isinstance(v, dict):
        return {k: _tuples(e) for k, e in v.items()}
    return v


class _OwnTraining:
    """A compiled model's own training, as Keras builds it (its ``make_train_function``: the compiled
    loss, metrics, ``add_loss`` terms, a ``train_step`` of its own, the ``jit_compile`` and
    ``steps_per_execution`` it was compiled with), labels as ``label_specs`` describe them, nested as
    the model's outputs are (``structure``). Each batch runs in both the traces a job's training
    makes of that function, the open one a second trace of the static one's function:

    * ``static``: ``train_on_batch`` (and ``fit`` on arrays whose length the batch divides): the
      batch dimension known when the step is traced;
    * ``open``: ``fit`` on a ``tf.data`` dataset batched without ``drop_remainder`` (and on arrays
      with a last partial batch): the batch dimension open. TensorFlow plans a step traced this way
      differently: recurrent layers' loops held 30-45% more (a bidirectional GRU tagger at batch 16:
      42-47 MB open, 31-35 MB static).

    The step's peak is the worse of the two, as a limit must hold whichever the job's input makes.
    The open trace runs on the function the static one traced, not a fresh one: a job that calls
    both (``train_on_batch`` to warm up, then ``fit``) holds both traces, and its ``fit`` steps read
    higher than a fresh function's (the held-out VAE of bench/estimate/keras_heldout.py at batch 32,
    TF 2.15: 24.5-25.4 MB with a 29.2 MB step, against 23.1-24.9 MB)."""

    def __init__(self, model, in_specs, label_specs, structure, tf):
        self.model, self.in_specs, self.specs, self.structure, self.tf = model, in_specs, label_specs, structure, tf
        self.saved = {k: getattr(model, k, None) for k in ("train_function", "history", "stop_training")}
        #: why the open-batch trace did not run (None: it ran)
        self.open_refused: Optional[str] = None
        counter = getattr(model, "_train_counter", None)
        self.counter = int(counter.numpy()) if counter is not None and hasattr(counter, "assign") else None

    def _batch(self, xs, ys):
        x = xs[0] if len(xs) == 1 else tuple(xs)
        if getattr(self.model, "loss", None) is None:
            return (x,)  # the model's own losses only (add_loss)
        return (x, _tuples(self.tf.nest.pack_sequence_as(self.structure, list(ys))))

    def steps(self, xs, ys, n, dev, other, fresh=True) -> List[int]:
        """``n`` static steps on a fresh train function, then ``n`` open ones on the same function
        (``fresh``: always)."""
        tf, model = self.tf, self.model
        info = tf.config.experimental.get_memory_info
        data = self._batch(xs, ys)
        seen: List[int] = []
        # static: a fresh train function, traced at this batch
        model.train_function = None
        for _ in range(max(1, n)):
            tf.config.experimental.reset_memory_stats(dev)
            model.train_on_batch(*data)
            seen.append(max(0, int(info(dev)["peak"]) - other))
        if self.open_refused:  # an earlier trace found the step cannot be traced open
            return seen
        # open: the same train function traced again, fed by fit from a dataset whose batch dimension is open
        batch = int(tf.nest.flatten(data)[0].shape[0])
        ds = tf.data.Dataset.from_tensors(data).unbatch().batch(batch).repeat()
        got: List[int] = []

        class _Peaks(tf.keras.callbacks.Callback):
            def on_train_batch_begin(self, b, logs=None):
                tf.config.experimental.reset_memory_stats(dev)

            def on_train_batch_end(self, b, logs=None):
                got.append(max(0, int(info(dev)["peak"]) - other))
        try:
            model.fit(ds, epochs=1, steps_per_epoch=max(1, n), verbose=0, callbacks=[_Peaks()])
        except tf.errors.ResourceExhaustedError:
            raise
        except (tf.errors.InvalidArgumentError, ValueError, TypeError) as exc:
            # a step that needs its batch dimension known (a reshape by the static batch size) cannot
            # be traced open: the job cannot run it so either (it batches with drop_remainder)
            self.open_refused = f"{type(exc).__name__}: {_first_line(exc)}"
            return seen
        return seen + got

    def restore(self) -> None:
        for k, v in self.saved.items():
            try:
                setattr(self.model, k, v)
            except Exception:  # noqa: BLE001 - an attribute this Keras does not let be set
                pass
        counter = getattr(self.model, "_train_counter", None)
        if self.counter is not None and counter is not None:
            counter.assign(self.counter)


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


def _outputs(model, in_specs, np, tf) -> Tuple[Any, List[Any], List[str]]:
    """``(structure, flat outputs, their names)``: the model's outputs as its call nests them (a
    dict of named outputs, a list, one tensor) — read from its graph, else (a subclassed model) from
    a forward pass at batch 1 — flattened in the order ``tf.nest`` packs them back."""
    struct = getattr(model, "_nested_outputs", None)  # tf.keras 2 functional
    if struct is None:
        struct = getattr(model, "_outputs_struct", None)  # Keras 3 functional
    if struct is None and getattr(model, "outputs", None):
        outs = list(model.outputs)
        struct = outs if len(outs) > 1 else outs[0]
    if struct is None:
        xs = [tf.constant(a) for a in _inputs(in_specs, 1, np)]
        struct = model(xs if len(xs) > 1 else xs[0], training=False)
    flat = list(tf.nest.flatten(struct))
    if isinstance(struct, dict):
        names = sorted(struct)
    else:
        names = list(getattr(model, "output_names", None) or [])
        names = names if len(names) == len(flat) else [str(i) for i in range(len(flat))]
    return struct, flat, names


def own_state_held_most(model: Any) -> int:
    """The most TensorFlow's allocator can be holding for ``model``'s own state: its variables
    (weights, and the seed and metric states it tracks), each request rounded up to
    :data:`~distmem.estimate.allocators.BFC_MIN_ALLOCATION` and handed a chunk under twice that and
    under :data:`~distmem.estimate.allocators.BFC_MAX_INTERNAL_FRAGMENTATION` more (a larger free
    chunk is split). The allocator counts the whole chunk as in use: a 3,072,000-byte embedding
    table built in a fresh process holds 4-5.3 MB, and the model's state so held is alive in every
    step of the job; only what the process holds beyond this is another's."""
    from ..allocators import bfc_held_most
    seen: Dict[int, Any] = {}
    for v in list(getattr(model, "weights", None) or []) + list(getattr(model, "variables", None) or []):
        seen.setdefault(id(v), v)
    return sum(bfc_held_most(_variable_nbytes(v)) for v in seen.values())


def _variable_nbytes(v: Any) -> int:
    """Bytes of one variable (tf.Variable or Keras 3's)."""
    from ..keras.access import numel
    import tensorflow as tf
    dtype = getattr(v, "dtype", None)
    return numel(tuple(v.shape)) * tf.as_dtype(getattr(dtype, "name", None) or str(dtype)).size


#: Steps measured at the target batch (the worst kept: TensorFlow's executor order moves one step's
#: peak by 10-20% from step to step — InceptionBlocks at 64 px, batch 16: 49.5 to 62.9 MB over twelve
#: steps in four processes — and the worst of four missed the reference's worst of three by up to
#: 12.5% on the fit half of bench/estimate/keras_heldout.py, where more steps reach further into that
#: tail) and at each other batch of a ladder.
TARGET_STEPS = 6
OTHER_STEPS = 2

#: After its six steps, the target batch keeps running in fresh traces (a new train function each,
#: ``TRACE_STEPS`` steps of each trace kind) while the target's steps have taken under
#: ``TARGET_SECONDS`` and at most ``TARGET_TRACES`` traces ran: the executor's order is drawn again
#: with each trace, and its high mode is what a limit must hold. Where a step is cheap its peak is
#: mostly state and update temporaries that order decides (the three-layer MLP of issue 37: 1.24 to
#: 1.72 MB over processes, six steps in one trace reaching 1.41 MB while another process's twelve
#: read 1.67 MB; a hundred steps over ten traces read 1.56-1.73 MB in each of twelve processes), so
#: those get the most draws; a step that takes seconds gets its six, as before. Three seconds, not
#: more: ten (every draw of the benchmark's default part run again, TF 2.15,
#: bench/results/estimate_keras_heldout_tf215_target10s.jsonl) gave the held-out half a mean 4.9%,
#: worst -16.3% and max +21.5% against 3.8%, -14.1% and +7.5% at three, for 5-7 s more: a figure
#: moves from process to process (FPNSeg 39.7 MB, then 33.5 MB with more draws) by as much as the
#: reference does, and more draws in one process do not reach another process's level.
TARGET_SECONDS = 3.0
TARGET_TRACES = 16
TRACE_STEPS = 3


def keras_step_peaks(model: Any, batches: Any, optimizer: Any = "adam", *, steps: int = OTHER_STEPS,
                     target_steps: int = TARGET_STEPS, precision: Any = None, foreign: bool = True,
                     input_shape: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Allocator peaks of real training steps of ``model`` on the device TensorFlow uses here, the
    largest per batch (the first step included, as a memory limit must allow). ``batches``: a
    :class:`~distmem.estimate.measure.extrapolate.Ladder` (its target batch runs ``target_steps``
    steps, then more in fresh traces while :data:`TARGET_SECONDS` allow; the others ``steps``; a
    batch that runs out of memory ends its climb) or a list of batches (``steps`` each). ``foreign``: subtract what this process held before beyond the
    most the model's own state can occupy in the allocator (:func:`own_state_held_most`: another
    model, earlier tensors), so a model measured inside a busy process reads as in a fresh one, and
    one measured where it was just built (nothing else alive) reads as the allocator's own peak.
    Returns ``{"device", "peaks": {batch: bytes}, "steps": {batch: [...]}, "loss", "seconds",
    "floor", "ladder", "foreign"}`` (``foreign``: the bytes subtracted from every step)."""
    import numpy as np
    import tensorflow as tf
    K = tf.keras
    t0 = time.time()
    dev = keras_device()
    ladder = batches if isinstance(batches, Ladder) else None
    info = tf.config.experimental.get_memory_info
    weights = model.get_weights()
    policy = str(getattr(getattr(model, "dtype_policy", None), "name", "") or "")
    scaled = "mixed_float16" in (str(precision or "") or policy) or policy == "mixed_float16"
    # before the optimizer's slots exist: they are the steps', not foreign; garbage collected first,
    # so what is foreign does not shrink under the steps (a peak below it would read as nothing)
    gc.collect()
    other = max(0, int(info(dev)["current"]) - own_state_held_most(model)) if foreign else 0
    peaks: Dict[int, int] = {}
    per_step: Dict[int, List[int]] = {}
    try:
        in_specs = _input_specs(model, input_shape)
        # not built here: the first step creates the optimizer's slots, as the job's first step does
        # (their initial values are in flight then: that step is often the worst)
        opt = _optimizer(optimizer, K, scaled)
        with _standing_in(model, opt):
            loss = _run_any(model, opt, in_specs, ladder, batches, steps, target_steps, dev, other, peaks,
                            per_step, np, K, tf, renew=lambda: _optimizer(optimizer, K, scaled))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model whose step cannot run here: said, not hidden
        raise ConfigError(f"could not run training steps of Keras model {getattr(model, 'name', '?')} to measure "
                          f"it ({type(exc).__name__}: {str(exc)[:300]}); use method='model' for the analytic "
                          f"estimate alone") from None
    finally:
        model.set_weights(weights)
    if not peaks:
        why = "; ".join(f"batch {b}: {w}" for b, w in (ladder.refused.items() if ladder else []))
        raise ConfigError(f"no training step of Keras model {getattr(model, 'name', '?')} fitted the memory at hand "
                          f"({why or 'nothing ran'}); give memory_at_hand= or use method='model'")
    return {"device": dev, "peaks": peaks, "steps": per_step, "loss": loss, "floor": keras_allocator_floor(dev),
            "ladder": ladder.summary() if ladder else None, "foreign": other, "seconds": round(time.time() - t0, 3)}


def _run_any(model, opt, in_specs, ladder, batches, steps, target_steps, dev, other, peaks, per_step,
             np, K, tf, renew=None) -> str:
    """Run the ladder (or batches) with the first step that runs: the model's compiled step with
    labels as its loss names them, then with class indices, then with values, then the generic loss.
    ``renew()``: a new optimizer like ``opt``, for each fresh trace of the target batch
    (:class:`_Renewal`). Returns which one ran."""
    tried: List[str] = []
    candidates = []
    if _compiled(model) and (getattr(model, "loss", None) is not None or getattr(model, "losses", None)):
        struct, outs, names = _outputs(model, in_specs, np, tf)
        fns = [_loss_fn(x, K) for x in _losses_of(getattr(model, "loss", None), names, len(outs))]
        for sparse, what in ((None, "compiled"), (True, "compiled, class-index labels"),
                             (False, "compiled, value labels")):
            specs = _label_specs(outs, fns, sparse)
            if any(specs == c[1] for c in candidates):
                continue
            candidates.append((what, specs, struct))
    candidates.append(("generic (mean square of every output)", None, None))
    for what, specs, struct in candidates:
        own = _OwnTraining(model, in_specs, specs, struct, tf) if specs is not None else None
        renewal = _Renewal(model, opt, renew, dev, tf)
        step = own.steps if own is not None else _generic_steps(
            lambda: _generic_step(model, renewal.opt, in_specs, tf), tf)
        try:
            _run(step, in_specs, specs, ladder, batches, steps, target_steps, dev, other, peaks, per_step, np, tf,
                 renewal=renewal)
            if own is not None and own.open_refused:
                what += f" (the batch dimension known only: traced open it failed, {own.open_refused})"
            return what if not tried else f"{what}; not {', '.join(tried)}"
        except tf.errors.ResourceExhaustedError:
            raise
        except (tf.errors.InvalidArgumentError, ValueError, TypeError) as exc:
            if peaks:  # it ran before: this is not about the labels
                raise
            tried.append(f"{what} ({type(exc).__name__}: {_first_line(exc)})")
        finally:
            if own is not None:
                own.restore()
    raise ConfigError("no training step ran: " + "; ".join(tried))


def _generic_steps(make, tf):
    """``steps(xs, ys, n, dev, other, fresh=False)`` of the generic step: ``n`` steps fed from an
    iterator, as ``model.fit`` feeds a batch (the element the iterator hands the step is the step's);
    one trace serves every batch, ``fresh`` traces it again (``make()``: a new step)."""
    info = tf.config.experimental.get_memory_info
    step = make()

    def steps(xs, ys, n, dev, other, fresh=False):
        nonlocal step
        if fresh:
            step = make()
        batches_of = iter(tf.data.Dataset.from_tensors((tuple(xs), tuple(ys))).repeat())
        seen: List[int] = []
        for _ in range(max(1, n)):
            tf.config.experimental.reset_memory_stats(dev)
            x_, y_ = next(batches_of)
            step(list(x_), list(y_))
            del x_, y_
            seen.append(max(0, int(info(dev)["peak"]) - other))
        return seen
    return steps


def _optimizer_variables(opt: Any) -> List[Any]:
    got = getattr(opt, "variables", [])
    got = got() if callable(got) else got
    return list(got or [])


class _Renewal:
    """A new optimizer for each fresh trace of the target batch: its slots are made again by the
    trace's first step, as a job's first step makes them, so the allocator's layout of the state is
    drawn again with the executor's order (a process's "level": the held-out FPNSeg of
    bench/estimate/keras_heldout.py at batch 8, TF 2.15, steps at 33.5 MB in most processes and at
    39-40 MB in some; a new function alone re-draws the order and not the layout of the state).

    TensorFlow does not free the old slots when the old optimizer goes (the held-out MLP3: the
    allocator's ``current`` grows by every byte of them, 537,688 B, at each renewal; FPNSeg by
    0.85-1.45 MB): what the renewal left alive beyond the model's own state is foreign to the later
    traces, as what the process held before the steps is (``renew()`` returns the bytes to
    subtract from them). Each batch after the first starts afresh (:meth:`fresh_start`)."""

    def __init__(self, model, opt, make, dev, tf):
        self.model, self.opt, self.make, self.dev, self.tf = model, opt, make, dev, tf
        self.left = 0
        self.base = self.current()

    def current(self) -> int:
        """The allocator's bytes in use, garbage collected first."""
        gc.collect()
        return int(self.tf.config.experimental.get_memory_info(self.dev)["current"])

    def _replace(self) -> int:
        """A new optimizer where the old one was built (a step ran with it); returns the old one's
        slot bytes (0: not built, nothing of it to draw again, nothing replaced)."""
        slots = sum(_variable_nbytes(v) for v in _optimizer_variables(self.opt))
        if slots:
            self.opt = self.make()
            self.model.optimizer = self.opt
        return slots

    def fresh_start(self) -> int:
        """Before another batch of the ladder: a new optimizer (where the old one was built), as a job
        starts, and every byte alive beyond what the first step found is foreign to it — the earlier
        batches' and traces' slots and what each trace leaves beside them (its function's, its
        dataset's). Counted, the three-layer MLP of issue 37 read 3.1 MB at batch 4 after its target's
        traces against 1.6 MB at batch 16: the figures ``fit`` priced its micro-batches at. Call it
        before the batch's inputs exist (they are the step's)."""
        if self.make is None:
            return self.left
        self._replace()
        return max(0, self.current() - self.base)

    def renew(self) -> int:
        if self.make is None:
            return self.left
        before = self.current()
        slots = self._replace()
        if slots:
            self.left += max(0, self.current() - (before - slots))
        return self.left


def _first_line(exc: Exception) -> str:
    """The line of a TensorFlow error that says what went wrong (not "in user code:")."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("in user code", "File ", "return ", "raise "))]
    return (useful[-1] if useful else (lines[0] if lines else type(exc).__name__))[:160]


def _run(step, in_specs, label_specs, ladder, batches, steps, target_steps, dev, other, peaks, per_step,
         np, tf, renewal=None) -> None:
    todo = list(batches) if ladder is None else None
    first = True
    while True:
        b = ladder.next() if ladder is not None else (todo.pop(0) if todo else None)
        if b is None:
            return
        # a batch after others starts as a job does, what they left alive not its own
        later = renewal is not None and not first
        before = renewal.fresh_start() if later else 0
        first = False
        xs = [tf.constant(a) for a in _inputs(in_specs, int(b), np)]
        ys = [tf.constant(a) for a in _labels(label_specs, int(b), np)] if label_specs is not None else []
        target = ladder is not None and int(b) == ladder.target
        n = target_steps if target else steps
        try:
            t0 = time.time()
            seen = step(xs, ys, n, dev, other + before, fresh=True) if later else step(xs, ys, n, dev, other)
            traces = 1
            while target and time.time() - t0 < TARGET_SECONDS and traces < TARGET_TRACES:
                left = renewal.renew() if renewal is not None else 0
                seen = seen + step(xs, ys, TRACE_STEPS, dev, other + before + left, fresh=True)
                traces += 1
        except tf.errors.ResourceExhaustedError as exc:
            if ladder is None:
                raise
            ladder.failed(int(b), f"out of memory ({str(exc).splitlines()[0][:160]})")
            del xs, ys
            gc.collect()
            continue
        per_step[int(b)] = seen
        peaks[int(b)] = max(seen)
        if ladder is not None:
            ladder.record(int(b), peaks[int(b)])
        del xs, ys
