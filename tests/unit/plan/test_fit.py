"""distmem fit: the layout search, its verdicts, the outside-allocator model and strategy='auto'."""
from __future__ import annotations

import json

import pytest

from distmem.costs import LayerCost
from distmem.errors import ConfigError, DoesNotFitError
from distmem.plan import make_plan
from distmem.plan.budget import resolve_budget
from distmem.plan.fit import fit, nccl_communicators_of, solve_fit
from distmem.plan.fit.costs import LayerListCosts, group_blocks
from distmem.plan.fit.evaluate import Evaluator
from distmem.plan.wrappers import SHARDINGS
from distmem.plan.fit.space import ParallelLayout, enumerate_layouts
from distmem.plan.outside import nccl_env, outside_allocator_breakdown, outside_allocator_bytes

MiB = 1024 ** 2
GiB = 1024 ** 3


def layers(n=24, state=512 * MiB, act=64 * MiB, out=16 * MiB):
    """n equal blocks, costs for ONE sample."""
    return [LayerCost(f"l{i}", state, act, out) for i in range(n)]


def costs(n=24, **kw):
    return {"float32": LayerListCosts(layers(n, **kw), 1)}


def gpus(spec):
    from distmem.discover.gpus import fleet_inventory

    return fleet_inventory(spec).gpus


def gpus_inventory(spec):
    from distmem.discover.gpus import fleet_inventory

    return fleet_inventory(spec)


def topo_of(n):
    from distmem.discover.identity import Topology

    return Topology(rank=0, size=n, local_rank=0, local_size=n, host="n")


# ------------------------------------------------------------------ layouts


def test_layout_arithmetic_and_proxy():
    lay = ParallelLayout(data_parallel=2, pipeline=4, micro_batch=3, accumulation=8, precision="float32", recompute=False,
                 ranks_per_gpu=1, schedule="1f1b")
    assert lay.ranks == 8 and lay.global_batch == 48
    assert lay.bubble == pytest.approx(3 / 11)
    # (m + p - 1) x (mb + 2) / p sample-passes per GPU
    assert lay.step_units() == pytest.approx(11 * 5 / 4)
    rc = ParallelLayout(2, 4, 3, 8, "mixed_bfloat16", True, 2, "1f1b")
    assert rc.step_units() == pytest.approx(2 * 11 * 5 / 4 * (4 / 3) / 2)


def test_enumeration_uses_every_gpu_and_splits_the_batch_exactly():
    out, _ = enumerate_layouts(24, 64, 8, 2, precisions=["float32"], schedules=["1f1b", "gpipe"], recompute=[False, True],
                        ranks_per_gpu=[1, 2], pipelines=None, micro_batches=None)
    assert out
    for lay, local in out:
        assert lay.global_batch == 64
        assert lay.ranks == local * 2  # two hosts
        assert local == 8 * lay.ranks_per_gpu
        assert lay.pipeline <= 24
        assert (lay.schedule is None) == (lay.pipeline == 1)
    seen = {(l.data_parallel, l.pipeline) for l, _ in out}
    assert {(16, 1), (8, 2), (4, 4), (2, 8), (1, 16), (32, 1), (16, 2)} <= seen


def test_batch_no_degree_divides_is_a_config_error_with_the_degrees_and_a_remedy():
    with pytest.raises(ConfigError) as exc:
        solve_fit(costs(4), global_batch_size=7, gpus=gpus("8x16GiB"))
    msg = str(exc.value)
    assert "global batch 7" in msg and "[2, 4, 8, 16]" in msg and "nearby" in msg


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_global_batch(bad):
    with pytest.raises(ConfigError, match="global_batch_size"):
        solve_fit(costs(), global_batch_size=bad, gpus=gpus("2x16GiB"))


def test_bad_precision_names_the_choices():
    with pytest.raises(ConfigError, match="float32"):
        fit(layers=layers(), layers_batch_size=1, global_batch_size=8, gpus="2x16GiB", precision="fp8")


# ------------------------------------------------------------------ verdicts


