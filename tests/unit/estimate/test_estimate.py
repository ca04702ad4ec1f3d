"""The estimator's framework-free arithmetic: liveness replay, allocator models, table totals."""
import math

import pytest

from distmem.costs import LayerCost
from distmem.errors import ConfigError
from distmem.estimate.allocators import BFCAllocator, CudaCachingAllocator, ExactAllocator
from distmem.estimate.liveness import Graph, Node, replay
from distmem.estimate.precision import dtype_bytes, resolve_precision
from distmem.estimate.table import TORCH_CACHE_HEADROOM, Estimate, LayerEstimate

MiB = 1024 ** 2


def chain_graph():
    """x -> A (keeps its output a, 10 B/sample) -> B (keeps its input a) -> loss (keeps 2 B/sample).

    A has 100 B of weights + 100 B of gradient; updates free each gradient at once."""
    g = Graph()
    x = g.add(4)
    a = g.add(10)
    b = g.add(6)
    keep = g.add(2)
    loss = g.add(0, 4)
    g.inputs = (x,)
    g.persistent = [100, 200]  # weights, optimizer state
    g.nodes = [Node(row=0, inputs=(x,), outputs=(a,), saved=(a,), grads=(100,), update_temps=(100,), trainable=True),
               Node(row=1, inputs=(a,), outputs=(b,), saved=(a,)),
               Node(row=2, inputs=(b,), outputs=(loss,), saved=(keep,), temps=(keep,))]
    return g


def test_replay_peak_by_hand():
    g = chain_graph()
    # batch 10. Forward: 300 persistent + x 40, a 100, b 60, keep 20 + loss 4 -> 524; b freed after the loss.
    # Backward: loss allocates grad(b) 60; B allocates grad(a) 100 and frees grad(b); A allocates its weight
    # gradient 100 and an update temporary 100 while a (kept) and grad(a) are alive -> the peak.
    rep = replay(g, 10, grads_held=False)
    assert rep.forward_peak == 524
    assert rep.saved == 100 + 20
    assert rep.saved_by_row == {0: 100, 2: 20}
    assert rep.peak == 300 + 40 + 100 + 100 + 100 + 100
    assert (rep.phase, rep.node) == ("backward", 0)


def test_replay_holds_gradients_for_one_update():
    g = chain_graph()
    # the weight gradient waits for the update at the end; the temporary then comes after a is freed
    held = replay(g, 10, grads_held=True)
    assert held.peak == 300 + 40 + 100 + 100 + 100
    assert held.grads_at_peak == 100


def test_replay_inference_keeps_nothing():
    g = chain_graph()
    rep = replay(g, 10, grads_held=False, train=False)
    # persistent 300 + x 40 + a 100 + b 60 (a freed after B reads it, before the loss allocates)
    assert rep.peak == 300 + 40 + 100 + 60


def test_replay_scales_with_batch():
    g = chain_graph()
    p1, p2 = replay(g, 1, grads_held=False).peak, replay(g, 2, grads_held=False).peak
    p3 = replay(g, 3, grads_held=False).peak
    assert p3 - p2 == p2 - p1 > 0


def test_alias_costs_nothing_and_extends_life():
    g = Graph()
    x = g.add(8)
    a = g.add(100)
    view = g.add(0, alias=a)
    out = g.add(1)
    g.inputs = (x,)
    g.nodes = [Node(row=0, inputs=(x,), outputs=(a,), trainable=True, grads=(0,)),
               Node(row=1, inputs=(a,), outputs=(view,)),
               Node(row=2, inputs=(view,), outputs=(out,), saved=(view,))]
    rep = replay(g, 1, grads_held=False)
    assert rep.saved == 100  # the reshape keeps its base alive, counted once


def test_exact_allocator_threshold():
    a = ExactAllocator(min_alloc=1000)
    a.alloc("small", 999)
    a.alloc("big", 1000)
    assert a.in_use == 1000 and a.peak == 1000
    a.free("big")
    a.free("small")
    assert a.in_use == 0 and a.peak == 1000


