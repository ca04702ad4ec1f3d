"""The plan request: one measurement per job (rank 0 measures, every rank plans from it), the estimate
method, and the request's defaults read once."""
import itertools

import pytest

from distmem.costs import LayerCost
from distmem.discover.gpus import fleet_inventory
from distmem.discover.identity import Topology
from distmem.discover.layout import assumed
from distmem.errors import ConfigError
from distmem.plan import PlanRequest
from distmem.plan import layers as layers_mod


def _noisy_estimates(monkeypatch):
    """A stand-in estimator whose measurement differs on every call (as two real runs do), and
    whose layers follow the measurement it was given - or its own, when it measures."""
    calls = {"measured": 0}
    counter = itertools.count(1)

    def estimate_layers(model, *, method="auto", measurement=None, **options):
        if measurement is None and method != "model":
            calls["measured"] += 1
            measurement = {"key": "k", "points": [[4, 1000 * next(counter)]]}
        scale = measurement["points"][0][1] if measurement else 1
        rows = [LayerCost(f"l{i}", state_bytes=2**20 * (i + 1), activation_bytes=scale * 2**10) for i in range(6)]
        return rows, measurement

    monkeypatch.setattr(layers_mod, "estimate_layers", estimate_layers)
    return calls


def _rank_plan(rank, agree):
    topo = Topology(rank=rank, size=2, local_rank=rank, local_size=2, host="h", source="test")
    inv = fleet_inventory("2x80GiB")
    req = PlanRequest(strategy="pipeline", options={"model": "anything", "num_stages": 2}, framework="none",
                      topology=topo, inventory=inv, layout=assumed(topo, inv), env={})
    ctx, strategy, opts = req.context()
    ctx.declared, ctx.agree = False, agree  # a launched job of two ranks with a transport
    return strategy.plan(ctx, opts)


def test_every_rank_plans_from_rank_0s_one_measurement(monkeypatch):
    calls = _noisy_estimates(monkeypatch)
    sent = {}

    def rank0(compute):
        sent["value"] = compute()
        return sent["value"]

    def rank1(compute):  # receives what rank 0 computed, never computes
        return sent["value"]

    p0, p1 = _rank_plan(0, rank0), _rank_plan(1, rank1)
    assert calls["measured"] == 1, calls  # measured once for the job
    assert [a.limit_bytes for a in p0.allocations] == [a.limit_bytes for a in p1.allocations]
    # without the agreement each rank measures its own (noisy) figures and plans differently
    alone = [_rank_plan(r, None) for r in (0, 1)]
    assert calls["measured"] == 3
    assert [a.limit_bytes for a in alone[0].allocations] != [a.limit_bytes for a in alone[1].allocations]


def test_rank_0s_error_reaches_every_rank(monkeypatch):
    def failing(model, **options):
        raise ConfigError("model 'x' does not train: shape mismatch")

    monkeypatch.setattr(layers_mod, "estimate_layers", failing)

    def agree(compute):
        try:
            return compute()
        except ConfigError as exc:  # as api._job_agreement does: rank 0's error is every rank's
            raise exc

    with pytest.raises(ConfigError, match="does not train"):
        _rank_plan(1, agree)


def test_a_job_without_a_transport_plans_from_the_model_and_says_so(monkeypatch):
    calls = _noisy_estimates(monkeypatch)
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "DISTMEM_FLEET": "2x80GiB"}
    one = PlanRequest(strategy="pipeline", options={"model": "anything", "num_stages": 1}, framework="none",
                      env=env).plan()
    assert calls["measured"] == 1 and not any("estimated from the model alone" in w for w in one.warnings)
    env = dict(env, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="1", OMPI_COMM_WORLD_RANK="1",
               HOROVOD_HOSTNAME="other")
    two = PlanRequest(strategy="pipeline", options={"model": "anything", "num_stages": 2}, framework="none",
                      env=env).plan()
    assert calls["measured"] == 1, "a rank that cannot agree with the others must not measure alone"
    assert any("estimated from the model alone" in w and "transport" in w for w in two.warnings), two.warnings


def test_the_estimate_method_is_checked():
    with pytest.raises(ConfigError, match="estimate='guess'"):
        PlanRequest(strategy="data", estimate="guess", fleet="1x16GiB", env={}).plan()