def _exhaustive(c, B, fleet, hosts=1, **kw):
    """Every layout priced, ranked the way solve_fit ranks: the reference the best-first walk must match."""
    g = gpus(fleet)
    out, _ = enumerate_layouts(len(next(iter(c.values())).block_names), B, len(g), hosts, precisions=list(c),
                        schedules=["1f1b", "gpipe"], recompute=[False, True], ranks_per_gpu=[1, 2],
                        pipelines=None, micro_batches=None, shardings=SHARDINGS)
    ev = Evaluator(c, g, budget=resolve_budget(reserve="256MiB", foreign=0, headroom=0.10), overhead=None, framework="torch",
                    nccl="auto", nccl_buffsize=None)
    return [(lay, ev.evaluate(lay, L)) for lay, L in out]


def test_best_first_walk_finds_the_same_best_fits_as_pricing_everything():
    c = costs(24)
    res = solve_fit(c, global_batch_size=64, gpus=gpus("8x16GiB"), top=5, rejected=3)
    allc = _exhaustive(c, 64, "8x16GiB")
    best = min(x.layout.step_units() for _, x in allc if x.fits)
    assert res.chosen is not None and res.chosen.layout.step_units() == pytest.approx(best)
    fitting_units = sorted(x.layout.step_units() for _, x in allc if x.fits)[:5]
    assert [round(f.layout.step_units(), 6) for f in res.fits] == [round(u, 6) for u in fitting_units]
    # fewer priced than searched: the walk stopped early
    assert res.evaluated < res.searched


def test_every_rank_of_a_fit_fits_and_every_rejected_has_a_rank_over():
    res = solve_fit(costs(24), global_batch_size=64, gpus=gpus("8x16GiB"), top=10, rejected=5)
    assert res.fits and res.rejected
    for f in res.fits:
        assert all(s.planned_bytes <= s.share_bytes for s in f.stages)
        assert len(f.stages) == f.layout.pipeline
    for r in res.rejected:
        b = r.binding
        assert b.planned_bytes > b.share_bytes
        assert b.margin_bytes == min(s.margin_bytes for s in r.stages)
        assert r.remedy and "short" in r.remedy[0]
    # rejected layouts ranked above the chosen one are the ones a memory-blind search would pick
    assert res.rejected[0].layout.step_units() <= res.chosen.layout.step_units()


def test_a_layout_with_one_stage_over_its_gpu_is_rejected_and_that_stage_binds():
    # the first block's activations dwarf the rest: under 1F1B stage 0 holds p micro-batches of them
    rows = [LayerCost("big", 64 * MiB, 1536 * MiB, 8 * MiB)] + [LayerCost(f"l{i}", 64 * MiB, 8 * MiB, 8 * MiB)
                                                                  for i in range(7)]
    c = {"float32": LayerListCosts(rows, 1)}
    ev = Evaluator(c, gpus("4x16GiB"), budget=resolve_budget(reserve="256MiB", foreign=0, headroom=0.1), overhead=None,
                    framework="torch", nccl="auto", nccl_buffsize=None)
    cand = ev.evaluate(ParallelLayout(1, 4, 4, 4, "float32", False, 1, "1f1b"), 4)
    assert not cand.stages[0].fits and all(s.fits for s in cand.stages[1:])
    assert not cand.fits and cand.binding.stage == 0
    res = solve_fit(c, global_batch_size=16, gpus=gpus("4x16GiB"), top=50, rejected=50)
    for f in res.fits:
        assert all(s.fits for s in f.stages), f.layout.describe()
    assert any(r.layout.pipeline > 1 and r.binding.stage == 0 for r in res.rejected)


def test_binding_breakdown_adds_up_to_limit_plus_outside():
    res = solve_fit(costs(24), global_batch_size=64, gpus=gpus("8x16GiB"), top=3, rejected=3)
    for cand in res.fits + res.rejected:
        for s in cand.stages:
            bd = dict(s.breakdown)
            outside = bd.pop("outside allocator")
            assert outside == cand.outside["total_bytes"]
            assert sum(bd.values()) == s.planned_bytes


