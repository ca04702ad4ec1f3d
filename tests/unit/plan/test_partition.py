"""The exact partitioner: in-flight counts, optimality against brute force, the schedule-aware cut."""
import itertools
import random

import pytest

from distmem.costs import LayerCost
from distmem.errors import ConfigError
from distmem.plan.partition import (accumulation_transient, backward_transient, bounds_from_cuts, in_flight, layers_from_dicts, lower_bound, partition_model,
    partition_pipeline, partition_plain, solve, stage_demands)


@pytest.mark.parametrize("p,m,expected", [
    (4, 8, [4, 3, 2, 1]),       # 1F1B: p - s when m >= p
    (4, 2, [2, 2, 2, 1]),       # capped by m
    (1, 5, [1]),
    (8, 1, [1] * 8),
])
def test_1f1b_in_flight(p, m, expected):
    assert [in_flight("1f1b", s, p, m) for s in range(p)] == expected


def test_gpipe_keeps_every_micro_batch():
    assert [in_flight("gpipe", s, 4, 6) for s in range(4)] == [6, 6, 6, 6]


@pytest.mark.parametrize("args,needle", [
    (("pipedream", 0, 4, 4), "schedule='pipedream'"),
    (("1f1b", 4, 4, 4), "stage 4 is outside"),
    (("1f1b", 0, 4, 0), "at least one micro-batch"),
])
def test_in_flight_rejects_bad_input(args, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        in_flight(*args)


def _brute(layers, p, **setting):
    """(largest part, cut bytes) of the best partition, by enumerating every cut."""
    n, best = len(layers), None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = bounds_from_cuts(list(cuts), n)
        parts = stage_demands(layers, bounds, **setting)
        key = (max(s.held_bytes for s in parts), sum(layers[i - 1].output_bytes for i, _ in bounds[1:]))
        best = key if best is None or key < best else best
    return best


def _random_layers(rng, n):
    return [LayerCost(f"l{k}", rng.choice([0, rng.randint(0, 100)]), rng.randint(0, 60), rng.randint(0, 80))
            for k in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_pipeline_partition_is_optimal_by_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(40):
        n = rng.randint(1, 9)
        p = rng.randint(1, min(n, 5))
        layers = _random_layers(rng, n)
        schedule, m, rec, inp = rng.choice(["1f1b", "gpipe"]), rng.randint(1, 6), rng.random() < 0.5, rng.randint(0, 50)
        part = partition_pipeline(layers, p, num_micro_batches=m, schedule=schedule, recompute=rec, input_bytes=inp)
        want = _brute(layers, p, kind="pipeline", schedule=schedule, num_micro_batches=m, recompute=rec,
                      input_bytes=inp)
        held = max(s.held_bytes for s in part.stages)  # what the cut minimises; the transient is added after
        assert (held, part.cut_bytes) == want, (layers, p, schedule, m, rec, inp, part.bounds)
        assert all(s.num_layers >= 1 for s in part.stages)
        assert part.bounds[0][0] == 0 and part.bounds[-1][1] == n


@pytest.mark.parametrize("seed", range(4))
def test_model_partition_is_optimal_and_breaks_ties_toward_fewer_cut_bytes(seed):
    rng = random.Random(100 + seed)
    for _ in range(40):
        n = rng.randint(1, 9)
        p = rng.randint(1, min(n, 4))
        layers = _random_layers(rng, n)
        inp = rng.randint(0, 40)
        part = partition_model(layers, p, input_bytes=inp)
        held = max(s.held_bytes for s in part.stages)  # what the cut minimises; the transient is added after
        assert (held, part.cut_bytes) == _brute(layers, p, kind="model", input_bytes=inp)


def test_tie_break_picks_the_cheap_cut():
    # Device 0 must hold "a" (300 B), so every cut gives the same largest group (300 B); the bytes
    # crossing the cut differ (7, 9 or 2) and the solver must take the 2-byte cut after "c".
    layers = [LayerCost("a", 300, 0, 7), LayerCost("b", 0, 0, 9), LayerCost("c", 0, 0, 2), LayerCost("d", 100, 0, 0)]
    part = partition_model(layers, 2)
    assert max(s.held_bytes for s in part.stages) == 300
    assert part.bounds == [(0, 3), (3, 4)] and part.cut_bytes == 2


def test_schedule_aware_cut_beats_plain_sums_under_1f1b():
    # Activation-heavy early layers, state-heavy late layers: balancing state + activation sums puts
    # too many activations on stage 0, which holds p micro-batches under 1F1B.
    layers = [LayerCost(f"a{k}", 0, 100) for k in range(6)] + [LayerCost(f"w{k}", 300, 0) for k in range(6)]
    p, m = 4, 8
    aware = partition_pipeline(layers, p, num_micro_batches=m, schedule="1f1b")
    plain = partition_plain(layers, p)
    plain_true = stage_demands(layers, plain.bounds, kind="pipeline", schedule="1f1b", num_micro_batches=m)
    assert aware.max_bytes < max(s.total_bytes for s in plain_true)
    assert aware.max_bytes == _brute(layers, p, kind="pipeline", schedule="1f1b", num_micro_batches=m)[0]


def test_demand_formulas():
    layers = [LayerCost("x", 10, 7, 3), LayerCost("y", 20, 5, 2)]
    plain = stage_demands(layers, [(0, 1), (1, 2)], kind="pipeline", schedule="1f1b", num_micro_batches=8,
                          input_bytes=4)
    # stage 0 holds 2 micro-batches (p=2): 10 + 2 * (7 + 4); stage 1 holds 1: 20 + 1 * (5 + 3)
    assert [s.in_flight for s in plain] == [2, 1]
    assert [s.held_bytes for s in plain] == [10 + 2 * 11, 20 + 8]
    # the backward's gradients in flight: stage 0 holds the gradient of its output (3) and at x its
    # output's gradient (3), none for the data; stage 1 (last) at y its output's (2) and its input's (3)
    assert [s.transient_bytes for s in plain] == [3 + 3, 2 + 3]
    assert [s.total_bytes for s in plain] == [10 + 2 * 11 + 6, 20 + 8 + 5]
    rec = stage_demands(layers, [(0, 1), (1, 2)], kind="pipeline", schedule="gpipe", num_micro_batches=3,
                        recompute=True, input_bytes=4)
    # recompute: 3 stage inputs + one micro-batch's activations
    assert [s.total_bytes for s in rec] == [10 + 3 * 4 + 7 + 6, 20 + 3 * 3 + 5 + 5]
    model = stage_demands(layers, [(0, 2)], kind="model", input_bytes=4)
    # a model-parallel group runs the same backward: at y its output's gradient (2) and its input's (3)
    assert model[0].held_bytes == 30 + 12 + 4 and model[0].transient_bytes == 2 + 3
    assert model[0].total_bytes == 30 + 12 + 4 + 5


def test_backward_transient_holds_the_received_gradient_and_the_busiest_layers_pair():
    layers = [LayerCost("a", 0, 0, 4), LayerCost("b", 0, 0, 8), LayerCost("c", 0, 0, 2), LayerCost("d", 0, 0, 1)]
    # a middle stage [b, c]: it holds c's output gradient (2) throughout; at b the gradients of b's
    # output (8) and of its input, a's output (4), are alive at once: the busiest pair
    assert backward_transient(layers, 1, 3) == 2 + 8 + 4
    # the first stage never differentiates the data (a's output gradient, received and at a: 4 + 4);
    # the last receives none (d's output gradient and c's: 1 + 2)
    assert backward_transient(layers, 0, 1) == 4 + 4
    assert backward_transient(layers, 3, 4) == 1 + 2
    # a layer list without outputs has nothing to count (and no cut to price either)
    assert backward_transient([LayerCost("x", 5, 5), LayerCost("y", 5, 5)], 0, 1) == 0
    with pytest.raises(ConfigError, match=r"\[2, 2\)"):
        backward_transient(layers, 2, 2)


def test_accumulation_transient_is_the_micro_batchs_own_gradients_until_added():
    # TensorFlow's tape hands back a stage's gradients together; torch adds each into .grad as made
    assert accumulation_transient([4, 10, 2], 4, "tensorflow") == 16
    assert accumulation_transient([4, 10, 2], 4, "torch") == 10
    assert accumulation_transient([4, 10, 2], 1, "tensorflow") == 0  # one micro-batch: the state's own
    layers = [LayerCost("x", 40, 7, 3), LayerCost("y", 80, 5, 2)]
    st = stage_demands(layers, [(0, 1), (1, 2)], kind="pipeline", schedule="gpipe", num_micro_batches=2,
                       accumulate=("tensorflow", 0.25))
    assert [s.transient_bytes for s in st] == [3 + 3 + 10, 2 + 3 + 20]


def test_recompute_lowers_the_largest_stage():
    layers = [LayerCost(f"l{k}", 50, 400, 10) for k in range(12)]
    base = partition_pipeline(layers, 4, num_micro_batches=8, schedule="gpipe")
    rec = partition_pipeline(layers, 4, num_micro_batches=8, schedule="gpipe", recompute=True)
    assert rec.max_bytes < base.max_bytes


def test_solve_matches_a_direct_dp_on_larger_input():
    rng = random.Random(7)
    n, p = 60, 6
    state = [rng.randint(0, 1000) for _ in range(n)]
    act = [rng.randint(0, 1000) for _ in range(n)]
    bnd = [rng.randint(0, 300) for _ in range(n)]
    a, b = [6, 5, 4, 3, 2, 1], [6, 5, 4, 3, 2, 1]
    bounds, optimum = solve(state, act, bnd, a, b)

    def cost(s, i, j):
        return sum(state[i:j]) + a[s] * sum(act[i:j]) + b[s] * bnd[i]

    inf = float("inf")
    dp = [[inf] * (n + 1) for _ in range(p + 1)]
    dp[0][0] = 0
    for s in range(1, p + 1):
        for j in range(1, n + 1):
            dp[s][j] = min((max(dp[s - 1][i], cost(s - 1, i, j)) for i in range(j)), default=inf)
    assert optimum == dp[p][n]
    assert max(cost(s, i, j) for s, (i, j) in enumerate(bounds)) == optimum


def test_lower_bound_is_below_the_optimum():
    rng = random.Random(3)
    layers = _random_layers(rng, 30)
    part = partition_pipeline(layers, 5, num_micro_batches=10)
    assert lower_bound(layers, 5, num_micro_batches=10) <= part.max_bytes


@pytest.mark.parametrize("layers,parts,needle", [
    ([LayerCost("a", 1, 1)], 2, "1 layer"),
    ([LayerCost("a", 1, 1), LayerCost("a", 1, 1)], 2, "unique"),
    ([LayerCost("a", -1, 1)], 1, "non-negative"),
    ([LayerCost("a", 1, 1)], 0, "at least one part"),
])
def test_partition_rejects_bad_layers(layers, parts, needle):
    with pytest.raises(ConfigError, match=needle):
        partition_model(layers, parts)


def test_layers_from_dicts():
    got = layers_from_dicts([{"name": "x", "state_bytes": 1, "activation_bytes": 2, "output_bytes": 3, "extra": 9},
                             LayerCost("y", 1, 1)])
    assert got[0] == LayerCost("x", 1, 2, 3) and got[1].name == "y"
    with pytest.raises(ConfigError, match="activation_bytes"):
        layers_from_dicts([{"name": "z", "state_bytes": 1}])


def test_partition_to_dict_round_trips_names():
    layers = [LayerCost(f"l{k}", 10, 10, 1) for k in range(6)]
    part = partition_pipeline(layers, 3, num_micro_batches=3)
    d = part.to_dict()
    assert sum(len(x["layers"]) for x in d["parts"]) == 6
    assert d["max_bytes"] == part.max_bytes and d["bounds"] == [list(b) for b in part.bounds]
    assert part.part_of()["l0"] == 0 and part.part_of()["l5"] == 2
