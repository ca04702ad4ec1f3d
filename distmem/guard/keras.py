"""The guard for ``model.fit``: a callback that swaps in a guarded train function.

    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)      # or a plain optimizer under mpirun
    model.fit(local_batches, callbacks=[distmem.guard.KerasGuard(micro_batch_size=32, global_batch_size=256)])

At ``on_train_begin`` it replaces ``model.train_function`` (Keras's documented hook: ``fit`` calls it
once per batch with the data iterator) with a Python function that fetches the batch and runs the
guarded step: micro-batch gradients from one compiled function, the flag all-reduce, then the
gradient all-reduce and ``optimizer.apply_gradients`` in another compiled function. Metrics updated
by a dropped attempt are rolled back. If the data runs out on any rank, every rank ends the epoch.
At ``on_train_end`` Keras gets its own train function back.

Gradient all-reduce: a Horovod ``DistributedOptimizer`` does it (its compression and process set
apply; ``backward_passes_per_step`` must stay 1 because the guard accumulates); otherwise the job's
transport (Horovod, MPI) does, as in :func:`distmem.guard.step`.
Limits: ``steps_per_execution`` must be 1; no tf.distribute strategy; a LossScaleOptimizer is not
unwrapped (use float32 or scale in a custom loop).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import tensorflow as tf

from ..comm import Comm
from ..errors import ConfigError
from .step import StepGuard

__all__ = ["KerasGuard"]


def _is_horovod_optimizer(opt: Any) -> bool:
    return callable(getattr(opt, "_allreduce", None)) and hasattr(opt, "_allreduce_grads")


class KerasGuard(tf.keras.callbacks.Callback):
    """Callback: the OOM guard around every training batch of ``fit``. Same arguments as
    :func:`distmem.guard.step` (``micro_batch_size``, ``global_batch_size``, ``min_micro_batch_size``,
    ``shrink``, ``comm``, ``timeout``, ``reduce_gradients``). ``guard`` is the StepGuard once training
    began: ``guard.fallbacks``, ``guard.micro_batch_size``."""

    def __init__(self, micro_batch_size: int, global_batch_size: Optional[int] = None, *, comm: Optional[Comm] = None,
                 **options: Any):
        super().__init__()
        self._options: Dict[str, Any] = dict(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                                             comm=comm, **options)
        self.guard: Optional[StepGuard] = None
        self._model_id: Optional[tuple] = None

    # -- keras hooks

    def on_train_begin(self, logs=None):
        model = self.model
        spe = getattr(model, "_steps_per_execution", None)  # Keras 2: a variable; Keras 3: an int attribute
        spe = int(spe.numpy()) if hasattr(spe, "numpy") else int(getattr(model, "steps_per_execution", 1) or 1)
        if spe != 1:
            raise ConfigError(f"KerasGuard needs steps_per_execution=1 (compile() got {spe}): the guard must see "
                              "every batch to keep the ranks in step")
        if model.distribute_strategy.num_replicas_in_sync > 1:
            raise ConfigError("KerasGuard does not run under a tf.distribute strategy with several replicas; use "
                              "Horovod or mpirun with one replica per process")
        if self.guard is None or self._model_id != (id(model), id(model.optimizer)):
            self._build(model)  # again after a re-compile: the apply step must use the current optimizer
        model.train_function = self._train_function

    def on_train_end(self, logs=None):
        self.model.train_function = None  # fit() without the callback gets Keras's own function again

    # -- the guarded train function

    def _build(self, model: Any) -> None:
        opt = model.optimizer
        if opt is None:
            raise ConfigError("KerasGuard: compile() the model before fit()")
        if getattr(opt, "_agg_helper", None) is not None:
            raise ConfigError("KerasGuard accumulates micro-batches itself: build the Horovod DistributedOptimizer "
                              "with backward_passes_per_step=1")
        variables = model.trainable_variables
        compile_fn = (lambda f: f) if model.run_eagerly else (
            lambda f: tf.function(f, reduce_retracing=True, jit_compile=bool(getattr(model, "jit_compile", False))))

        def micro(data):
            x, y, sw = tf.keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x, y, y_pred, sw)
            grads = tape.gradient(loss, variables)
            model.compute_metrics(x, y, y_pred, sw)
            return grads, loss

        options = dict(self._options)
        if _is_horovod_optimizer(opt):
            def apply(grads):
                opt.apply_gradients(zip(opt._allreduce(grads, variables), variables))
            options.setdefault("reduce_gradients", None)
        else:
            def apply(grads):
                opt.apply_gradients(zip(grads, variables))
        micro_fn = compile_fn(micro)
        apply_fn = compile_fn(apply)
        self._saved = []

        def on_oom():
            for v, val in self._saved:  # roll back what the dropped attempt added to the metrics
                v.assign(val)

        micro = self.guard.micro_batch_size if self.guard is not None else None
        self.guard = StepGuard(micro_fn, apply=lambda grads: apply_fn(list(grads)), on_oom=on_oom, **options)
        if micro is not None:
            self.guard.micro_batch_size = micro  # a fallback already agreed stays in force
        self._model_id = (id(model), id(model.optimizer))

    def _train_function(self, iterator):
        model = self.model
        self._saved = [(v, tf.identity(v)) for m in model.metrics for v in m.variables]
        self.guard.run(lambda: (next(iterator),))
        self._saved = []
        counter = getattr(model, "_train_counter", None)  # Keras 2 counts steps here; Keras 3 does not
        if counter is not None:
            counter.assign_add(1)
        if hasattr(model, "get_metrics_result"):
            return model.get_metrics_result()
        return {m.name: m.result() for m in model.metrics}
