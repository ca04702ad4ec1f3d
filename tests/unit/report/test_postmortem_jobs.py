"""Every post-mortem rule on the records of real jobs: the out-of-memory records (and the records of
the ranks fail fast stopped) that the scenario benchmark's training jobs wrote, launched under
torchrun and mpirun (bench/report/postmortem_scenarios.py; fixtures copied by its ``--fixtures``).

``tests/fixtures/postmortem/cpu/``: the jobs on the CPU stand-in (torch CPU, Gloo; the GPU's allocator
modelled on the real tensors the job makes, see bench/report/postmortem_cpu.py). Another set beside
it (the H200's, from the same benchmark) is read the same way. Each job's ``manifest.json`` says
the cause the scenario has and which rank ran out first by the job's own clock."""
import glob
import json
import os

import pytest

from distmem.plan import need as needs
from distmem.plan.from_report import observed_from_dicts
from distmem.observe.oom_record import read_records
from distmem.report import postmortem as pm

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "fixtures", "postmortem")
JOBS = sorted(glob.glob(os.path.join(FIXTURES, "*", "*", "manifest.json")))


def job_id(path):
    return "/".join(path.split(os.sep)[-3:-1])


def load(manifest):
    folder = os.path.dirname(manifest)
    with open(manifest) as f:
        return json.load(f), read_records(folder), folder


def test_the_jobs_cover_every_rule():
    causes = {json.load(open(m))["cause"] for m in JOBS}
    assert set(pm.RULES) <= causes, f"no real job's records for {set(pm.RULES) - causes}"


@pytest.mark.parametrize("manifest", JOBS, ids=[job_id(m) for m in JOBS])
def test_the_page_names_the_first_rank_and_the_cause(manifest):
    info, records, folder = load(manifest)
    page = pm.postmortem(records, run_dir=folder)
    assert page["first"] in info["first"], pm.render_text(page)  # the ranks that failed at that moment
    if info["first_allowed"] != "any":
        assert page["first"] in info["first_allowed"]
    first = page["entries"][0]["causes"][0]
    assert first["kind"] == info["cause"], pm.render_text(page)
    assert first["confidence"] in ("high", "medium")
    # the cause names a change that fits, with its figure
    assert first["change"] and first["change"]["fits"], first


@pytest.mark.parametrize("manifest", [m for m in JOBS if json.load(open(m))["cause"] in ("imbalance", "over_plan")],
                         ids=[job_id(m) for m in JOBS if json.load(open(m))["cause"] in ("imbalance", "over_plan")])
def test_the_step_is_priced_whole_not_at_the_failing_allocation(manifest):
    info, records, _ = load(manifest)
    first = next(r for r in sorted(records, key=lambda r: r["time"]) if needs.ran_out(r))
    n = needs.step_need(first, needs.peers_of(first, records))
    assert not n.lower_bound and n.source in ("history", "estimate", "peers")
    assert n.bytes > first["limit_bytes"] >= needs.at_failure(first) * 0.5


@pytest.mark.parametrize("manifest", [m for m in JOBS if json.load(open(m))["cause"] == "imbalance"],
                         ids=[job_id(m) for m in JOBS if json.load(open(m))["cause"] == "imbalance"])
def test_the_next_plan_keeps_the_rank_in_its_share_and_says_what_fits(manifest):
    from distmem.plan import JobLayout, PlanRequest

    info, records, folder = load(manifest)
    rank = info["first"][0]
    first = next(r for r in records if r["rank"] == rank)
    ranks = first["world_size"]
    fleet = f"1x{first['device_total_bytes'] // 1024 ** 2}MiB"
    limit = f"{first['limit_bytes'] // 1024 ** 2}MiB"
    plan = PlanRequest(strategy="data", options={"limit": limit}, framework="torch", fleet=fleet,
                       reserve=first["reserve_bytes"], overhead=first["overhead_bytes"],
                       job=JobLayout.declare(ranks=ranks, fleet=fleet), from_report=folder).plan()
    assert plan.for_rank(rank).limit_bytes == first["limit_bytes"]  # never above what the job gave each rank
    capped = plan.extras["from_report"]["capped"]
    assert [c["rank"] for c in capped] == [rank]
    fits = [c for c in capped[0]["changes"] if c["fits"]]
    assert fits and fits[0]["change"] == "balance_batch" and fits[0]["need_bytes"] < first["limit_bytes"]


@pytest.mark.parametrize("manifest", [m for m in JOBS if json.load(open(m))["cause"] == "wrong_stage"],
                         ids=[job_id(m) for m in JOBS if json.load(open(m))["cause"] == "wrong_stage"])
def test_the_next_plan_gives_the_stage_what_its_step_needed(manifest):
    info, records, folder = load(manifest)
    observed = observed_from_dicts(None, records, folder)
    failed = next(r for r in records if r["rank"] == info["first"][0])
    # the stage's whole step, from the estimate noted at its batch: more than it held when it failed
    assert observed.stages[failed["stage"]] > needs.at_failure(failed)
