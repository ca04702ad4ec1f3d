"""A fit says what its estimate said: the estimator's own warnings (a value the step read that the
model guessed, a measurement that fell back to the model) are in ``FitResult.warnings`` and in the
table ``distmem fit`` prints, which silences the estimator's Python warnings."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from distmem.plan.fit import fit  # noqa: E402


class Guarded(nn.Module):
    """An MLP whose forward branches on a value, as Hugging Face's mask shortcuts do."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    def forward(self, x):
        if (x.abs().sum() > 0).item():
            x = x * 1.0
        return self.mlp(x)


def _fit(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as distmem fit runs it
        return fit(model, global_batch_size=16, gpus="1x8GiB", input_shape=(64,), estimate="model",
                   precision="float32", device="cuda")


def test_the_estimates_warnings_are_the_fits():
    res = _fit(Guarded())
    said = [w for w in res.warnings if w.startswith("estimate (float32): ")]
    assert said and any("read a tensor's value" in w and "module" in w for w in said), res.warnings
    assert "estimate (float32): " in res.table()


def test_a_model_that_reads_nothing_adds_no_estimate_warning():
    res = _fit(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    assert not [w for w in res.warnings if w.startswith("estimate (")], res.warnings
