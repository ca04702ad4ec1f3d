"""The guard with real framework objects in one process: the frameworks' own OOM exceptions (one
produced by a real allocator failure), PyTorch's params mode, TensorFlow gradients and Keras fit."""
from __future__ import annotations

import numpy as np
import pytest

import distmem.guard as guard
from distmem.comm import SingleComm

pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------------------------- torch

def test_torch_oom_classes_and_a_real_cpu_allocator_failure():
    torch = pytest.importorskip("torch")
    assert guard.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    if hasattr(torch, "OutOfMemoryError"):
        assert guard.is_oom(torch.OutOfMemoryError("x"))
    try:
        torch.empty(2 ** 42)  # 16 TiB: refused by the CPU allocator, nothing is touched
    except RuntimeError as exc:
        assert guard.is_oom(exc), str(exc)
        assert "DefaultCPUAllocator" in guard.describe(exc)
    else:
        pytest.skip("this kernel granted a 16 TiB allocation (overcommit); classifier covered by messages above")
    assert not guard.is_oom(RuntimeError("Expected all tensors to be on the same device"))


def _torch_model(seed=0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def test_torch_params_mode_matches_plain_training_through_a_fallback():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6 * 24, 8, generator=g), torch.randint(0, 3, (6 * 24,), generator=g)

    ref = _torch_model()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(6):
        opt_ref.zero_grad()
        F.cross_entropy(ref(x[i * 24:(i + 1) * 24]), y[i * 24:(i + 1) * 24]).backward()
        opt_ref.step()

    model = _torch_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {"n": 0}

    def loss_of(xb, yb):
        calls["n"] += 1
        out = model(xb)
        if calls["n"] == 4:  # step 1, first micro-batch, after the forward pass allocated activations
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return F.cross_entropy(out, yb)

    step = guard.step(loss_of, params=model.parameters(), apply=lambda _: opt.step(), micro_batch_size=12,
                      global_batch_size=24, comm=SingleComm())
    losses = [float(step(x[i * 24:(i + 1) * 24], y[i * 24:(i + 1) * 24])) for i in range(6)]
    assert step.micro_batch_size == 6 and step.accumulation_steps == 4
    assert step.fallbacks[0].errors[0].startswith("OutOfMemoryError: CUDA out of memory")
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(losses))


# ----------------------------------------------------------------------------------- tensorflow

def test_tensorflow_resource_exhausted_and_py_function_oom():
    tf = pytest.importorskip("tensorflow")
    assert guard.is_oom(tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[64]"))
    assert not guard.is_oom(tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [2] vs. [3]"))

    def boom(x):
        raise MemoryError("host allocation failed")

    @tf.function
    def f(x):
        return tf.py_function(boom, [x], tf.float32)

    with pytest.raises(tf.errors.ResourceExhaustedError) as info:  # TF's runtime maps MemoryError to its OOM
        f(tf.ones(2))
    assert guard.is_oom(info.value)


def test_tensorflow_gradients_mode_with_fallback():
    tf = pytest.importorskip("tensorflow")
    tf.keras.utils.set_random_seed(0)
    x = tf.random.normal((4 * 32, 5))
    y = tf.reduce_sum(x, axis=1, keepdims=True)

    def build():
        tf.keras.utils.set_random_seed(3)
        return tf.keras.Sequential([tf.keras.layers.Input((5,)), tf.keras.layers.Dense(4, activation="tanh"),
                                    tf.keras.layers.Dense(1)])

    def trainer(model, fault_at=None):
        opt = tf.keras.optimizers.SGD(0.05)
        calls = {"n": 0}

        @tf.function(reduce_retracing=True)
        def grads_of(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
            return tape.gradient(loss, model.trainable_variables), loss

        def fn(xb, yb):
            calls["n"] += 1
            if calls["n"] == fault_at:
                raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[32,4096]")
            return grads_of(xb, yb)

        return guard.step(fn, apply=lambda g: opt.apply_gradients(zip(g, model.trainable_variables)),
                          micro_batch_size=32, global_batch_size=32, comm=SingleComm())

    ref, hit = build(), build()
    s_ref, s_hit = trainer(ref), trainer(hit, fault_at=2)
    for i in range(4):
        s_ref(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
        s_hit(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
    assert s_hit.micro_batch_size == 16 and len(s_hit.fallbacks) == 1
    assert "ResourceExhaustedError: OOM when allocating" in s_hit.fallbacks[0].errors[0]
    for a, b in zip(hit.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_keras_fit_under_the_guard_matches_plain_fit():
    tf = pytest.importorskip("tensorflow")
    from distmem.guard.keras import KerasGuard

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * 16, 6)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    state = {"calls": 0, "fault": None}

    def maybe_fail(t):
        state["calls"] += 1
        if state["calls"] == state["fault"]:
            raise MemoryError("injected host OOM")  # becomes tf.errors.ResourceExhaustedError in TF's runtime
        return t

    class Fault(tf.keras.layers.Layer):
        def call(self, t):
            out = tf.py_function(maybe_fail, [t], t.dtype)
            out.set_shape(t.shape)
            return out

    def build():
        tf.keras.utils.set_random_seed(5)
        m = tf.keras.Sequential([tf.keras.layers.Input((6,)), tf.keras.layers.Dense(8, activation="relu"), Fault(),
                                 tf.keras.layers.Dense(2)])
        m.compile(optimizer=tf.keras.optimizers.SGD(0.1),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return m

    ref = build()
    h_ref = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                    callbacks=[KerasGuard(micro_batch_size=8, global_batch_size=16, comm=SingleComm())])
    state.update(calls=0, fault=10)  # epoch 0, batch 4, second micro-batch: the first one updated the metrics
    hit = build()
    cb = KerasGuard(micro_batch_size=8, global_batch_size=16, comm=SingleComm())
    h_hit = hit.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.guard.micro_batch_size == 4 and [f.step for f in cb.guard.fallbacks] == [4]
    assert "ResourceExhaustedError" in cb.guard.fallbacks[0].errors[0]
    for a, b in zip(hit.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # the dropped attempt's metric updates were rolled back: the epoch figures match the clean run
    np.testing.assert_allclose(h_hit.history["loss"], h_ref.history["loss"], rtol=1e-4)
    np.testing.assert_allclose(h_hit.history["accuracy"], h_ref.history["accuracy"], rtol=1e-6)
    assert hit.train_function is None  # Keras gets its own train function back after fit


def test_keras_guard_matches_keras_own_fit_without_faults():
    tf = pytest.importorskip("tensorflow")
    from distmem.guard.keras import KerasGuard

    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x @ np.ones((4, 1), "float32")

    def build():
        tf.keras.utils.set_random_seed(2)
        m = tf.keras.Sequential([tf.keras.layers.Input((4,)), tf.keras.layers.Dense(3), tf.keras.layers.Dense(1)])
        m.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
        return m

    plain, guarded = build(), build()
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    guarded.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                callbacks=[KerasGuard(micro_batch_size=4, global_batch_size=16, comm=SingleComm())])
    for a, b in zip(guarded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_keras_guard_refuses_steps_per_execution_above_one():
    tf = pytest.importorskip("tensorflow")
    from distmem.errors import ConfigError
    from distmem.guard.keras import KerasGuard

    m = tf.keras.Sequential([tf.keras.layers.Input((2,)), tf.keras.layers.Dense(1)])
    m.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    with pytest.raises(ConfigError, match="steps_per_execution=1 .*got 2"):
        m.fit(np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32"), batch_size=4, verbose=0,
              callbacks=[KerasGuard(micro_batch_size=2, comm=SingleComm())])
