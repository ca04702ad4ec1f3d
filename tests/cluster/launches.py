"""Shared pieces of the launch tests: the probe's command line, parsing its lines, one verdict per launch."""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Mapping, Optional, Sequence, Union

import pytest

from expect import Expected, compare, table
from harness import Cluster, Result

__all__ = ["skip_or_fail", "need_tool", "PROBE", "ONE_GPU_PER_TASK", "VISIBLE_BY_UUID", "job_dir", "probe_argv", "probe_rows", "report_hosts", "verdict", "outputs"]

def required() -> bool:
    """DISTMEM_REQUIRE_CLUSTER=1: a cluster case that cannot run is a failure, not a skip."""
    return os.environ.get("DISTMEM_REQUIRE_CLUSTER", "") not in ("", "0")


def skip_or_fail(reason: str) -> None:
    if required():
        pytest.fail(f"DISTMEM_REQUIRE_CLUSTER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def need_tool(cluster: Cluster, tool: str) -> str:
    """Path of ``tool`` in the Python environment's bin/ (horovodrun, torchrun), or skip/fail saying so."""
    path = os.path.join(cluster.bin, tool)
    if not os.path.exists(path):
        skip_or_fail(f"{tool} is not in {cluster.bin} (the main environment has it: scripts/env.sh main)")
    return path


HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(HERE, "progs", "probe.py")
#: Exports CUDA_VISIBLE_DEVICES=$SLURM_LOCALID, then runs its arguments (one GPU per task).
ONE_GPU_PER_TASK = os.path.join(HERE, "progs", "one_gpu_per_task.sh")
#: Exports CUDA_VISIBLE_DEVICES=<UUID of GPU number local rank> (or a prefix: --chars N), then runs the rest.
VISIBLE_BY_UUID = os.path.join(HERE, "progs", "visible_by_uuid.py")


def job_dir(cluster: Cluster, name: str) -> str:
    """A fresh folder on the shared filesystem for one launch: ``report.json`` and ``rows/``."""
    path = cluster.path("jobs", name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.join(path, "rows"))
    return path


def probe_argv(cluster: Cluster, transport: str, job: str, timeout: float = 30) -> List[str]:
    """The probe's command line; rank 0 writes ``<job>/report.json``, every rank ``<job>/rows/*.json``."""
    return [os.path.join(cluster.bin, "python"), PROBE, "--transport", transport, "--timeout", str(timeout),
            "--report", os.path.join(job, "report.json"), "--rows", os.path.join(job, "rows")]


def outputs(results: Union[Result, Sequence[Result]]) -> List[Result]:
    return [results] if isinstance(results, Result) else list(results)


def probe_rows(results: Union[Result, Sequence[Result]], job: Optional[str] = None) -> List[Dict[str, object]]:
    """Every rank's row: the files in ``<job>/rows`` or, without them, the ``PROBE {...}`` output lines."""
    rows: List[Dict[str, object]] = []
    folder = os.path.join(job, "rows") if job else None
    if folder and os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    rows.append(json.load(f))
    if rows:
        return rows
    decoder = json.JSONDecoder()
    for r in outputs(results):
        for line in r.out.splitlines():
            at = line.find("PROBE {")
            if at >= 0:
                try:
                    rows.append(decoder.raw_decode(line, at + len("PROBE "))[0])
                except ValueError:
                    continue  # a line the launcher split; the rows/ files are the record
    return rows


def report_hosts(path: str) -> Optional[List[str]]:
    """Hosts named by the rank rows of rank 0's report JSON (None when no report was written)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rep = json.load(f)
    return sorted({str(r.get("host")) for r in rep.get("ranks", [])})


def verdict(cluster: Cluster, results: Union[Result, Sequence[Result]], want: Sequence[Expected],
            job: str, env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Every problem with a launch: timeouts, per-rank placement differences, the report's hosts.

    Returns [] when all is as documented; otherwise the problems, the expected/probed table and the
    launcher's output, ready for ``pytest.fail``.
    """
    res = outputs(results)
    rows = probe_rows(res, job)
    report: Optional[str] = os.path.join(job, "report.json")
    problems = []
    for r in res:
        if r.timed_out:
            problems.append(f"launch timed out after {r.seconds:.0f} s: {r.cmd}")
    problems += compare(want, rows)
    if report is not None:
        hosts = report_hosts(report)
        need = sorted({w.host for w in want})
        if hosts is None:
            errs = [line for r in res for line in r.out.splitlines() if "PROBE-REPORT-ERROR" in line]
            problems.append(f"rank 0 wrote no report at {report}" + (f": {errs[0]}" if errs else ""))
        elif hosts != need:
            problems.append(f"rank 0's report lists hosts {hosts}, the job ran on {need}")
    if not problems:
        return []
    text = ["env: " + json.dumps(dict(env or {}), sort_keys=True), *problems, "", table(want, rows), ""]
    text += [r.describe(8000) for r in res]
    return text
