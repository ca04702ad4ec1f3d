"""What the parallel wrappers add per rank (distmem.plan.wrappers), and every plan counting it."""
import pytest

from distmem.costs import LayerCost
from distmem.discover.gpus import Inventory, fleet_inventory
from distmem.discover.identity import Topology
from distmem.errors import ConfigError
from distmem.plan import PlanRequest, make_plan
from distmem.plan.wrappers import (HOROVOD_FUSION_DEFAULT, ModelState, Wrapper, added_bytes, horovod_from_env,
                                   rank_peak, wrapper_demand, zero_partition)
from distmem.plan.budget import ceil_mib
from distmem.units import MiB

CPU = Inventory([], "none")


def topo(size, local_size, rank=0):
    return Topology(rank=rank, size=size, local_rank=rank % local_size, local_size=local_size, host="n")


STATE = ModelState(param_bytes=1000 * MiB, grad_bytes=1000 * MiB, optimizer_bytes=2000 * MiB,
                   tensor_bytes=(400 * MiB, 300 * MiB, 200 * MiB, 100 * MiB),
                   unit_bytes=(300 * MiB, 200 * MiB, 100 * MiB), root_bytes=400 * MiB)
PEAK = {"weights": 1000 * MiB, "gradients": 600 * MiB, "optimizer state": 2000 * MiB, "activations": 900 * MiB,
        "temporaries": 100 * MiB, "workspaces": 8 * MiB}


def test_zero_partition_gives_whole_tensors_largest_first():
    # 400 -> r0, 300 -> r1, 200 -> r1 (300 < 400), 100 -> r0 (400 < 500)
    assert zero_partition([100, 300, 200, 400], 2, 0) == 500
    assert zero_partition([100, 300, 200, 400], 2, 1) == 500
    # rank 0 holds the largest tensor whatever the degree: never below it
    assert zero_partition([400, 300, 200, 100], 64, 0) == 400


def test_zero1_shards_the_optimizer_state_of_the_owned_tensors_only():
    d = wrapper_demand(Wrapper("zero1", 4), STATE)
    assert (d.params, d.grads) == (STATE.param_bytes, STATE.grad_bytes)
    assert d.optimizer == 2000 * MiB * 400 // 1000  # rank 0 owns the 400 MiB tensor: 40%, not 25%
    d2 = wrapper_demand(Wrapper("zero2", 4), STATE)
    assert d2.grads == 1000 * MiB * 400 // 1000 and d2.optimizer == d.optimizer


def test_fsdp2_shards_everything_and_holds_root_units_and_reduce_scatter():
    d = wrapper_demand(Wrapper("fsdp2", 4), STATE)
    assert d.params == 250 * MiB and d.grads == 250 * MiB and d.optimizer == 500 * MiB
    # root 400 unsharded + (1 + prefetch) x largest unit 300, + unit's grads and the reduce-scatter input 2 x 300
    assert d.backward_buffers == (400 + 2 * 300 + 2 * 300) * MiB
    keep = wrapper_demand(Wrapper("fsdp2", 4, reshard_after_forward=False), STATE)
    assert keep.backward_buffers == (400 + 600 + 2 * 300) * MiB
    assert wrapper_demand(Wrapper("fsdp2", 4, prefetch=0), STATE).backward_buffers == (400 + 300 + 600) * MiB


def test_fsdp2_pads_dim0_to_the_degree():
    s = ModelState(10 * 4, 10 * 4, 0, tensor_bytes=(10 * 4,), tensor_rows=(10,))
    assert wrapper_demand(Wrapper("fsdp2", 4), s).params == 3 * 4  # ceil(10 / 4) rows of 4 bytes


