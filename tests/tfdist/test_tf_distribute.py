"""tf.distribute end to end on CPU: MultiWorkerMirroredStrategy workers started by distmem's launcher
gather through the strategy's collectives (bounded by a timeout), the example trains and rank 0
prints the report, MirroredStrategy over logical devices, and the tenants example. Runs on TF 2.15
(Keras 2) and TF 2.21 (Keras 3). DISTMEM_TFDIST_WORKERS (default 2) sets the worker count."""
import json
import os
import re
from types import SimpleNamespace

import pytest

from distmem.comm.tf_strategy import worker_position
from distmem.errors import ConfigError

from helpers import ROOT, python, run

pytest.importorskip("tensorflow")

WORKERS = int(os.environ.get("DISTMEM_TFDIST_WORKERS", "2"))
TF_CONFIG_PY = os.path.join(ROOT, "launch", "tf_config.py")
COMM_WORKER = os.path.join(ROOT, "tests", "tfdist", "progs", "comm_worker.py")
EXAMPLE = os.path.join(ROOT, "examples", "tf_distribute.py")
TENANTS = os.path.join(ROOT, "examples", "tenants.py")
LAUNCH_TIMEOUT = 120 + 60 * WORKERS  # seconds; the launcher's own hard timeout is a little shorter


def results(out):
    """{rank: {key: value}} from the workers' ``RESULT key json`` lines (prefixed ``[rank i]``)."""
    rows = {}
    for m in re.finditer(r"^\[rank (\d+)\] RESULT (\w+) (.*)$", out, re.M):
        rows.setdefault(int(m.group(1)), {})[m.group(2)] = json.loads(m.group(3))
    return rows


def test_gather_through_multiworker_collectives():
    res = run([python(), TF_CONFIG_PY, "-n", str(WORKERS), "--timeout", str(LAUNCH_TIMEOUT - 20), COMM_WORKER],
              LAUNCH_TIMEOUT, {"DISTMEM_TIMEOUT": "60"})
    res.check()
    rows = results(res.out)
    assert sorted(rows) == list(range(WORKERS))
    for r in range(WORKERS):
        assert rows[r]["who"] == {"rank": r, "size": WORKERS, "name": "tf.distribute", "plan_rank": r,
                                  "plan_size": WORKERS}
        got = rows[r]["allgather"]
        assert [g["rank"] for g in got] == list(range(WORKERS))
        assert [g["len"] for g in got] == [10 + 5000 * k for k in range(WORKERS)]  # padding undone per row
        assert rows[r]["sum"] == [sum(k + 1 for k in range(WORKERS)), 10.0 * WORKERS]
        assert rows[r]["max"] == [WORKERS + 0.5]
    assert rows[0]["gather"] == {"rows": [{"r": k} for k in range(WORKERS)], "missing": []}
    assert all(rows[r]["gather"] == {"rows": None, "missing": []} for r in range(1, WORKERS))
    assert rows[0]["report"] == {"ranks": list(range(WORKERS)), "missing": [], "transport": "tf.distribute"}
    assert f"distmem report: {WORKERS} ranks, strategy data, {WORKERS} reporting" in res.out


def test_gather_returns_within_its_timeout_when_a_worker_never_arrives():
    # rank 1 sleeps instead of gathering; rank 0 must give up after DISTMEM_TIMEOUT (5 s) and name it
    res = run([python(), TF_CONFIG_PY, "-n", "2", "--timeout", "100", COMM_WORKER], 130,
              {"DISTMEM_TIMEOUT": "5", "MODE": "skip"})
    assert not res.timed_out, res.out[-4000:]
    rows = results(res.out)
    t = rows[0]["timeout"]
    assert t["missing"] == [1]
    assert "did not complete within 5.0 s on worker 0 of 2" in t["message"]
    assert "no timeout of their own" in t["message"]


