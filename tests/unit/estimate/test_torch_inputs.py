"""What users write about their inputs and loss, and what the measured path does with it: a batch
dimension per input (or an input built per batch), the example's own batch, a loss of (output,
batch); real inputs keep their values, dtype and memory format; a live module measured in a
spawned child (here with the CPU stand-in: the profiler's memory events); cache keys that change
with the code."""
import os
import textwrap

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from distmem.errors import ConfigError  # noqa: E402
from distmem.estimate import estimate, estimate_torch  # noqa: E402
from distmem.estimate.measure.cache import code_fingerprint, model_fingerprint  # noqa: E402
from distmem.estimate.measure.torch_steps import measure_torch, torch_step_peaks  # noqa: E402
from distmem.estimate.torch.inputs import real_inputs  # noqa: E402


class Graph(nn.Module):
    """Node features (batch of nodes) and an edge list (2, E): the edges' first dimension is not the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, edges):
        h = self.lin(x)
        return h.index_add(0, edges[1], h[edges[0]])


class Masked(nn.Module):
    """Scores only the rows whose first feature is positive: its memory follows the data."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))

    def forward(self, x):
        return self.mlp(x[x[:, 0] > 0])


def square(out, batch):
    return out.pow(2).mean() + 0 * batch.sum()


def test_batch_dim_per_input_keeps_what_does_not_grow():
    x, edges = torch.zeros(10, 16), torch.zeros(2, 40, dtype=torch.long)
    est = estimate_torch(Graph(), example_input=(x, edges), batch_dim=[0, None], batch_size=64, device="cpu")
    assert est.batch_size == 64
    with pytest.raises(ConfigError, match="gives 1 dimensions for 2 inputs"):
        estimate_torch(Graph(), example_input=(x, edges), batch_dim=[0], batch_size=8, device="cpu")


def test_an_input_built_per_batch():
    bag = nn.EmbeddingBag(100, 8, mode="sum")
    calls = []

    def inputs(b):  # flat indices and offsets, as EmbeddingBag takes them
        calls.append(b)
        return torch.zeros(3 * b, dtype=torch.long), torch.arange(0, 3 * b, 3)
    est = estimate_torch(bag, example_input=inputs, batch_size=16, device="cpu", loss="sum")
    assert 16 in calls and est.peak_bytes > 0


def test_the_examples_batch_is_taken_when_no_batch_size_is_given():
    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    assert estimate_torch(mlp, example_input=torch.ones(24, 64), device="cpu").batch_size == 24
    assert estimate(mlp, example_input=torch.ones(24, 64), method="model", device="cpu").batch_size == 24
    assert estimate_torch(mlp, example_input=torch.ones(24, 64), batch_size=8, device="cpu").batch_size == 8


def test_a_loss_of_output_and_batch():
    seen = []

    def loss(out, batch):
        seen.append(tuple(batch.shape))
        return out.sum()
    estimate_torch(nn.Linear(4, 4), example_input=torch.zeros(3, 4), batch_size=5, loss=loss, device="cpu")
    assert (5, 4) in seen


def test_real_inputs_keep_values_dtype_and_memory_format():
    ids = torch.tensor([[3, 7], [5, 9]])
    args, _ = real_inputs(None, ids, None, 5, None, "cpu")
    assert args[0].dtype == torch.long and args[0][:, 0].tolist() == [3, 5, 3, 5, 3]
    img = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    args, _ = real_inputs(None, img, None, 4, None, "cpu")
    assert args[0].is_contiguous(memory_format=torch.channels_last) and torch.equal(args[0][2], img[0])
    args, kw = real_inputs(None, {"x": img, "n": torch.tensor(7)}, None, 3, None, "cpu", batch_dim={"x": 0, "n": None})
    assert kw["x"].shape[0] == 3 and kw["n"].item() == 7


def test_a_live_module_is_measured_in_a_spawned_child_on_its_own_data():
    torch.manual_seed(0)
    model = Masked()
    kept = torch.randn(16, 64).abs()           # every row selected
    dropped = -torch.randn(16, 64).abs()       # none
    run = dict(input_shape=None, input_dtype=None, optimizer=torch.optim.AdamW(model.parameters()),
               precision=None, loss=square, device="cpu")
    full = measure_torch(model, [8, 16], example_input=kept, **run)
    empty = measure_torch(model, [8, 16], example_input=dropped, **run)
    assert full["device"].startswith("CPU") and full["peaks"][16] > empty["peaks"][16]
    # the child's figure is this process's own step on the same data
    twin = Masked()
    twin.load_state_dict(model.state_dict())
    here = torch_step_peaks(twin, [8, 16], inputs=lambda b: real_inputs(twin, kept, None, b, None, "cpu"),
                            optimizer="adamw", precision=None, loss=square, device="cpu")
    assert full["peaks"] == {int(k): v for k, v in here["peaks"].items()}


def test_a_model_the_meta_device_cannot_run_says_where_it_can_be_measured():
    with pytest.raises(ConfigError, match="could not run Masked on the meta device.*GPU measures"):
        estimate(Masked(), example_input=torch.randn(8, 64), method="model", device="cpu")