def test_bfc_rounds_to_256_and_reuses_whole_chunks():
    a = BFCAllocator()
    a.alloc(1, 1000)
    assert a.in_use == 1024  # rounded up to 256 B
    a.free(1)
    assert a.in_use == 0
    # a 2 MiB region: 1.5 MiB does not leave room to split (2 MiB < 2 x 1.5 MiB): the chunk counts whole
    b = BFCAllocator()
    b.alloc("x", 3 * MiB // 2)
    assert b.in_use == 2 * MiB


def test_bfc_splits_and_coalesces():
    a = BFCAllocator()
    a.alloc(1, 256 * 1024)
    a.alloc(2, 256 * 1024)
    assert a.in_use == 512 * 1024
    a.free(1)
    a.free(2)
    a.alloc(3, 2 * MiB)  # the two freed chunks merged back with the rest of the 2 MiB region
    assert a.in_use == 2 * MiB
    assert len(a.free_chunks) == 0


def test_cuda_allocator_rounds_to_512_and_keeps_large_blocks_whole():
    a = CudaCachingAllocator()
    a.alloc(1, 1)
    assert a.in_use == 512
    a.alloc(2, 12 * MiB)          # >= 10 MiB: its own segment, rounded to 2 MiB
    assert a.in_use == 512 + 12 * MiB
    a.free(2)
    a.alloc(3, 11 * MiB + 512)    # reuses the 12 MiB block: < 1 MiB would remain, so no split
    assert a.in_use == 512 + 12 * MiB


def test_dtype_bytes_and_precision():
    assert dtype_bytes("float16") == 2 and dtype_bytes("bfloat16") == 2 and dtype_bytes("int64") == 8
    p = resolve_precision("bf16")
    assert p.name == "mixed_bfloat16" and p.compute_bytes == 2 and p.weight_bytes == 4 and p.cast_weights
    assert resolve_precision(None).compute_bytes == 4
    assert resolve_precision(True).loss_scaling
    with pytest.raises(ConfigError, match="unknown precision 'fp8'"):
        resolve_precision("fp8")


def table():
    rows = [LayerEstimate("a", "Dense", params=10, param_bytes=40, grad_bytes=40, optimizer_bytes=80,
                          activation_bytes_per_sample=8, output_bytes_per_sample=4, workspace_bytes_per_sample=2),
            LayerEstimate("b", "Dense", params=5, param_bytes=20, grad_bytes=20, optimizer_bytes=40,
                          activation_bytes_per_sample=4, activation_fixed_bytes=10, output_bytes_per_sample=1)]
    return Estimate("keras", "m", 16, "float32", {"name": "Adam"}, rows, "analytic", input_bytes_per_sample=3,
                    _peak_fn=lambda b, train: {"peak": 1000 * b if train else 10 * b, "phase": "backward"})


def test_table_totals_and_layer_costs():
    est = table()
    assert est.state_bytes == 160 + 80
    assert est.activation_bytes() == 16 * 8 + 16 * 4 + 10
    costs = est.layer_costs(batch_size=2)
    # the layer's largest temporary, at the batch: what a pipeline stage's backward allocates besides
    assert costs[0] == LayerCost("a", 160, 16, 8, params=10, kind="Dense", backward_bytes=4)
    assert costs[1] == LayerCost("b", 80, 18, 2, params=5, kind="Dense")
    assert est.peak_bytes == 16000 and est.train_bytes(2) == 2000 and est.inference_bytes() == 160


def test_range_bytes():
    est = table()
    # layer b alone, 3 micro-batches of 16: state 80 + 3 x (64 + 10) + a's output 64 entering + no workspace
    assert est.range_bytes(1, 2, micro_batches=3) == 80 + 3 * 74 + 64
    # from the start: the model input enters, the largest workspace is a's 2 B/sample
    assert est.range_bytes(0, 2) == 240 + (128 + 74) + 48 + 32
    with pytest.raises(ConfigError, match=r"layer range 1\.\.5 is outside the model's 2 layers"):
        est.range_bytes(1, 5)


def test_footprint_adds_cache_and_context():
    est = table()
    assert est.footprint_bytes(device="cpu") == 16000
    assert est.footprint_bytes("torch", overhead_bytes=768 * MiB) == \
        int(16000 * (1 + TORCH_CACHE_HEADROOM) + 0.999999) + 768 * MiB
    assert est.footprint_bytes("tensorflow", overhead_bytes=0, headroom=0.0) == 16000
    with pytest.raises(ConfigError, match="unknown framework 'jax'"):
        est.footprint_bytes("jax")


def test_footprint_adds_the_path_margin_for_gpu_estimates():
    """A GPU footprint is priced at the high figure of the estimate's bound: the held-out worst
    under-estimate of the path that made it (modelled here); torch at least TORCH_ESTIMATE_MARGIN."""
    from distmem.estimate.table import KERAS_MARGINS, TORCH_ESTIMATE_MARGIN, TORCH_MARGINS
    est = table()
    est.device = "gpu"
    bound = est.bound()
    assert bound.source == "modelled"
    assert bound.high_bytes == math.ceil(16000 * (1 + KERAS_MARGINS["modelled"].under))
    assert bound.low_bytes == math.floor(16000 / (1 + KERAS_MARGINS["modelled"].over))
    assert est.estimate_margin == pytest.approx(bound.high_bytes / 16000 - 1)
    assert est.footprint_bytes("tensorflow", overhead_bytes=0, headroom=0.0) == bound.high_bytes
    assert est.footprint_bytes("tensorflow", overhead_bytes=0, headroom=0.0, margin=0.0) == 16000
    assert est.to_dict(per_layer=False)["bound"]["high_bytes"] == bound.high_bytes
    est.method = "measured"  # without a measurement's own bound: carried
    assert est.bound().source == "carried"
    est.framework, est.device = "torch", "cuda"
    margin = max(TORCH_ESTIMATE_MARGIN, TORCH_MARGINS["carried"].under)
    assert est.footprint_bytes("torch", overhead_bytes=5) == \
        math.ceil(16000 * (1 + margin) * (1 + TORCH_CACHE_HEADROOM)) + 5
    with pytest.raises(ConfigError, match="margin must be >= 0"):
        est.footprint_bytes("torch", margin=-0.1)


def test_a_bound_is_never_below_the_state():
    from distmem.estimate.table import Bound, PathMargin
    bd = Bound.around(100, PathMargin(0.5, 0.5, "test"), "carried", floor=90)
    assert bd.low_bytes == 90 and bd.high_bytes == 150
    est = table()
    assert est.state_floor == 60 + 120 and est.bound(1).low_bytes >= est.state_floor


def test_torch_margins_cover_the_worst_measured_under_estimates():
    """The torch margins are read off the committed benchmark results: each covers its worst case."""
    import json
    import pathlib
    from distmem.estimate.table import TORCH_ESTIMATE_MARGIN
    results = pathlib.Path(__file__).resolve().parents[3] / "bench" / "results"
    checked = 0
    for pattern in ("estimate_accuracy_torch_zoo.json", "estimate_accuracy_torch_written*_h200.json"):
        for f in sorted(results.glob(pattern)):
            for row in json.loads(f.read_text())["rows"]:
                if row.get("ours") and row.get("measured"):
                    assert row["ours"] * (1 + TORCH_ESTIMATE_MARGIN) >= row["measured"], (f.name, row["id"])
                    checked += 1
    if not checked:
        pytest.skip("no estimate_accuracy_torch_* results under bench/results")


def test_breakdown_parts_are_what_the_allocator_counts():
    """Tensors below a CPU allocator's floor are not in its statistics, so they are not in the
    breakdown's activations or gradients either (the parts never exceed the peak)."""
    from distmem.estimate.allocators import BFCAllocator
    from distmem.estimate.liveness import Graph, Node, replay
    g = Graph()
    x = g.add(100)
    small = [g.add(10) for _ in range(20)]  # 10 bytes per sample: under the floor at batch 8
    g.inputs = (x,)
    prev = x
    for k, t in enumerate(small):
        g.nodes.append(Node(row=k, inputs=(prev,), outputs=(t,), saved=(t,), grads=(4,), trainable=True))
        prev = t
    r = replay(g, 8, grads_held=True, allocator=BFCAllocator(min_alloc=1024))
    assert r.saved_at_peak == 0 and r.grads_at_peak == 0
    assert r.saved_at_peak + r.grads_at_peak <= r.peak