def test_ddp_buckets_copy_every_gradient_and_are_rebuilt_once_beside_the_old_ones():
    d = wrapper_demand(Wrapper("ddp", 8, bucket_cap_mb=4), STATE)
    # the bucket size cuts the copy, it does not shrink it; the rebuild allocates a second set once
    assert d.persistent_buffers == STATE.grad_bytes and d.backward_buffers == 2 * STATE.grad_bytes
    peak, parts, _ = rank_peak(PEAK, "backward", STATE, Wrapper("ddp", 8, gradient_as_bucket_view=True))
    # the views: every gradient byte allocated (600 MiB of them already in the peak) and the rebuilt set
    assert parts["wrapper buffers"] == 1400 * MiB and peak == sum(PEAK.values()) + 1400 * MiB
    assert added_bytes(Wrapper("ddp", 2), 123) == 246 and added_bytes(Wrapper("ddp", 2, static_graph=True), 123) == 246
    assert added_bytes(Wrapper("ddp", 2, gradient_as_bucket_view=True), 123) == 123


def test_ddp_update_holds_one_bucket_set_and_a_bucket_view_none_beyond_the_gradients():
    """The rebuilt buckets' second set is gone by the update (measured on the H200 with
    examples/ddp_train.py: an update-phase peak held one set, bench/results/ddp_example_h200.json);
    the backward through a later micro-step is priced beside it."""
    upd = dict(PEAK, gradients=1000 * MiB)
    peak, parts, d = rank_peak(upd, "update", STATE, Wrapper("ddp", 2))
    assert parts["wrapper buffers"] == STATE.grad_bytes
    peak, parts, d = rank_peak(upd, "update", STATE, Wrapper("ddp", 2, gradient_as_bucket_view=True))
    assert parts["wrapper buffers"] == 0  # the gradients are the buckets
    # a backward peak beside it, with both sets alive, is the larger moment when it is close enough
    backward = dict(PEAK, gradients=200 * MiB)
    both, parts, d = rank_peak(upd, "update", STATE, Wrapper("ddp", 2), backward=backward)
    assert both == max(sum(upd.values()) + STATE.grad_bytes, sum(backward.values()) + 2 * STATE.grad_bytes)


def test_ddp_bucket_view_is_a_wrapper_name_the_strategies_take():
    from distmem.plan.wrappers import plan_wrapper

    w = plan_wrapper("ddp_bucket_view", world_size=4, on_gpu=True)
    assert w.kind == "ddp" and w.gradient_as_bucket_view and w.world_size == 4
    with pytest.raises(ConfigError, match="ddp_bucket_view"):
        plan_wrapper("ddp_view", world_size=4, on_gpu=True)


def test_fsdp2_at_the_loss_holds_the_root_alone():
    """A peak before any unit's backward has made a gradient (a language model's logits and their
    gradients at the loss): the root's parameters are gathered, no unit is, none is reducing. Bug
    guarded: the units' buffers were added there too (FSDP2 GPT configs 8-17% over on the H200)."""
    at_loss = dict(PEAK, gradients=0)
    peak, parts, d = rank_peak(at_loss, "backward", STATE, Wrapper("fsdp2", 4))
    assert parts["wrapper buffers"] == d.outside_buffers == STATE.root
    keep = wrapper_demand(Wrapper("fsdp2", 4, reshard_after_forward=False), STATE)
    assert keep.outside_buffers == STATE.root + sum(STATE.unit_bytes)
    assert peak == (250 + 0 + 500 + 1008 + 400) * MiB
    # with the kept activations known, the backward through the units is priced beside it, the larger taken
    for kept in (0, 2000 * MiB):
        both, parts, d = rank_peak(at_loss, "backward", STATE, Wrapper("fsdp2", 4), activation_bytes=kept)
        within = (250 + 500 + 8) * MiB + kept + d.backward_buffers
        assert both == max(peak, within)
        assert parts["wrapper buffers"] == (d.backward_buffers if within > peak else d.outside_buffers)
    # once a unit's gradients exist the unit buffers are there
    mid, parts, d = rank_peak(PEAK, "backward", STATE, Wrapper("fsdp2", 4))
    assert parts["wrapper buffers"] == d.backward_buffers