def test_gpipe_first_stage_holds_all_micro_batches_and_1f1b_fewer():
    c = costs(8)
    ev = Evaluator(c, gpus("4x80GiB"), budget=resolve_budget(reserve=0, foreign=0, headroom=0.1), overhead=0, framework="torch",
                    nccl=False, nccl_buffsize=None)
    g = ev.evaluate(ParallelLayout(1, 4, 2, 8, "float32", False, 1, "gpipe"), 4)
    f = ev.evaluate(ParallelLayout(1, 4, 2, 8, "float32", False, 1, "1f1b"), 4)
    assert [s.in_flight for s in g.stages] == [8, 8, 8, 8]
    assert [s.in_flight for s in f.stages] == [4, 3, 2, 1]
    assert g.heaviest.planned_bytes > f.heaviest.planned_bytes


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_pipeline_stage_is_priced_as_strategy_pipeline_plans_it(framework):
    """One job, one answer: fit's pipeline stage from a layer list holds what init(strategy="pipeline")
    demands for the same cut, the backward's gradients in flight and the accumulation included."""
    varied = [LayerCost(f"l{i}", (i % 5 + 1) * 64 * MiB, (i % 3 + 1) * 16 * MiB, (i % 4 + 1) * 4 * MiB,
                        backward_bytes=(i % 2) * 8 * MiB) for i in range(12)]
    c = {"float32": LayerListCosts(varied, 1)}
    ev = Evaluator(c, gpus("4x80GiB"), budget=resolve_budget(reserve=0, foreign=0, headroom=0.1), overhead=0,
                   framework=framework, nccl=False, nccl_buffsize=None)
    got = ev.evaluate(ParallelLayout(1, 4, 2, 6, "float32", False, 1, "gpipe"), 4)
    plan = make_plan("pipeline", topo_of(4), gpus_inventory("4x80GiB"), framework=framework,
                     layers=c["float32"].block_costs(2), num_micro_batches=6, schedule="gpipe", headroom="10%")
    # the Adam split fit assumes for a layer list (gradients a quarter of the state) is the plan's too
    assert [s.allocator_bytes for s in got.stages] == [a.demand_bytes for a in plan.allocations]
    assert all(a.breakdown["transient_bytes"] > 0 for a in plan.allocations)


def test_accumulation_keeps_gradients_alive_in_a_whole_model_step():
    torch = pytest.importorskip("torch")
    from distmem.estimate import estimate_torch
    from distmem.plan.fit.costs import EstimateCosts

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    est = estimate_torch(model, input_shape=(64,), batch_size=4, optimizer="adam", device="cuda")
    c = EstimateCosts(est)
    one, _ = c.whole_peak(4, False)
    acc, parts = c.whole_peak(4, True)
    assert sum(parts.values()) == acc >= one
    assert 0 <= parts["accumulated gradients"] <= est.grad_bytes
    assert c.block_names == ["0", "1", "2"]
    phase = est.peak_detail(4)["phase"]
    bwd = est.phase_breakdown(4)["backward"]
    # a later micro-step's backward: its own peak, every gradient it has not made yet, and the largest
    # layer's new gradient beside its accumulated one
    later = sum(bwd.values()) + est.grad_bytes - bwd["gradients"] + c.largest_gradient
    if phase == "update":
        # the update's peak already holds every gradient: they are not counted twice
        assert acc == max(one, later)
    else:
        assert acc == one + parts["accumulated gradients"] + parts["accumulation transient"]


def test_accumulation_prices_zero2_later_micro_steps_by_the_backward_peak():
    """ZeRO-2 with accumulation at a micro-batch whose single step peaks in the update: the rank's
    peak is a later micro-step's backward (its shard of the accumulated gradients alive), not the
    update's. Bug guarded: the backward moment was priced with no gradient alive (measured 10-14%
    under on the H200, bench/results/fit_sharded_h200.json before this rule)."""
    torch = pytest.importorskip("torch")
    from distmem.estimate import estimate_torch
    from distmem.plan.fit.costs import EstimateCosts
    from distmem.plan.wrappers import sharding_wrapper

    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    est = estimate_torch(model, input_shape=(512,), batch_size=2, optimizer="adam", device="cuda")
    c = EstimateCosts(est)
    assert est.peak_detail(1)["phase"] == "update"
    single, _ = c.rank_peak(1, False, sharding_wrapper("zero2", 8))
    later, parts = c.rank_peak(1, True, sharding_wrapper("zero2", 8))
    assert parts["gradients"] > 0  # the accumulated gradients this rank owns
    assert later >= single + parts["gradients"] - c.largest_gradient