def test_cache_keys_follow_the_code(tmp_path, monkeypatch):
    assert code_fingerprint(lambda out: out.sum()) != code_fingerprint(lambda out: out.mean())
    scale = 2.0
    assert code_fingerprint(lambda out: out.sum() * scale) == code_fingerprint(lambda out: out.sum() * scale)
    mod = tmp_path / "mymodels.py"
    mod.write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Linear(4, 4)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    before = model_fingerprint("mymodels:build")
    mod.write_text(mod.read_text().replace("Linear(4, 4)", "Linear(4, 8)"))
    assert model_fingerprint("mymodels:build") != before
    # a live model: the source of its classes
    assert "class " in model_fingerprint(Masked()) and os.path.basename(__file__) not in model_fingerprint(Masked())


def test_a_module_whose_class_lives_in_a_function_is_measured_here_and_says_so():
    class Local(nn.Module):  # a notebook's or a function's class: no child can import it
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)
    got = measure_torch(Local(), [2, 4], example_input=torch.ones(4, 8), input_shape=None, input_dtype=None,
                        optimizer="sgd", precision=None, loss="sum", device="cpu")
    assert "could not be handed to a child" in got["in_process"] and got["peaks"][4] > 0


def test_a_model_the_simulation_cannot_run_is_carried_by_its_measured_points():
    from distmem.estimate.measure.measured import with_measurement
    from distmem.estimate.torch.estimate import state_estimate
    prior = state_estimate(Masked(), batch_size=64, optimizer="adam", why="nonzero on the meta device")
    got = {"device": "cuda:0", "points": [[16, 10_000_000], [32, 14_000_000]]}
    est = with_measurement(prior, prior, got)
    assert est.method == "measured" and est.measurement["rule"] == "measured"
    assert est.peak_bytes == 22_000_000  # the points' own line at 64
    assert est.measurement["prior"] == "nonzero on the meta device"
    assert est.breakdown()["weights"] == prior.param_bytes


class Guarded(nn.Module):
    """An MLP whose forward branches on a value (``bool(tensor)``, as Hugging Face's mask shortcuts
    do): the simulation runs it on a guess and marks the estimate ``data_dependent``."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))

    def forward(self, x):
        if (x.abs().sum() > 0).item():
            x = x * 1.0
        return self.mlp(x)


def _guessed_prior():
    import warnings as _w
    with _w.catch_warnings():
        _w.simplefilter("ignore")
        prior = estimate_torch(Guarded(), input_shape=(64,), batch_size=64, optimizer="adam", device="cuda")
    assert prior.data_dependent  # the branch on a value was seen
    return prior


def test_a_model_that_guessed_values_carries_points_it_grows_like_and_never_below_their_line():
    """The measured path on a model that read values the simulation guessed: where the model grew
    between the measured points as they did, it carries them (a step's growth is not one line:
    GPT-2 with checkpointing's points' line was 19.9% under at batch 8 on an H200, the model's
    carry within 0.1%), and the figure is never below the points' own line."""
    from distmem.estimate.measure.extrapolate import least_squares
    from distmem.estimate.measure.measured import with_measurement
    prior = _guessed_prior()
    m16, m32, m64 = (prior.train_bytes(b) for b in (16, 32, 64))
    # the measurement agrees with the model's growth, 3 MB above it: the model's carry
    got = {"device": "cuda:0", "points": [[16, m16 + 3_000_000], [32, m32 + 3_000_000]]}
    est = with_measurement(prior, prior, got)
    assert est.measurement["rule"] == "blend" and "guessed values" in est.measurement["prior"]
    assert abs(est.peak_bytes - (m64 + 3_000_000)) <= 1024
    alpha, beta = least_squares(got["points"])
    assert est.peak_bytes >= alpha + beta * 64 - 1
    # a growth 20% steeper than the model's (inside the agreement): never below the points' line
    grow = int((m32 - m16) * 1.2)
    got = {"device": "cuda:0", "points": [[16, m16], [32, m16 + grow]]}
    est = with_measurement(prior, prior, got)
    alpha, beta = least_squares(got["points"])
    assert est.measurement["rule"] == "blend"
    assert est.peak_bytes >= int(alpha + beta * 64) - 1


def test_a_model_that_guessed_values_and_grew_otherwise_is_carried_by_the_points_line():
    from distmem.estimate.measure.measured import with_measurement
    prior = _guessed_prior()
    m16, m32 = prior.train_bytes(16), prior.train_bytes(32)
    # the measured step grew by a tenth of its bytes more than the model: the guess took another path
    grow = (m32 - m16) + m32 // 10
    got = {"device": "cuda:0", "points": [[16, m16], [32, m16 + grow]]}
    est = with_measurement(prior, prior, got)
    assert est.measurement["rule"] == "measured" and "grew otherwise" in est.measurement["prior"]
    assert est.peak_bytes == m16 + grow * 3  # the points' own line at 64


def test_points_that_barely_grew_agree_with_a_model_that_barely_grew():
    """A step whose peak at the measured batches is its update (the points barely grow): a model
    that says so agrees, and carries them to where the batch's part overtakes (the line of flat
    points cannot)."""
    from distmem.estimate.measure.carry import GUESS_FLAT
    from distmem.estimate.measure.measured import with_measurement
    prior = _guessed_prior()
    m16, m32, m64 = (prior.train_bytes(b) for b in (16, 32, 64))
    assert m32 - m16 < GUESS_FLAT * m32  # this model's growth is small beside its bytes
    got = {"device": "cuda:0", "points": [[16, m32], [32, m32]]}  # measured flat
    est = with_measurement(prior, prior, got)
    assert est.measurement["rule"] == "blend"
    assert est.peak_bytes > m32  # the model's growth carried past the flat points