def test_accumulated_gradients_stay_alive_in_the_backward_moment():
    """Gradient accumulation: an update-phase peak priced again at a later micro-step's backward,
    with the rank's share of every accumulated gradient alive (ZeRO-2: its owned share)."""
    split = {"weights": 1000 * MiB, "gradients": 0, "accumulated gradients": 1000 * MiB,
             "optimizer state": 2000 * MiB, "temporaries": 1000 * MiB, "workspaces": 8 * MiB}
    backward = {"weights": 1000 * MiB, "gradients": 0, "optimizer state": 2000 * MiB,
                "activations": 900 * MiB, "temporaries": 300 * MiB, "workspaces": 8 * MiB}
    peak, parts, d = rank_peak(split, "update", STATE, Wrapper("zero2", 4), backward=backward)
    assert parts["gradients"] == d.grads == 400 * MiB
    assert parts["activations, temporaries, inputs"] == 1208 * MiB  # the backward's, not the update's


def test_rank_peak_replaces_state_by_the_shard_and_adds_the_buffers():
    peak, parts, d = rank_peak(PEAK, "backward", STATE, Wrapper("fsdp2", 4))
    assert parts["weights"] == 250 * MiB and parts["gradients"] == 150 * MiB and parts["optimizer state"] == 500 * MiB
    assert parts["activations, temporaries, inputs"] == 1008 * MiB
    assert peak == (250 + 150 + 500 + 1008) * MiB + d.backward_buffers
    plain, _, _ = rank_peak(PEAK, "backward", STATE, None)
    assert plain == sum(PEAK.values())


def test_an_update_peak_moves_to_the_backward_once_sharded():
    peak, parts, d = rank_peak(PEAK, "update", STATE, Wrapper("fsdp2", 64), activation_bytes=900 * MiB)
    # the update's temporaries shrink 64x; the backward (kept activations + gathered units) is larger
    assert parts["activations, temporaries, inputs"] == 900 * MiB + 8 * MiB
    assert parts["wrapper buffers"] == d.backward_buffers


def test_horovod_fusion_buffer_from_the_environment():
    assert horovod_from_env({}) is None
    w = horovod_from_env({"HOROVOD_RANK": "0"}, world_size=4)
    assert w.fusion_threshold == HOROVOD_FUSION_DEFAULT == 128 * MiB
    assert horovod_from_env({"HOROVOD_FUSION_THRESHOLD": "0"}, world_size=4).fusion_threshold == 0
    w = horovod_from_env({"HOROVOD_FUSION_THRESHOLD": str(64 * MiB), "HOROVOD_CYCLE_TIME": "50",
                          "HOROVOD_NUM_NCCL_STREAMS": "2"}, world_size=4, on_gpu=True)
    assert added_bytes(w, 0) == 2 * 64 * MiB  # one buffer per NCCL stream; the cycle time sizes nothing
    assert added_bytes(horovod_from_env({"HOROVOD_RANK": "0"}, world_size=1), 0) == 0  # one rank fuses nothing
    with pytest.raises(ConfigError, match="HOROVOD_FUSION_THRESHOLD"):
        horovod_from_env({"HOROVOD_FUSION_THRESHOLD": "lots"})


def test_tf_distribute_packs_the_gradients():
    assert added_bytes(Wrapper("tf_distribute", 2), 100) == 200
    assert added_bytes(Wrapper("tf_distribute", 1), 100) == 0


def test_bad_wrappers_name_the_value():
    with pytest.raises(ConfigError, match="'fsdp3'"):
        wrapper_demand(Wrapper("fsdp3", 2), STATE)
    with pytest.raises(ConfigError, match="strategy='sharded'"):
        added_bytes(Wrapper("zero1", 2), 1)


def layers(n=6):
    return [LayerCost(f"l{k}", 40 * MiB, 30 * MiB, 2 * MiB) for k in range(n)]


def _plan(strategy, env, **kw):
    req = PlanRequest(strategy=strategy, options=kw, framework="tensorflow", env=env, topology=topo(4, 4),
                      inventory=fleet_inventory("4x16GiB"))
    return req.plan()