def test_group_blocks_by_top_level_module():
    names = ["(model) (own ops)", "stem.0", "stem.1", "layer1.0.conv1", "layer1.0.bn1", "layer1.1.conv1",
             "fc", "(unused parameters)"]
    assert group_blocks(names) == [("stem", 0, 3), ("layer1", 3, 6), ("fc", 6, 8)]
    assert [g[0] for g in group_blocks(["a.x", "b", "a.y"])] == ["a", "b", "a#2"]


def test_mixed_fleet_holds_each_stage_against_its_own_gpu():
    c = costs(16, state=256 * MiB, act=32 * MiB)
    ev = Evaluator(c, gpus("2x40GiB,2x16GiB"), budget=resolve_budget(reserve="256MiB", foreign=0, headroom=0.1), overhead=None,
                    framework="torch", nccl="auto", nccl_buffsize=None)
    p4 = ev.evaluate(ParallelLayout(1, 4, 2, 8, "float32", False, 1, "1f1b"), 4)
    assert [s.gpu_total_bytes // GiB for s in p4.stages] == [40, 40, 16, 16]
    assert p4.stages[2].share_bytes < p4.stages[0].share_bytes
    # with two stages, each stage has one rank on a 40 GiB GPU and one on a 16 GiB GPU: the small one binds
    p2 = ev.evaluate(ParallelLayout(2, 2, 2, 8, "float32", False, 1, "1f1b"), 4)
    assert [s.gpu_total_bytes // GiB for s in p2.stages] == [16, 16]
    dp = ev.evaluate(ParallelLayout(4, 1, 2, 4, "float32", False, 1), 4)
    assert dp.stages[0].gpu_total_bytes == 16 * GiB


def test_fits_nowhere_names_the_smallest_fleet_that_would_and_it_is_minimal():
    c = costs(24)
    res = solve_fit(c, global_batch_size=64, gpus=gpus("2x8GiB"), top=3, rejected=2)
    assert not res.fits and res.suggestion
    assert "smallest fleet that fits is 3 such GPUs" in res.suggestion
    ev = Evaluator(c, gpus("2x8GiB"), budget=resolve_budget(reserve="256MiB", foreign=0, headroom=0.10), overhead=None,
                    framework="torch", nccl="auto", nccl_buffsize=None)
    assert not ev.evaluate(ParallelLayout(1, 2, 1, 64, "float32", True, 1, "1f1b"), 2).fits
    assert ev.evaluate(ParallelLayout(1, 3, 1, 64, "float32", True, 1, "1f1b"), 3).fits


def test_a_block_larger_than_any_gpu_says_so_with_its_size():
    c = {"float32": LayerListCosts([LayerCost("emb", 30 * GiB, MiB, MiB), LayerCost("x", MiB, MiB, MiB)], 1)}
    res = solve_fit(c, global_batch_size=4, gpus=gpus("2x16GiB"), top=1, rejected=1)
    assert not res.fits
    assert "block 'emb' alone holds 30.0 GiB" in res.suggestion


def test_table_and_json_show_fits_rejections_and_the_proxy():
    res = fit(layers=layers(), layers_batch_size=1, global_batch_size=64, gpus="8x16GiB", top=3, rejected=2)
    text = res.table()
    assert "fits (best first)" in text and "best rejected" in text and "would fit with" in text
    assert "ranks/GPU x (m + p - 1)" in text
    d = json.loads(json.dumps(res.to_dict()))
    lay = d["chosen"]["layout"]
    assert lay["data_parallel"] * lay["accumulation"] * lay["micro_batch"] == 64
    assert d["chosen"]["stages"][0]["planned_bytes"] <= d["chosen"]["stages"][0]["share_bytes"]
    assert d["rejected"][0]["fits"] is False


# ------------------------------------------------------------------ outside the allocator


def test_outside_model_parts_and_nccl_warning():
    bare = outside_allocator_breakdown("torch")
    assert set(bare["parts"]) == {"cuda_context", "cublas", "cudnn"} and not bare["warnings"]
    one = outside_allocator_breakdown("torch", nccl_communicators=1)
    three = outside_allocator_breakdown("torch", nccl_communicators=3)
    assert one["total_bytes"] > bare["total_bytes"]
    assert three["parts"]["nccl_communicators"] > one["parts"]["nccl_communicators"]
    assert any("two GPUs" in w for w in one["warnings"])
    peers = outside_allocator_breakdown("torch", nccl_communicators=1, nccl_peers=2, nccl_buffsize="2MiB")
    peers4 = outside_allocator_breakdown("torch", nccl_communicators=1, nccl_peers=2)
    assert "nccl_peer_buffers" in peers["assumed"]
    assert peers4["parts"]["nccl_peer_buffers"] > peers["parts"]["nccl_peer_buffers"]
    assert outside_allocator_bytes("torch") == bare["total_bytes"]
    assert bare["total_bytes"] % (2 * MiB) == 0
    assert outside_allocator_bytes("torch", cuda=False) == 0


def test_outside_model_bad_input():
    with pytest.raises(ConfigError, match="framework"):
        outside_allocator_breakdown("mxnet")
    with pytest.raises(ConfigError, match="nccl_communicators"):
        outside_allocator_breakdown("torch", nccl_communicators=-1)
    with pytest.raises(ConfigError, match="NCCL_BUFFSIZE"):
        nccl_env({"NCCL_BUFFSIZE": "lots"})
    assert nccl_env({"NCCL_BUFFSIZE": "2097152"})["buffsize"] == 2097152


def test_communicators_per_layout():
    assert nccl_communicators_of(ParallelLayout(1, 1, 8, 1, "float32", False, 1)) == 0
    assert nccl_communicators_of(ParallelLayout(8, 1, 8, 1, "float32", False, 1)) == 1
    assert nccl_communicators_of(ParallelLayout(1, 4, 8, 1, "float32", False, 1, "1f1b")) == 2
    assert nccl_communicators_of(ParallelLayout(2, 4, 8, 1, "float32", False, 1, "1f1b")) == 3


# ------------------------------------------------------------------ strategy="auto"


def _topo(rank, size, local):
    from distmem.discover.identity import Topology

    return Topology(rank=rank, size=size, local_rank=rank % local, local_size=local, host=f"n{rank // local}")


def test_plan_auto_hands_the_loop_its_layout_and_is_identical_on_every_rank():
    from distmem.discover.gpus import fleet_inventory

    inv = fleet_inventory("8x16GiB")
    plans = [make_plan("auto", _topo(r, 8, 8), inv, layers=layers(), layers_batch_size=1, global_batch_size=64)
             for r in (0, 5)]
    p0, p5 = plans
    assert p0.fingerprint() == p5.fingerprint()
    f = p0.extras["fit"]
    assert f["data_parallel"] * f["accumulation"] * f["micro_batch"] == 64
    assert f["data_parallel"] * f["pipeline"] == 8
    assert f["guard_start_batch"] == f["micro_batch"]
    assert p0.strategy == "auto" and len(p0.allocations) == 8
    # each rank's limit is its stage's planned bytes from the fit
    by_stage = {s["stage"]: s["planned_bytes"] for s in f["stages"]}
    for a in p0.allocations:
        stage = a.stage if a.stage is not None else 0
        assert a.limit_bytes == by_stage[stage]
    assert sum(s["stop_block"] - s["first_block"] for s in f["stages"]) == 24


def test_plan_auto_that_fits_nowhere_raises_with_the_remedy():
    from distmem.discover.gpus import fleet_inventory

    with pytest.raises(DoesNotFitError) as exc:
        make_plan("auto", _topo(0, 2, 2), fleet_inventory("2x8GiB"), layers=layers(), layers_batch_size=1,
                  global_batch_size=64)
    assert "smallest fleet" in str(exc.value) and "needs" in str(exc.value)


def test_plan_auto_uses_the_launched_rank_count():
    from distmem.discover.gpus import fleet_inventory

    plan = make_plan("auto", _topo(0, 16, 16), fleet_inventory("8x40GiB"), layers=layers(), layers_batch_size=1,
                     global_batch_size=64)
    f = plan.extras["fit"]
    assert f["ranks_per_gpu"] == 2 and f["data_parallel"] * f["pipeline"] == 16


# ------------------------------------------------------------------ CLI


def test_cli_table_json_and_exit_codes(tmp_path, capsys):
    from distmem.cli.fit import main

    path = tmp_path / "layers.json"
    path.write_text(json.dumps([l.to_dict() for l in layers()]))
    assert main(["--layers", str(path), "--global-batch-size", "64", "--gpus", "8x16GiB", "--top", "2"]) == 0
    assert "fits (best first)" in capsys.readouterr().out
    assert main(["--layers", str(path), "--global-batch-size", "64", "--gpus", "8x16GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["chosen"] and d["fits"]
    assert main(["--layers", str(path), "--global-batch-size", "64", "--gpus", "2x8GiB"]) == 3
    assert "smallest fleet" in capsys.readouterr().out
    assert main(["--layers", str(path), "--global-batch-size", "7", "--gpus", "8x16GiB", "--pipelines", "1,2"]) == 1
    assert "global batch 7" in capsys.readouterr().err


def test_plan_auto_from_a_torch_module():
    torch = pytest.importorskip("torch")
    from distmem.discover.gpus import fleet_inventory

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)], torch.nn.Linear(256, 10))
    plan = make_plan("auto", _topo(0, 4, 4), fleet_inventory("4x2GiB"), model=model, input_shape=(256,),
                     global_batch_size=64, precision="float32")
    f = plan.extras["fit"]
    assert f["precision"] == "float32"
    assert f["data_parallel"] * f["accumulation"] * f["micro_batch"] == 64
    assert [s["blocks"] for s in f["stages"]][0][0] == "0"


def _outside_bound():
    """Four blocks, one with 400 MiB of activations per sample: one rank holds it on a 2 GiB GPU,
    four ranks cannot (each also holds NCCL's communicator and buffers outside the allocator)."""
    return {"float32": LayerListCosts([LayerCost("stem", 16 * MiB, 8 * MiB, 8 * MiB),
                                       LayerCost("big", 32 * MiB, 400 * MiB, 8 * MiB),
                                       LayerCost("neck", 16 * MiB, 8 * MiB, 8 * MiB),
                                       LayerCost("head", 16 * MiB, 8 * MiB, 8 * MiB)], 1)}


def test_what_fits_the_fleet_given_is_the_answer_with_the_gpus_it_leaves_idle():
    """Issue 35: ``distmem fit --model torchvision:resnet50 --global-batch-size 256 --gpus 4x2GiB``
    said nothing fits 4 GPUs and that "the smallest fleet that fits is 1 such GPU". A layout of fewer
    ranks than GPUs fits the fleet given: it is listed as a fit, with the GPUs it leaves idle and why."""
    res = solve_fit(_outside_bound(), global_batch_size=4, gpus=gpus("4x2GiB"), top=3, rejected=2)
    assert res.fits and all(f.layout.ranks == 1 for f in res.fits)
    assert res.idle_gpus == 3 and res.to_dict()["idle_gpus"] == 3
    assert res.rejected and all(r.layout.ranks == 4 for r in res.rejected)  # every GPU busy: why not
    assert "smallest fleet" not in (res.suggestion or "")
    assert "leaves 3 GPUs idle" in res.suggestion and "outside the allocator" in res.suggestion
    text = res.table()
    assert "the best leaves 3 GPUs idle" in text and "(1 rank; 3 GPUs idle)" in text
    # a launched job cannot idle its ranks: strategy='auto' keeps every rank (no idle answer)
    launched = solve_fit(_outside_bound(), global_batch_size=4, gpus=gpus("4x2GiB"), top=3, rejected=2,
                         fixed_local_size=4)
    assert not launched.fits and launched.idle_gpus == 0


def test_a_smaller_fleet_is_never_named_for_one_that_holds_it():
    """Where the search's own limits (here: pipelines of 4 stages only) leave nothing, the remedy says
    what fits these GPUs outside those limits, not that a fleet the user already has would."""
    res = solve_fit(_outside_bound(), global_batch_size=4, gpus=gpus("4x2GiB"), top=3, rejected=2, pipelines=[4])
    assert not res.fits
    assert "smallest fleet" not in res.suggestion
    assert "nothing the search was allowed to try fits" in res.suggestion and "--pipelines" in res.suggestion
    far = solve_fit(costs(24), global_batch_size=64, gpus=gpus("2x8GiB"), top=3, rejected=2)
    assert "smallest fleet that fits is 3 such GPUs (2 hosts of 2 GPUs)" in far.suggestion
