"""FSDP2 units as users wrap them: the door finds the model's repeated block (or takes ``units=``),
and its rank-0 peak under FSDP2 (float32 and a bf16 MixedPrecisionPolicy) and ZeRO is what rank 0
of N really allocates, measured here on the CPU through torch's fake process group (every
allocation real, collectives instant) with the profiler's memory events."""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from distmem.discover.gpus import fleet_inventory  # noqa: E402
from distmem.discover.identity import Topology  # noqa: E402
from distmem.errors import ConfigError  # noqa: E402
from distmem.estimate.table import path_margin  # noqa: E402
from distmem.estimate.torch.units import fsdp_units  # noqa: E402
from distmem.plan import make_plan  # noqa: E402
from distmem.plan.fit import costs_from_model  # noqa: E402
from distmem.plan.wrappers import mixed_precision, sharding_wrapper  # noqa: E402

VOCAB, D, SEQ, BATCH = 3000, 64, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(D)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.norm(x)


class LM(nn.Module):
    """A decoder as Hugging Face nests one: the blocks two levels down, the head at the top."""

    def __init__(self, layers=4):
        super().__init__()
        self.model = Decoder(layers)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))

    def example_input(self, batch):
        return torch.zeros((batch, SEQ), dtype=torch.long)


class Tower(nn.Module):
    """Layers whose backward makes more gradient bytes than it frees activation bytes (the weights
    of a Linear 512 x 512, the activation it keeps for a batch of 256 half that), as ResNet's last
    stages do: one replica's backward peaks at its end, a rank keeping an eighth of each gradient
    (ZeRO-2 over 8) at its start."""

    def __init__(self, width=512, depth=8):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.layers(x))

    def example_input(self, batch):
        return torch.zeros((batch, 512))


TOWER_BATCH = 256
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def test_the_repeated_block_is_the_unit_and_the_plan_says_so():
    u = fsdp_units(LM())
    assert u.paths == tuple(f"model.layers.{i}" for i in range(4))
    assert u.describe() == "4 x Block; root: embed, norm, lm_head"
    with torch.device("meta"):
        model = LM()
    topo = Topology(rank=0, size=8, local_rank=0, local_size=8, host="n")
    plan = make_plan("sharded", topo, fleet_inventory("8x80GiB"), model=model, batch_size=BATCH)
    assert plan.extras["sharded"]["units"] == "4 x Block; root: embed, norm, lm_head"
    assert "FSDP2 units: 4 x Block; root: embed, norm, lm_head" in plan.allocations[0].notes[0]


def test_units_as_users_say_them():
    model = LM()
    assert fsdp_units(model, "Block").paths == fsdp_units(model).paths
    assert fsdp_units(model, ["model.layers.0", "model.layers.2"]).paths == ("model.layers.0", "model.layers.2")
    assert fsdp_units(model, lambda m: isinstance(m, nn.Linear)).kinds.count("Linear") == 9
    assert fsdp_units(model, lambda name, m: name.endswith(".up")).paths[0] == "model.layers.0.up"
    assert fsdp_units(model, "root").paths == ()
    with pytest.raises(ConfigError, match="neither a module path nor a class .* Block"):
        fsdp_units(model, "DecoderLayer")