def test_pipeline_replicas_hold_the_fusion_buffer_and_tensorflow_s_reduced_gradients():
    # 4 ranks in 2 pipelines of 2 stages: each stage all-reduces its gradients over 2 replicas
    hvd = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "4"}
    without = _plan("pipeline", {}, layers=layers(), num_stages=2)
    under = _plan("pipeline", hvd, layers=layers(), num_stages=2, wrapper="auto")
    off = _plan("pipeline", dict(hvd, HOROVOD_FUSION_THRESHOLD="0"), layers=layers(), num_stages=2, wrapper="horovod")
    # named, the wrapper plans the same bytes with or without HOROVOD_* (a dry run sees none)
    assert _plan("pipeline", {}, layers=layers(), num_stages=2, wrapper="horovod").allocations[0].demand_bytes == \
        under.allocations[0].demand_bytes
    # not named, nothing is counted, whatever the environment says (every door plans alike)
    assert _plan("pipeline", hvd, layers=layers(), num_stages=2).allocations[0].demand_bytes == \
        without.allocations[0].demand_bytes
    for a, b, c in zip(without.allocations, under.allocations, off.allocations):
        copies = b.breakdown["wrapper_bytes"] - 128 * MiB  # TensorFlow's reduced gradients: a quarter of Adam's state
        assert copies == pytest.approx(b.breakdown["state_bytes"] / 4, abs=1)
        assert b.demand_bytes == a.demand_bytes + 128 * MiB + copies
        # the fusion buffer is one allocation kept for the job: it takes no headroom
        assert b.devices[0].planned_bytes == ceil_mib((a.demand_bytes + copies) * 1.10) + 128 * MiB
        assert c.demand_bytes == a.demand_bytes + copies
    # one pipeline of 4 stages reduces nothing over replicas: no fusion, no copies
    one = _plan("pipeline", hvd, layers=layers(), num_stages=4, wrapper="horovod")
    assert [a.demand_bytes for a in one.allocations] == [a.demand_bytes for a in
                                                          _plan("pipeline", {}, layers=layers(), num_stages=4).allocations]


def test_model_parallel_rank_holds_the_fusion_buffer_on_its_first_device():
    without = make_plan("model", topo(2, 2), CPU, layers=layers(), gpus_per_rank=2, batch_size=8)
    under = make_plan("model", topo(2, 2), CPU, layers=layers(), gpus_per_rank=2, batch_size=8, wrapper="horovod")
    assert under.allocations[0].demand_bytes == without.allocations[0].demand_bytes + 128 * MiB
    assert under.extras["model"]["wrapper_bytes"] == 128 * MiB
    g0, w0 = without.extras["model"]["groups"][0], under.extras["model"]["groups"][0]
    assert w0["planned_bytes"] == g0["planned_bytes"] + 128 * MiB


def test_fsdp2_keep_holds_only_the_units_the_backward_has_not_reached():
    """reshard_after_forward=False: FSDP2 reshards each unit after its backward (before its
    reduce-scatter), so a backward peak late in the pass (most gradients made) holds the units not
    yet reached and the running unit's buffers, not every unit and the largest one's twice. Bug
    guarded: VGG-16's chosen layouts ran at 0.73 / 0.77 of their limits on the H200
    (bench/results/fit_sharded_h200.json before this rule)."""
    from distmem.plan.wrappers import keep_backward_buffers, running_unit

    keep = Wrapper("fsdp2", 4, reshard_after_forward=False)
    # units (forward order) 300, 200, 100; root 400 (its gradients taken as made first)
    assert running_unit(STATE, 0) == 2  # the backward starts at the last unit
    assert running_unit(STATE, 400 * MiB + 100 * MiB) == 1  # root and the last unit done
    assert running_unit(STATE, 400 * MiB + 350 * MiB) == 0
    # the first unit running: root + (the unit and its gradients, or its gradients and the
    # reduce-scatter input: the larger)
    assert keep_backward_buffers(STATE, 0) == (400 + 2 * 300) * MiB
    assert keep_backward_buffers(STATE, 2) == (400 + 300 + 200 + 2 * 100) * MiB
    late = dict(PEAK, gradients=400 * MiB + 350 * MiB)
    peak, parts, d = rank_peak(late, "backward", STATE, keep)
    assert parts["wrapper buffers"] == keep_backward_buffers(STATE, 0) < d.backward_buffers


