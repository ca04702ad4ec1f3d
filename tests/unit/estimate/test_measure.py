"""The measured path (``estimate(..., method=...)``): real steps at small batches carried to the
batch by the model; what it runs on, what it falls back to, and that the same call plans the same
bytes. Keras runs on TensorFlow's CPU allocator here; torch has no GPU here, so its measured path
falls back (its GPU figures are in bench/results/estimate_heldout_torch.json)."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from distmem.errors import ConfigError
from distmem.estimate.measure.extrapolate import extrapolate, measure_batches, residual_terms


def test_rules_carry_the_residual_as_they_say():
    pts = [(4, 140, 100), (8, 220, 160)]  # residuals 40 and 60
    assert extrapolate(residual_terms(pts, "offset"), 300, 16) == 350
    assert extrapolate(residual_terms(pts, "linear"), 300, 16) == 300 + 20 + 5 * 16
    assert extrapolate(residual_terms(pts, "ratio"), 300, 16) == round(300 * (1.4 + 1.375) / 2)
    assert extrapolate(residual_terms(pts, "measured"), 300, 16) == 220 + 20 * 8
    assert extrapolate(residual_terms(pts, "scale"), 300, 16) == round(300 * 220 / 160)
    assert extrapolate(residual_terms(pts, "blend"), 300, 16) == 300 + (50 + 20 + 5 * 16) // 2
    assert extrapolate(residual_terms(pts, "model"), 300, 16) == 300
    with pytest.raises(ValueError):
        residual_terms(pts, "guess")


def test_small_batches_are_a_quarter_and_a_half():
    assert measure_batches(32) == (8, 16)
    assert measure_batches(8) == (2, 4)
    assert measure_batches(1) == (1, 2)
    assert measure_batches(1024) == (32, 64)


@pytest.fixture
def keras():
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    tf = pytest.importorskip("tensorflow")
    return tf.keras


def _written(K):
    """What --calibrate crashed on: a Lambda, a segmentation map and a second, regression output."""
    L = K.layers
    inp = K.Input((32, 32, 3))
    h = L.Conv2D(8, 3, padding="same", activation="relu")(inp)
    h = L.Lambda(lambda t: t * 2.0)(h)
    seg = L.Conv2D(4, 1, activation="softmax", name="seg")(h)
    reg = L.Dense(1, name="reg")(L.GlobalAveragePooling2D()(h))
    model = K.Model(inp, [seg, reg])
    model.compile(optimizer="adam", loss={"seg": "sparse_categorical_crossentropy", "reg": "mse"})
    return model


def test_keras_measured_path_runs_the_model_itself_and_plans_the_same_bytes_twice(keras, monkeypatch, tmp_path):
    from distmem.estimate import estimate
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", str(tmp_path))
    model = _written(keras)
    before = [w.copy() for w in model.get_weights()]
    est = estimate(model, 8, "adam", method="measure", device="cpu")
    assert est.method == "measured"
    m = est.measurement
    # the target batch itself (it fits the host), with a quarter and a half of it
    assert [b for b, _ in m["points"]] == [2, 4, 8] and all(y > 0 for _, y in m["points"])
    assert m["at_target"] and est.bound().source == "measured" and est.peak_bytes == dict(m["points"])[8]
    assert len(m["steps"]["8"]) >= 3  # the worst of several steps at the target
    assert m["seconds"] > 0 and m["loss"] == "compiled" and not m["reused"]
    assert sum(est.breakdown().values()) == est.peak_bytes
    assert est.peak_detail()["modelled_peak"] == estimate(model, 8, "adam", method="model", device="cpu").peak_bytes
    for a, b in zip(before, model.get_weights()):  # the user's weights are back
        assert (a == b).all()
    again = estimate(model, 8, "adam", method="auto", device="cpu")
    assert again.measurement["reused"] and again.peak_bytes == est.peak_bytes
    handed = estimate(model, 8, "adam", method="measure", device="cpu", measurement=est.measurement)
    assert handed.peak_bytes == est.peak_bytes and handed.train_bytes(16) == est.train_bytes(16)
    with pytest.raises(ConfigError, match="another model, batch"):
        estimate(model, 16, "adam", method="measure", device="cpu", measurement=est.measurement)


def test_a_keras_spec_is_measured_in_a_child_that_rebuilds_it(keras, monkeypatch, tmp_path):
    from distmem.estimate import estimate
    (tmp_path / "tiny_factory.py").write_text(textwrap.dedent("""
        def build():
            import tensorflow as tf
            K = tf.keras
            inp = K.Input((16,))
            return K.Model(inp, K.layers.Dense(4)(K.layers.Dense(64, activation="relu")(inp)))
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
    # the working folder is never searched (docs/security.md): the user puts the module's folder on
    # PYTHONPATH, which the measuring child searches first
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.syspath_prepend(str(tmp_path))
    est = estimate("tiny_factory:build", 16, "sgd", method="measure", device="cpu")
    assert est.method == "measured" and "child process rebuilt" in est.measurement["how"]
    assert est.measurement["loss"].startswith("generic")


