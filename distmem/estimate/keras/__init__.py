"""Keras (tf.keras 2.x and Keras 3) estimates, by role: ``access`` reads a model's graph the same way
on both Keras versions, ``rules`` says what each layer type keeps for its backward pass,
``kernels`` what TensorFlow's kernels allocate beyond that, ``graph`` turns the model into the
replay's graph, ``estimate`` replays it into the per-layer table, ``calibrate`` measures a step."""
from __future__ import annotations

from .estimate import estimate_keras
from .kernels import (TF_CPU_CONV_GRAD_WORKING_SET, TF_CPU_UNCOUNTED_BELOW, XLA_CPU_DEPTHWISE_FILTER_COPIES,
                      XLA_CPU_GROUPED_CONV_INPUT_TEMPS, XLA_GROUPED_CONV_INPUT_COPIES, onednn_has_16bit,
                      tf_cpu_uncounted_below)
from .rules import (BOOL_MASK_BYTES, KERAS_UPDATE_OVERLAP, LOSS_KEPT_FACTOR, TF_RNN_PARTIAL_WEIGHT_GRADS,
                    TF_RNN_PARTIALS_BY_CELL, TF_WHILE_PARALLEL_ITERATIONS)

__all__ = ["estimate_keras", "LOSS_KEPT_FACTOR", "KERAS_UPDATE_OVERLAP", "TF_WHILE_PARALLEL_ITERATIONS",
           "BOOL_MASK_BYTES", "TF_RNN_PARTIAL_WEIGHT_GRADS", "TF_RNN_PARTIALS_BY_CELL", "TF_CPU_UNCOUNTED_BELOW",
           "XLA_CPU_DEPTHWISE_FILTER_COPIES", "XLA_CPU_GROUPED_CONV_INPUT_TEMPS", "XLA_GROUPED_CONV_INPUT_COPIES",
           "TF_CPU_CONV_GRAD_WORKING_SET", "onednn_has_16bit", "tf_cpu_uncounted_below"]
