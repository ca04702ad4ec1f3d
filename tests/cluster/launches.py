"""Shared pieces of the launch tests: the probe's command line, parsing its lines, one verdict per launch."""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Mapping, Optional, Sequence, Union

from expect import Expected, compare, table
from harness import Cluster, Result

__all__ = ["PROBE", "ONE_GPU_PER_TASK", "probe_argv", "probe_rows", "report_hosts", "verdict", "outputs"]

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(HERE, "progs", "probe.py")
#: Exports CUDA_VISIBLE_DEVICES=$SLURM_LOCALID, then runs its arguments (one GPU per task).
ONE_GPU_PER_TASK = os.path.join(HERE, "progs", "one_gpu_per_task.sh")
_LINE = re.compile(r"PROBE (\{.*\})\s*$")


def probe_argv(cluster: Cluster, transport: str, report: Optional[str], timeout: float = 45) -> List[str]:
    argv = [os.path.join(cluster.bin, "python"), PROBE, "--transport", transport, "--timeout", str(timeout)]
    return argv + (["--report", report] if report else [])


def outputs(results: Union[Result, Sequence[Result]]) -> List[Result]:
    return [results] if isinstance(results, Result) else list(results)


def probe_rows(results: Union[Result, Sequence[Result]]) -> List[Dict[str, object]]:
    """Every ``PROBE {...}`` line of the launch's output, parsed (launcher prefixes such as ``[1,0]<stdout>:`` allowed)."""
    rows = []
    for r in outputs(results):
        for line in r.out.splitlines():
            m = _LINE.search(line)
            if m:
                rows.append(json.loads(m.group(1)))
    return rows


def report_hosts(path: str) -> Optional[List[str]]:
    """Hosts named by the rank rows of rank 0's report JSON (None when no report was written)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rep = json.load(f)
    return sorted({str(r.get("host")) for r in rep.get("ranks", [])})


def verdict(cluster: Cluster, results: Union[Result, Sequence[Result]], want: Sequence[Expected],
            report: Optional[str], env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Every problem with a launch: timeouts, per-rank placement differences, the report's hosts.

    Returns [] when all is as documented; otherwise the problems, the expected/probed table and the
    launcher's output, ready for ``pytest.fail``.
    """
    res = outputs(results)
    rows = probe_rows(res)
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