def _measured(kind, world, mp=False, units=None, root_only=False, build=LM, batch=BATCH, optimizer="adamw"):
    """Rank 0 of ``world``'s peak over three steps, exact (the CPU profiler's memory events).
    ``zero2``: ZeRO-1 with the gradients of the parameters other ranks own freed once accumulated
    (DeepSpeed stage 2 keeps its partition's only)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from distmem.estimate.measure.torch_steps import _cpu_peak

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        torch.manual_seed(0)
        model = build()
        if kind == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy()
            for block in ([] if root_only else (units or model.model.layers)):
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            opt = torch.optim.AdamW(model.parameters())
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=OPTIMIZERS[optimizer], lr=1e-3)
            if kind == "zero2":
                owned = {id(p) for g in opt.optim.param_groups for p in g["params"]}
                for p in model.parameters():
                    if id(p) not in owned:
                        p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        if hasattr(model, "lm_head"):  # a language model: token ids of its example input's shape
            ids = torch.randint(0, model.lm_head.out_features, tuple(model.example_input(batch).shape))
        else:
            ids = torch.randn(batch, 512)

        def steps():
            for _ in range(3):
                out = model(ids)
                out = out.reshape(-1, out.shape[-1])
                loss = torch.nn.functional.cross_entropy(out.float(), torch.zeros(out.shape[0], dtype=torch.long))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del out, loss
        held = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                   for p in model.parameters()) + ids.numel() * ids.element_size()
        return held + _cpu_peak(steps)
    finally:
        dist.destroy_process_group()


def _planned(kind, world, mp=False, units=None, build=LM, batch=BATCH, optimizer="adamw"):
    with torch.device("meta"):
        model = build()
    c = costs_from_model(model, ["float32"], optimizer=optimizer, batch_size=batch, device="cpu", method="model",
                         param_dtype="bfloat16" if mp else None, units=units)["float32"]
    w = sharding_wrapper(kind, world, **(mixed_precision("bfloat16") if mp else {}))
    peak, parts = c.rank_peak(batch, False, w)
    # the plan prices the estimate's high figure: the modelled path's margin of what this rank
    # holds, booked as its own part; the figure beneath it is what rank 0 allocates
    uncertain = sum(v for k, v in parts.items() if k.startswith("estimate uncertainty"))
    under = path_margin("torch", "modelled").under
    assert abs(uncertain - under * (peak - uncertain)) <= 2, (parts, under)
    return peak - uncertain


@pytest.mark.parametrize("kind,world,mp", [("fsdp2", 2, False), ("fsdp2", 8, False), ("fsdp2", 8, True),
                                           ("fsdp2", 64, True), ("zero1", 8, False), ("zero2", 8, False)])
def test_rank_zero_of_n_as_measured(kind, world, mp):
    # the top-level children as units (the old door: the whole decoder one unit) over-plans by
    # the decoder's gathered parameters; without the MixedPrecisionPolicy the bf16 step is 2x
    got, want = _planned(kind, world, mp), _measured("fsdp2" if kind == "fsdp2" else kind, world, mp)
    assert abs(got / want - 1) < 0.005, (kind, world, mp, got, want)


class NarrowLM(nn.Module):
    """Eight blocks over a small vocabulary and short sequences: at batch 1 its activations (0.53 MB)
    are less than its gradients (1.19 MB) and far more than an eighth of them, as a 1B GPT's are at
    sequence 1024."""

    seq = 24

    def __init__(self):
        super().__init__()
        self.model = Decoder(8)
        self.model.embed = nn.Embedding(256, D)
        self.lm_head = nn.Linear(D, 256, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))

    def example_input(self, batch):
        return torch.zeros((batch, self.seq), dtype=torch.long)


def test_a_small_batch_peaks_where_the_backward_starts():
    # at batch 1 this model's activations are less than its gradients, so the whole model's backward
    # peaks at its end (every gradient made, the activations freed); sharded, the gradients are an
    # eighth and the rank's peak is the backward's start, every activation kept. The door priced the
    # end alone: a hand-written GPT 1B under FSDP2 over 8 at micro-batch 1 was planned 38% under what
    # rank 0 allocated on the H200 (bench/results/fit_h200_pairs.jsonl); here 36% under before, +0.25% now
    got, want = _planned("fsdp2", 8, batch=1, build=NarrowLM), _measured("fsdp2", 8, batch=1, build=NarrowLM)
    assert abs(got / want - 1) < 0.05, (got, want)


def test_zero2_peaks_where_fewer_gradients_are_made_zero1_where_one_replica_does():
    # ZeRO-1 keeps every gradient: it peaks where one replica does (the backward's end, the
    # update). ZeRO-2 keeps its eighth: where the backward frees less than it makes it peaks
    # before it, with fewer gradients made - priced at the backward's peak it was planned under
    got = {k: _planned(k, 8, build=Tower, batch=TOWER_BATCH, optimizer="sgd") for k in ("zero1", "zero2")}
    want = {k: _measured(k, 8, build=Tower, batch=TOWER_BATCH, optimizer="sgd") for k in ("zero1", "zero2")}
    for k in got:
        assert abs(got[k] / want[k] - 1) < 0.005, (k, got, want)
    assert got["zero1"] - got["zero2"] < want["zero1"] - want["zero2"] + 0.005 * want["zero2"], (got, want)
    # the LM's peak (its logits and their gradients) holds no weight gradient: ZeRO-1 and ZeRO-2 alike
    assert _measured("zero1", 8) == _measured("zero2", 8)
    assert _planned("zero1", 8) == _planned("zero2", 8)


def test_the_root_alone_reduces_at_the_backwards_end():
    # fully_shard(model) and nothing else: the gradients stay unsharded to the backward's end
    got, want = _planned("fsdp2", 8, units="root"), _measured("fsdp2", 8, root_only=True)
    assert abs(got / want - 1) < 0.005, (got, want)


def test_param_dtype_is_fsdp2s_alone():
    topo = Topology(rank=0, size=2, local_rank=0, local_size=2, host="n")
    with torch.device("meta"):
        model = LM()
    with pytest.raises(ConfigError, match="param_dtype/reduce_dtype are FSDP2's"):
        make_plan("sharded", topo, fleet_inventory("2x80GiB"), model=model, batch_size=2, sharding="zero1",
                  param_dtype="bfloat16")


def test_the_layers_win_over_the_identical_projections_inside_one():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.norm = Attention(), nn.LayerNorm(D)

    class Two(nn.Module):  # two layers: a run of 2 layers against runs of 4 projections
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))
    assert fsdp_units(Two()).describe() == "2 x Layer; root: nothing of its own"


def _measured_accumulated(micro):
    """One replica's peak over three optimizer steps of ``micro`` micro-steps each (CPU profiler)."""
    from distmem.estimate.measure.torch_steps import _cpu_peak

    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))

    def steps():
        for _ in range(3):
            for _ in range(micro):
                out = model(ids)
                loss = torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB).float(),
                                                         torch.zeros(BATCH * SEQ, dtype=torch.long))
                loss.backward()
                del out, loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + ids.numel() * ids.element_size()
    return held + _cpu_peak(steps)


def test_a_later_micro_step_holds_the_gradient_being_made_not_the_largest_twice():
    # the LM's peak is at its logits, before any weight gradient is made: a later micro-step holds
    # every accumulated gradient beside it, and no gradient is being added in there (the largest,
    # the head's, is made after)
    with torch.device("meta"):
        model = LM()
    c = costs_from_model(model, ["float32"], optimizer="adamw", batch_size=BATCH, device="cpu",
                         method="model")["float32"]
    peak, parts = c.whole_peak(BATCH, True)
    got = peak - sum(v for k, v in parts.items() if k.startswith("estimate uncertainty"))
    want = _measured_accumulated(2)
    assert abs(got / want - 1) < 0.005, (got, want, parts)
    assert parts["accumulated gradients"] == c.est.grad_bytes
