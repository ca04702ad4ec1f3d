"""The stage that ends a model computes the loss: it is priced with what the loss holds.

The fit at scale found a hand-written GPT's last pipeline stage (a 32k-vocabulary head) out of
memory on the H200 under its limit: cross-entropy saves float32 log-probabilities and its backward
makes the logits' gradients in float32, and a stage was priced from its layers alone
(bench/results/last_stage_peak_h200.json: true peak 1.06x and 1.18x the bounded figure). A stage
that holds the whole model is the whole model: it may not be priced under the model's simulated step.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from distmem.estimate import estimate  # noqa: E402
from distmem.plan.fit.costs import EstimateCosts  # noqa: E402
from distmem.plan.partition import stage_demands  # noqa: E402

VOCAB, SEQ, D = 8192, 128, 64


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.out = torch.nn.LayerNorm(D), torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def small_lm():
    """A language model as users write one for a pipeline: embedding, blocks, a large-vocabulary head."""
    blocks = [torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.Linear(D, 4 * D), torch.nn.GELU(),
                                  torch.nn.Linear(4 * D, D)) for _ in range(2)]
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Embedding(VOCAB, D), *blocks, Head())


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_a_stage_holding_the_whole_model_is_priced_no_lower_than_its_step(precision):
    b = 4
    est = estimate(small_lm(), batch_size=b, input_shape=(SEQ,), input_dtype=torch.long, precision=precision,
                   method="model")
    whole = est.train_bytes(b) - est.extra_persistent_bytes  # the stage prices the workspaces apart, as fit does
    # the partitioner's rule (init(strategy="pipeline"), the plan door): one stage over every layer
    layers = est.layer_costs(b)
    (stage,) = stage_demands(layers, [(0, len(layers))], kind="pipeline", schedule="1f1b", num_micro_batches=1)
    state_and_kept = est.state_bytes + est.activation_bytes(b)
    assert state_and_kept + stage.transient_bytes >= 0.97 * whole, (state_and_kept, stage.transient_bytes, whole)
    logits = b * SEQ * VOCAB * 4  # float32 log-probabilities (cross-entropy's own, whatever the precision)
    assert est.loss_bytes(b) >= logits, (est.loss_bytes(b), logits)

    assert stage.transient_bytes >= est.loss_bytes(b)

    # fit's rule: the last stage's transient holds the loss's bytes
    costs = EstimateCosts(est)
    n = len(costs.block_names)
    assert costs.transient_bytes(b, n - 1, n) >= est.loss_bytes(b)
    assert costs.transient_bytes(b, 0, n - 1) < est.loss_bytes(b), "a stage before the last computes no loss"