def test_fsdp2_keep_prices_the_forward_end_with_every_unit_and_the_gathers_in_flight():
    """At the forward's end every unit is gathered, and the all-gather outputs of the last
    1 + prefetch units are not yet freed (measured on the H200: VGG-16's peak under
    reshard_after_forward=False is the last unit's all-gather copy-out, bench/results/
    fit_sharded_trace_h200.jsonl); with it the largest unit's backward is priced."""
    from distmem.plan.wrappers import in_flight_gathers

    keep = Wrapper("fsdp2", 4, reshard_after_forward=False)
    d = wrapper_demand(keep, STATE)
    assert in_flight_gathers(STATE, 1) == (300 + 200) * MiB and in_flight_gathers(STATE, 0) == 300 * MiB
    assert d.forward_buffers == (400 + 600 + 500) * MiB
    assert wrapper_demand(Wrapper("fsdp2", 4), STATE).forward_buffers is None  # resharding: no such moment
    forward = {"weights": 1000 * MiB, "gradients": 0, "optimizer state": 2000 * MiB, "activations": 3000 * MiB,
               "workspaces": 8 * MiB}
    late = dict(PEAK, gradients=750 * MiB)
    peak, parts, _ = rank_peak(late, "backward", STATE, keep, forward=forward)
    assert parts["wrapper buffers"] == d.forward_buffers
    assert peak == (250 + 0 + 500 + 3008) * MiB + d.forward_buffers
    # with accumulation, a later micro-step's forward holds every earlier gradient's shard
    acc = dict(late, **{"accumulated gradients": 250 * MiB})
    peak2, parts2, _ = rank_peak(acc, "backward", STATE, keep, forward=forward)
    assert parts2["gradients"] == 250 * MiB and peak2 == peak + 250 * MiB


def test_zero2_prices_the_backward_moments_with_fewer_gradients_made():
    """One replica's backward peaks at its end (every gradient made); a rank keeping a share of each
    gradient (ZeRO-2) can peak earlier, where more activations are kept; ZeRO-1 keeps them all."""
    from distmem.costs import GRADIENT_BEING_MADE
    end = {"weights": 1000 * MiB, "gradients": 1000 * MiB, "optimizer state": 2000 * MiB,
           "activations": 100 * MiB, "workspaces": 8 * MiB}
    start = {"weights": 1000 * MiB, "gradients": 0, GRADIENT_BEING_MADE: 100 * MiB, "optimizer state": 2000 * MiB,
             "activations": 900 * MiB, "workspaces": 8 * MiB}
    for kind in ("zero1", "zero2"):
        alone, _, d = rank_peak(end, "backward", STATE, Wrapper(kind, 4))
        peak, parts, _ = rank_peak(end, "backward", STATE, Wrapper(kind, 4), earlier=[start])
        if kind == "zero1":  # every gradient kept: the moments before the end are smaller
            assert peak == alone == (1000 + 1000 + 800 + 108) * MiB
        else:  # rank 0 owns 40% of the parameters; the gradient being made is whole
            assert alone == (1000 + 400 + 800 + 108) * MiB
            assert parts["gradients"] == 100 * MiB and parts["activations, temporaries, inputs"] == 908 * MiB
            assert peak == (1000 + 100 + 800 + 908) * MiB


def test_the_gradient_frontier_is_the_upper_hull_between_no_gradient_kept_and_every_one():
    from distmem.estimate.torch.trace import gradient_frontier
    # gradients made -> (bytes in use, split); the split is what a moment is priced by
    pts = {0: 100, 10: 150, 20: 155, 30: 170, 40: 180, 50: 170}
    levels = {g: (m, {"gradients": g, "rest": m - g}) for g, m in pts.items()}
    got = [s["gradients"] for s in gradient_frontier(levels)]
    # 20 lies under the hull and 30 on it, between 10 and 40 (never a rank's only peak); 50 is past
    # the largest in use (40: every gradient kept); 0 before the largest in use less gradients
    # (10: none kept)
    assert got == [10, 40]