@pytest.mark.parametrize("via", ["script", "cli"])
def test_example_multiworker_rank0_prints_the_report(via, tmp_path):
    head = [python(), TF_CONFIG_PY] if via == "script" else [python(), "-m", "distmem.cli", "launch-tf"]
    report = tmp_path / "report.json"
    res = run(head + ["-n", str(WORKERS), "--timeout", str(LAUNCH_TIMEOUT - 20), EXAMPLE, "--steps", "2",
                      "--report", str(report)], LAUNCH_TIMEOUT)
    res.check()
    assert f"[rank 0] distmem report: {WORKERS} ranks, strategy data, {WORKERS} reporting" in res.out
    assert f"{WORKERS} replicas in sync, {WORKERS} ranks, 2 steps" in res.out
    assert f"report: {WORKERS} of {WORKERS} ranks reporting" in res.out
    assert not re.search(r"^\[rank [1-9]\d*\] distmem report", res.out, re.M)  # only rank 0 prints it
    data = json.loads(report.read_text())
    assert [r["rank"] for r in data["ranks"]] == list(range(WORKERS))
    assert data["aggregates"]["transport"] == "tf.distribute"


def test_example_mirrored_over_logical_devices():
    res = run([python(), EXAMPLE, "--mirrored", "--replicas", "2", "--steps", "2"], 240)
    res.check()
    assert "MirroredStrategy: 2 replicas in sync, 1 rank, 2 steps" in res.out
    assert "distmem report: 1 rank, strategy tenants, 1 reporting" in res.out
    assert re.search(r"^replica0\s+/CPU:0", res.out, re.M) and re.search(r"^replica1\s+/CPU:1", res.out, re.M)


def test_tenants_example_shows_both_models_devices_and_limits():
    res = run([python(), TENANTS, "--requests", "3"], 240)
    res.check()
    assert "[tenants] bert: 5 variables on ['/job:localhost/replica:0/task:0/device:CPU:0'], planned /CPU:0" in res.out
    assert re.search(r"\[tenants\] resnet: \d+ variables on \['/job:localhost/replica:0/task:0/device:CPU:1'\]",
                     res.out)
    assert re.search(r"^bert\s+/CPU:0\s+6\.0 GiB\s+no \(recorded\)", res.out, re.M), res.out[-3000:]
    assert re.search(r"^resnet\s+/CPU:1\s+8\.0 GiB\s+no \(recorded\)", res.out, re.M)
    assert "limits are recorded, not enforced" in res.out
    assert "distmem report: 1 rank, strategy tenants, 1 reporting" in res.out


def test_tenants_example_refuses_a_plan_that_does_not_fit():
    res = run([python(), TENANTS, "--tenants", "bert=12GiB,resnet=8GiB"], 120, {"DISTMEM_FLEET": "1x16GiB"})
    # one line naming the values and the remedy (the examples' rule), no traceback
    assert res.rc != 0 and "bert 12.0 GiB + resnet 8.0 GiB = 20.0 GiB" in res.out and "do not fit" in res.out
    assert "Traceback" not in res.out


def _strategy(spec, task_type, task_id):
    resolver = SimpleNamespace(cluster_spec=lambda: SimpleNamespace(as_dict=lambda: spec), task_type=task_type,
                               task_id=task_id)
    return SimpleNamespace(cluster_resolver=resolver)


def test_worker_position_follows_topology_order():
    spec = {"chief": ["h:0"], "worker": ["h:1", "h:2"], "evaluator": ["h:3"]}
    assert worker_position(_strategy(spec, "chief", 0)) == (0, 3)
    assert worker_position(_strategy(spec, "worker", 1)) == (2, 3)
    assert worker_position(SimpleNamespace(cluster_resolver=None)) == (0, 1)
    assert worker_position(_strategy({}, None, None)) == (0, 1)
    with pytest.raises(ConfigError, match="only chief and worker tasks"):
        worker_position(_strategy(spec, "evaluator", 0))


def test_bytes_travel_exactly_as_float32():
    import numpy as np

    from distmem.comm.tf_strategy import pack, unpack

    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 3, 4, 299, 3000):
        payload = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
        row = pack(payload, max(1, -(-n // 3)) + 1)
        assert row.dtype == np.float32 and float(row.max(initial=0)) < 2**24
        assert unpack(row.astype(np.float32), n) == payload