def test_method_is_checked(keras):
    from distmem.estimate import estimate
    with pytest.raises(ConfigError, match="method='fast'"):
        estimate(_written(keras), 8, method="fast")


def test_torch_without_a_gpu_falls_back_and_says_so(monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: this is the no-GPU case")
    from distmem.estimate import estimate
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with pytest.warns(UserWarning, match="not measured"):
        est = estimate(net, 8, "adam", input_shape=(16,))
    assert est.method == "simulated" and "no CUDA device" in est.measurement["fallback"]
    with pytest.raises(ConfigError, match="no CUDA device"):
        estimate(net, 8, "adam", input_shape=(16,), method="measure")


def _checkpointed(torch, mode):
    import functools
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self, d=64):
            super().__init__()
            self.a, self.b = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):
            return x + self.drop(self.b(torch.nn.functional.gelu(self.a(x))))

    def policy(ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(64, 64)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
            self.head = torch.nn.Linear(64, 8)

        def forward(self, x):
            x = self.inp(x)
            for blk in self.blocks:
                if mode is None:
                    x = blk(x)
                elif mode == "selective":
                    from torch.utils.checkpoint import create_selective_checkpoint_contexts
                    x = checkpoint(blk, x, use_reentrant=False,
                                   context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
                else:
                    x = checkpoint(blk, x, use_reentrant=mode == "reentrant")
            return self.head(x)
    return Net()


@pytest.mark.parametrize("precision", [None, "mixed_bfloat16"])
def test_checkpointed_blocks_are_estimated_and_keep_less(precision):
    """Each checkpointed block runs its forward again in the backward pass; that recomputation
    used to meet the module's own (CPU) weights and no autocast/dropout stand-ins ("Tensor on
    device cpu is not on the expected device meta!", "Recomputed values ... different metadata")."""
    torch = pytest.importorskip("torch")
    from distmem.estimate import estimate_torch
    kept = {}
    for mode in (None, "reentrant", "nonreentrant", "selective"):
        est = estimate_torch(_checkpointed(torch, mode), input_shape=(32, 64), batch_size=8, precision=precision)
        kept[mode] = est.activation_bytes()
        assert est.peak_bytes > 0
    assert kept["reentrant"] < kept[None] and kept["nonreentrant"] < kept[None]
    assert kept["nonreentrant"] < kept["selective"] < kept[None]  # a selective policy keeps its matmuls


def test_torch_compile_is_detected_and_said():
    torch = pytest.importorskip("torch")
    from distmem.estimate import estimate_torch
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    plain = estimate_torch(net, input_shape=(16,), batch_size=8)
    compiled = estimate_torch(torch.compile(net), input_shape=(16,), batch_size=8)
    assert compiled.peak_bytes == plain.peak_bytes
    assert any("torch.compile" in w for w in compiled.warnings) and not any("torch.compile" in w for w in plain.warnings)


def test_cudnn_split_k_partials_are_bounded_by_the_reduction():
    """bench/results/estimate_cudnn_probe_h200.json: one partial per image on large maps, few on
    7x7 ones (ResNet-50's last stage: 4 partials for 32 images in float32)."""
    torch = pytest.importorskip("torch")
    from distmem.estimate.torch.kernels import split_k_partials
    assert split_k_partials(torch.empty(32, 512, 56, 56, device="meta")) == 32
    assert split_k_partials(torch.empty(32, 512, 7, 7, device="meta")) == 8
    assert split_k_partials(torch.empty(1, 8, 2, 2, device="meta")) == 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
