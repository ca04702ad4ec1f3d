"""The tf.distribute launcher (``launch/tf_config.py`` = ``distmem launch-tf``) with stand-in workers:
TF_CONFIGs and ports, rank-prefixed output, the first failure stops the rest, the hard timeout, exit
codes, and nothing left running afterwards. Every launch here also has the test's own hard timeout."""
import json
import os

import pytest

from distmem.cli.launch_tf import tf_configs, worker_command
from distmem.errors import ConfigError

from helpers import ROOT, python, run

PROBE = os.path.join(ROOT, "tests", "tfdist", "progs", "launch_probe.py")
TF_CONFIG_PY = os.path.join(ROOT, "launch", "tf_config.py")


def launch(n, *opts, env=None, timeout=120, via="script"):
    head = [python(), TF_CONFIG_PY] if via == "script" else [python(), "-m", "distmem.cli", "launch-tf"]
    return run(head + ["-n", str(n), *opts, PROBE], timeout, env)


def configs(out):
    rows = {}
    for line in out.splitlines():
        if "CONFIG " in line:
            prefix, payload = line.split("CONFIG ", 1)
            data = json.loads(payload)
            rows[data["rank"]] = (prefix.strip(), data["cfg"])
    return rows


@pytest.mark.parametrize("via", ["script", "cli"])
def test_each_worker_gets_its_tf_config_and_a_prefix(via):
    res = launch(3, "--timeout", "100", via=via)
    res.check()
    rows = configs(res.out)
    assert sorted(rows) == [0, 1, 2]
    cluster = rows[0][1]["cluster"]["worker"]
    assert len(cluster) == 3 and len({a.rsplit(":", 1)[1] for a in cluster}) == 3  # distinct ports
    for rank, (prefix, cfg) in rows.items():
        assert prefix == f"[rank {rank}]"
        assert cfg == {"cluster": {"worker": cluster}, "task": {"type": "worker", "index": rank}}
    assert "[rank 1] stderr line from 1" in res.out  # stderr is prefixed too
    assert "all 3 workers exited 0" in res.out
    # issue 18: distmem's own lines name the rank once, not "[rank 1] [distmem rank 1]"
    assert "[rank 1] [distmem] a line as distmem writes it" in res.out and "[distmem rank" not in res.out


def test_chief_layout():
    res = launch(2, "--chief", "--timeout", "100")
    res.check()
    rows = configs(res.out)
    assert rows[0][1]["task"] == {"type": "chief", "index": 0}
    assert rows[1][1]["task"] == {"type": "worker", "index": 0}


def test_first_failure_stops_the_others_and_sets_the_exit_code():
    # the others sleep 300 s: only the launcher stopping them ends this before the 100 s hard timeout
    res = launch(3, "--timeout", "100", "--grace", "2", env={"MODE": "fail", "FAIL_RANK": "1"})
    assert not res.timed_out, res.out[-3000:]
    assert res.rc == 3, res.out[-3000:]
    assert "[rank 1] failing on purpose" in res.out
    assert "rank 1 failed with exit code 3" in res.out and "stopped ranks [0, 2]" in res.out


def test_hard_timeout_kills_everything():
    res = launch(2, "--timeout", "3", "--grace", "1", env={"MODE": "sleep"})
    assert not res.timed_out and res.rc == 124, res.out[-3000:]
    assert "hard timeout" in res.out and "killed ranks [0, 1]" in res.out


def test_worker_killed_by_a_signal():
    res = launch(2, "--timeout", "100", "--grace", "1", env={"MODE": "signal"})
    assert res.rc == 128 + 9, res.out[-3000:]
    assert "rank 1 failed with signal 9" in res.out


def test_nothing_outlives_the_job(tmp_path):
    res = launch(2, "--timeout", "100", "--grace", "2", env={"MODE": "grandchild", "PID_DIR": str(tmp_path)})
    assert res.rc == 5, res.out[-3000:]
    for rank in (0, 1):
        pid = int((tmp_path / f"{rank}.pid").read_text())
        try:
            os.kill(pid, 0)
            alive = open(f"/proc/{pid}/status").read().find("State:\tZ") < 0
        except (ProcessLookupError, FileNotFoundError):
            alive = False
        assert not alive, f"rank {rank}'s child {pid} outlived the job"


def test_bad_arguments():
    res = run([python(), TF_CONFIG_PY, "-n", "0", PROBE], 60)
    assert res.rc == 2 and "at least one worker" in res.out
    res = run([python(), TF_CONFIG_PY, "-n", "1", "--timeout", "0", PROBE], 60)
    assert res.rc == 2 and "positive hard timeout" in res.out
    res = run([python(), "-m", "distmem.cli", "launch-tf", "-n", "2"], 60)
    assert res.rc == 1 and "nothing to launch" in res.out


def test_helpers():
    assert worker_command(["a.py", "--x"], "py") == ["py", "a.py", "--x"]
    assert worker_command(["--", "python", "-m", "m"], "py") == ["python", "-m", "m"]
    with pytest.raises(ConfigError):
        worker_command([], "py")
    cfgs = [json.loads(c) for c in tf_configs(["h:1", "h:2"], chief=True)]
    assert cfgs[0]["cluster"] == {"chief": ["h:1"], "worker": ["h:2"]}
    single = json.loads(tf_configs(["h:1"], chief=True)[0])
    assert single["cluster"] == {"chief": ["h:1"]}


def test_topology_reads_the_launchers_tf_config():
    from distmem.discover.identity import from_env

    for rank, cfg in enumerate(tf_configs(["localhost:1", "localhost:2", "localhost:3"])):
        topo = from_env({"TF_CONFIG": cfg}, host="me")
        assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.host) == (rank, 3, rank, 3, "me")
    for rank, cfg in enumerate(tf_configs(["localhost:1", "localhost:2"], chief=True)):
        assert from_env({"TF_CONFIG": cfg}).rank == rank
