"""The next plan from the last run (distmem.plan.from_report), through the one plan request: the
observed peak + the margin per rank, what a rank needed where it ran out, a stage's largest figure,
the estimate where a rank has no figure, and the same plan at every door."""
import json

import pytest

import distmem
from distmem.errors import ConfigError
from distmem.plan import JobLayout, PlanRequest
from distmem.units import GiB, MiB


def report(tmp_path, rows, world_size=4, strategy="data"):
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"world_size": world_size, "strategy": strategy, "ranks": rows}))
    return str(path)


def plan(path=None, strategy="data", ranks=4, fleet="1x80GiB", margin=None, **options):
    return PlanRequest(strategy=strategy, options=options, framework="torch", fleet=fleet,
                       job=JobLayout.declare(ranks=ranks, fleet=fleet), from_report=path, from_margin=margin).plan()


def mib_up(n):
    return -(-int(n) // MiB) * MiB


def test_each_rank_from_its_peak_plus_the_margin(tmp_path):
    path = report(tmp_path, [{"rank": 0, "peak_bytes": 4 * GiB}, {"rank": 1, "peak_bytes": 6 * GiB},
                             {"rank": 2, "peak_bytes": 5 * GiB}])
    before, after = plan(), plan(path)
    lim = {a.rank: a.limit_bytes for a in after.allocations}
    assert lim[0] == mib_up(4 * GiB * 1.1) and lim[1] == mib_up(6 * GiB * 1.1) and lim[2] == mib_up(5 * GiB * 1.1)
    assert lim[3] == before.for_rank(3).limit_bytes  # no figure: the estimate's limit
    info = after.extras["from_report"]
    assert [c["rank"] for c in info["changed"]] == [0, 1, 2] and info["kept"] == [3]
    assert info["changed"][0]["change_bytes"] == lim[0] - before.for_rank(0).limit_bytes
    assert plan(path, margin=0.25).for_rank(1).limit_bytes == mib_up(6 * GiB * 1.25)


def oom_record(tmp_path, rank, **kw):
    (tmp_path / "oom").mkdir(exist_ok=True)
    rec = {"distmem_oom": 1, "kind": "oom", "rank": rank, "world_size": 4, **kw}
    (tmp_path / "oom" / f"rank-{rank}.json").write_text(json.dumps(rec))


def test_a_rank_that_ran_out_is_never_planned_above_its_share(tmp_path):
    # the others' unused share is not given to it: data parallel splits the GPU equally
    path = report(tmp_path, [{"rank": r, "peak_bytes": 2 * GiB} for r in range(3)])
    oom_record(tmp_path, 3, allocated_bytes=18 * GiB, request_bytes=4 * GiB)
    share = plan().for_rank(3).limit_bytes
    assert 18 * GiB + 4 * GiB > share  # it could not fit in the equal share
    p = plan(path)
    assert p.for_rank(3).limit_bytes == share
    capped = p.extras["from_report"]["capped"]
    assert [c["rank"] for c in capped] == [3] and capped[0]["wanted_bytes"] == mib_up(22 * GiB * 1.1)
    assert [w for w in p.warnings if "rank 3 needed 22.0 GiB" in w and "will run out again" in w]


def test_the_changes_that_fit_are_named_with_their_figures(tmp_path):
    # rank 3 was fed 8x its peers' batch: 6 GiB entering the step + 1 GiB of activations per 64 samples;
    # the peers' records (stopped by fail fast at step 2) measured their steps
    def steps(samples, entering=6 * GiB, act=2 * GiB):
        return [{"step": 1, "allocated_bytes": entering, "peak_bytes": entering, "samples": samples,
                 "elements": samples * 100},
                {"step": 2, "allocated_bytes": entering, "peak_bytes": entering + act * samples // 64,
                 "samples": samples, "elements": samples * 100}]
    figures = {"device_total_bytes": 80 * GiB, "driver_reserved_bytes": 0, "reserve_bytes": 256 * MiB,
               "overhead_bytes": 768 * MiB, "shared_by": 4, "limit_bytes": 19 * GiB}
    for r in range(3):
        oom_record(tmp_path, r, kind="stopped", step=2, steps=steps(64),
                   peak_bytes=8 * GiB, allocated_bytes=6 * GiB, units={"samples": 64, "elements": 6400}, **figures)
    # rank 3 took the same batch at step 1; at step 2 its shard held 512 samples
    oom_record(tmp_path, 3, step=2, steps=steps(64)[:1] + [dict(steps(64)[1], samples=512, elements=51200)],
               allocated_bytes=17 * GiB, request_bytes=GiB, units={"samples": 512, "elements": 51200}, **figures)
    p = plan(str(tmp_path))
    share = plan().for_rank(3).limit_bytes
    assert p.for_rank(3).limit_bytes == share
    c = p.extras["from_report"]["capped"][0]
    assert c["figure_bytes"] == 6 * GiB + 16 * GiB  # its whole step: its step 1 scaled to its batch
    kinds = {x["change"]: x for x in c["changes"]}
    assert kinds["balance_batch"]["fits"] and kinds["balance_batch"]["samples_per_rank"] == 176
    assert kinds["balance_batch"]["need_bytes"] == 6 * GiB + int(2 * GiB * 176 / 64)
    assert kinds["micro_batch"]["fits"] and kinds["micro_batch"]["micro_batch"] == 256
    assert kinds["fewer_ranks"]["ranks_per_gpu"] == 3 and kinds["fewer_ranks"]["fits"]
    assert kinds["fewer_ranks"]["share_bytes"] == (80 * GiB - 256 * MiB - 3 * 768 * MiB) // 3 // MiB * MiB
    warning = next(w for w in p.warnings if w.startswith("rank 3 needed"))
    assert "balance the batch" in warning and "micro-batch of 256" in warning
    # the peers finished a step before they were stopped (peak 8 GiB), but the change that fits is to
    # balance the batch: each then takes 176 samples, and is planned for that step
    assert p.for_rank(0).limit_bytes == mib_up(kinds["balance_batch"]["need_bytes"] * 1.1) > mib_up(8 * GiB * 1.1)
    assert p.for_rank(0).limit_bytes <= share


def test_a_pipeline_stage_takes_the_largest_figure_of_its_ranks(tmp_path):
    rows = [{"rank": 0, "stage": 0, "peak_bytes": 3 * GiB}, {"rank": 1, "stage": 1, "peak_bytes": 9 * GiB}]
    path = report(tmp_path, rows, world_size=2, strategy="pipeline")
    p = plan(path, strategy="pipeline", ranks=2, fleet="2x80GiB", stages=["4GiB", "2GiB"])
    assert p.for_rank(1).limit_bytes == mib_up(9 * GiB * 1.1)
    assert p.extras["pipeline"]["stages"][1]["planned_bytes"] == mib_up(9 * GiB * 1.1)


def test_another_job_size_plans_from_the_estimate_and_says_so(tmp_path):
    path = report(tmp_path, [{"rank": 0, "peak_bytes": 4 * GiB}], world_size=8)
    p = plan(path)
    assert p.for_rank(0).limit_bytes == plan().for_rank(0).limit_bytes
    assert any("8 ranks" in w for w in p.warnings)


def test_bad_input_is_refused_before_the_hardware(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        plan(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        plan(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="from_margin"):
        plan(report(tmp_path, []), margin=-1)


def test_every_door_plans_the_same(tmp_path, capsys):
    from distmem.cli import main

    path = report(tmp_path, [{"rank": 0, "peak_bytes": 4 * GiB}], world_size=1)
    distmem.reset()
    by_api = distmem.plan_from_env(strategy="data", framework="torch", fleet="1x80GiB", from_report=path)
    assert by_api.mine.limit_bytes == mib_up(4 * GiB * 1.1)
    assert main(["plan", "--gpus", "1x80GiB", "--ranks", "1", "--framework", "torch", "--from", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["allocations"][0]["limit_bytes"] == by_api.mine.limit_bytes
    assert main(["plan", "--gpus", "1x80GiB", "--ranks", "1", "--framework", "torch", "--from", path]) == 0
    assert "rank 0: " in capsys.readouterr().out
    distmem.reset()
