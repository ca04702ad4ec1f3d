"""The post-mortem's scenario benchmark: real training jobs that run out of memory the way jobs do,
under torchrun and mpirun; for each, whether ``distmem postmortem`` names the rank that failed first,
the cause the scenario has, and a change that, applied in a rerun, lets the job train.

    PYTHONPATH=. python3 bench/report/postmortem_scenarios.py --out /tmp/pms --copy-to "$OUT"   # the H200
    python bench/report/postmortem_scenarios.py --cpu --out /tmp/pms-cpu [--only growth] [--launchers mpirun]

Scenarios (``bench/report/postmortem_job.py`` is the job; each its cause):

  uneven_batch       4 ranks, an MLP; from step 2 rank 2's data-loader shard is 8x the others'    imbalance
  global_batch       4 ranks, every rank fed a batch its limit cannot hold                          over_plan
  long_sequence      4 ranks, a decoder LM; at step 2 rank 1's batch holds one document 16x the
                     usual length, and is padded to it                                              imbalance
  growth             2 ranks; each step's outputs kept on the GPU for an epoch metric                growth
  pipeline_stage     2 ranks, a 2-stage GPipe pipeline (strategy="pipeline") planned from stage
                     sizes that left out stage 1's head activations                                 wrong_stage
  fragmentation      2 ranks; sequence lengths that vary (longer each step), a position table kept
                     per length                                                                     fragmentation
  foreign_mid_run    2 ranks; at step 2 a process outside the job takes the GPU's free memory,
                     at step 4 the batch ramps up                                                   foreign_process
  outside_allocator  2 ranks on the equal split; a metric reduced over a NCCL communicator made
                     each step (one-rank communicators: NCCL refuses two ranks of one GPU in a
                     communicator, so each rank's are its own)                                       outside_allocator

Each job runs with ``distmem.init()`` first (fail fast on), limits from ``limit=`` (small, so the
jobs run out in seconds and run side by side on one GPU) or the equal split; the last two need
the whole GPU and run one at a time after the others. A rerun applies the change the post-mortem
named (``--samples-per-rank``, ``--micro-batch``, ``--keep cpu``, ``init(from_report=)``,
``DISTMEM_TORCH_EXPANDABLE_SEGMENTS=1``, no foreign process, one communicator...); it trained when
every rank finished its steps. The baseline is the previous post-mortem's rules (the first cause
they named) on the same records. Results: ``postmortem_scenarios.json`` and the records of every
run (``postmortem_scenarios_records.tar.gz``) in OUT_DIR; one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
JOB = os.path.join(HERE, "postmortem_job.py")
MiB, GiB = 1024 ** 2, 1024 ** 3
LAUNCHERS = ("torchrun", "mpirun")
#: Out-of-memory errors that reached their jobs within this many seconds of each other happened at
#: the same moment (the first named may be any of them).
SAME_MOMENT = 0.25

#: name -> ranks, the cause it should name, which ranks may fail first ("any" of those that ran out),
#: whether it needs the whole GPU, the job's options on the H200 and on the CPU stand-in
SCENARIOS: Dict[str, Dict[str, Any]] = {
    "uneven_batch": {"ranks": 4, "cause": "imbalance", "first": [2], "exclusive": False,
                     "gpu": ["--limit", "1.25GiB", "--width", "1024", "--depth", "8", "--batch", "4096",
                             "--uneven-rank", "2", "--uneven-factor", "8", "--uneven-from", "2", "--steps", "6"],
                     "cpu": ["--limit", "1.25GiB", "--width", "128", "--depth", "4", "--classes", "128",
                             "--batch", "1024", "--uneven-rank", "2", "--uneven-factor", "8", "--uneven-from", "2",
                             "--steps", "5"]},
    "global_batch": {"ranks": 4, "cause": "over_plan", "first": "any", "exclusive": False,
                     "gpu": ["--limit", "1.25GiB", "--width", "1024", "--depth", "8", "--batch", "32768",
                             "--estimate", "--steps", "4"],
                     "cpu": ["--limit", "1.25GiB", "--width", "128", "--depth", "4", "--classes", "128",
                             "--batch", "8192", "--estimate", "--steps", "3"]},
    "long_sequence": {"ranks": 4, "cause": "imbalance", "first": [1], "exclusive": False,
                      "gpu": ["--limit", "4GiB", "--vocab", "4096", "--dim", "256", "--layers", "4", "--seq", "256",
                              "--batch", "16", "--long-rank", "1", "--long-factor", "16", "--long-at", "2",
                              "--steps", "5"],
                      "cpu": ["--limit", "1.5GiB", "--vocab", "256", "--dim", "32", "--layers", "2", "--seq", "32",
                              "--batch", "8", "--long-rank", "1", "--long-factor", "16", "--long-at", "2",
                              "--steps", "4"]},
    "growth": {"ranks": 2, "cause": "growth", "first": "any", "exclusive": False,
               "gpu": ["--limit", "2GiB", "--width", "1024", "--depth", "8", "--classes", "8192", "--batch", "4096",
                       "--steps", "16"],
               "cpu": ["--limit", "1.5GiB", "--width", "64", "--depth", "3", "--classes", "1024", "--batch", "512",
                       "--steps", "16"]},
    "pipeline_stage": {"ranks": 2, "cause": "wrong_stage", "first": [1], "exclusive": False,
                       "gpu": ["--stages", "1GiB,1.25GiB", "--width", "1024", "--depth", "8", "--classes", "16384",
                               "--batch", "8192", "--micro", "4", "--estimate", "--steps", "4"],
                       "cpu": ["--stages", "512MiB,640MiB", "--width", "64", "--depth", "4", "--classes", "4096",
                               "--batch", "512", "--micro", "4", "--estimate", "--steps", "3"]},
    "fragmentation": {"ranks": 2, "cause": "fragmentation", "first": "any", "exclusive": False,
                      "gpu": ["--limit", "720MiB", "--width", "1024", "--batch", "2", "--steps", "24"],
                      "cpu": ["--limit", "720MiB", "--width", "256", "--batch", "2", "--steps", "24"],
                      "cpu_scale": 4},
    "foreign_mid_run": {"ranks": 2, "cause": "foreign_process", "first": "any", "exclusive": True,
                        "gpu": ["--limit", "3GiB", "--width", "1024", "--depth", "8", "--batch", "16384",
                                "--ramp-at", "4", "--pause-at", "2", "--steps", "6"],
                        "cpu": ["--limit", "1GiB", "--width", "128", "--depth", "4", "--classes", "128",
                                "--batch", "1024", "--ramp-at", "4", "--pause-at", "2", "--steps", "6"],
                        "hog_keep": {"gpu": 512 * MiB, "cpu": 64 * MiB}},
    "outside_allocator": {"ranks": 2, "cause": "outside_allocator", "first": "any", "exclusive": True,
                          "gpu": ["--width", "256", "--depth", "8", "--classes", "256", "--batch", "4800000",
                                  "--groups-per-step", "3", "--steps", "24"],
                          "cpu": ["--width", "64", "--depth", "4", "--classes", "64", "--batch", "20000",
                                  "--groups-per-step", "2", "--steps", "20"]},
}
#: the CPU stand-in: a GPU of this many MiB for each scenario (its own: on the stand-in scenarios do not
#: share one), every real byte booked this many times
CPU_GPU_MIB, CPU_SCALE = 8192, 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if not found:
        raise SystemExit(f"{name} is not on PATH; install it or run with --launchers naming the one there is")
    return found


def command(launcher: str, ranks: int, args: List[str], env_keys: List[str]) -> List[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(ranks), "--max-restarts", "0", "--monitor-interval", "0.5", JOB, *args]
    cmd = [_tool("mpirun"), "-np", str(ranks), "--oversubscribe", "--bind-to", "none",
           "--mca", "orte_abort_on_non_zero_status", "0"]
    for k in env_keys:
        cmd += ["-x", k]
    return cmd + [sys.executable, JOB, *args]


class Runner:
    def __init__(self, out: str, cpu: bool, timeout: float, budget: Optional[float] = None):
        self.out, self.cpu, self.timeout = out, cpu, timeout
        self.deadline = time.monotonic() + budget if budget else None

    def time_left(self) -> float:
        """Seconds a launch may take now: the per-launch timeout, within what is left of the budget."""
        if self.deadline is None:
            return self.timeout
        return min(self.timeout, self.deadline - time.monotonic())

    def env(self, run_dir: str, extra: Optional[Dict[str, str]] = None, scale: int = 0) -> Dict[str, str]:
        e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), DISTMEM_RUN_DIR=run_dir,
                 DISTMEM_TIMEOUT="60", PM_PORT=str(free_port()), NCCL_NVLS_ENABLE="0",
                 TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", CUDA_DEVICE_ORDER="PCI_BUS_ID",
                 OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
                 PYTHONUNBUFFERED="1")
        for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "DISTMEM_TORCH_EXPANDABLE_SEGMENTS", "DISTMEM_LIMIT"):
            e.pop(k, None)
        if self.cpu:
            import postmortem_cpu

            e.update(postmortem_cpu.env(os.path.join(os.path.dirname(run_dir), "stand-in"), CPU_GPU_MIB,
                                        scale or CPU_SCALE))
            e["DISTMEM_OVERHEAD"] = "48MiB"
            e["PM_COMM_BYTES"] = str(2 * MiB)
        e.update(extra or {})
        return e

    def launch(self, name: str, launcher: str, run_dir: str, args: List[str], extra_env: Optional[Dict[str, str]] = None,
               hog_keep: Optional[int] = None) -> Dict[str, Any]:
        """One launch of the job: its exit status, log tail, each rank's truth, seconds."""
        os.makedirs(run_dir, exist_ok=True)
        spec = SCENARIOS[name]
        env = self.env(run_dir, extra_env, spec.get("cpu_scale", 0))
        keys = sorted(k for k in env if k.startswith(("DISTMEM_", "PM_", "NCCL_", "PYTORCH_", "OMP_", "TORCH_",
                                                      "NVSHMEM_", "CUDA_")) or k in ("PYTHONPATH", "PYTHONUNBUFFERED"))
        full = ["--scenario", name, "--out", run_dir, *args]
        wait_file = os.path.join(run_dir, "hog-go")
        if "--pause-at" in full and hog_keep is not None:
            full += ["--wait-file", wait_file]
        elif "--pause-at" in full:
            i = full.index("--pause-at")
            del full[i:i + 2]
        t0 = time.monotonic()
        limit = self.time_left()
        if limit < 15:
            raise TimeoutError(f"not launched: {limit:.0f} s of the bench's budget left")
        log_path = os.path.join(run_dir, "launch.log")
        hog = None
        with open(log_path, "wb") as log:
            p = subprocess.Popen(command(launcher, spec["ranks"], full, keys), env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            try:
                if hog_keep is not None:
                    hog = self._hog(run_dir, hog_keep, env, p)
                    with open(wait_file, "w") as f:
                        f.write("go")
                rc = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill(p)
                rc = None
            finally:
                if hog is not None:
                    _kill(hog)
        truth = {}
        for r in range(spec["ranks"]):
            try:
                with open(os.path.join(run_dir, f"truth-{r}.json")) as f:
                    truth[r] = json.load(f)
            except (OSError, ValueError):
                truth[r] = None
        with open(log_path, "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "truth": truth, "log_tail": tail}

    def _hog(self, run_dir: str, keep: int, env: Dict[str, str], job: subprocess.Popen) -> Optional[subprocess.Popen]:
        """Start the foreign process once the job's rank 0 reached its pause; wait until it holds the GPU."""
        deadline = time.monotonic() + self.time_left()
        while not os.path.exists(os.path.join(run_dir, "paused-0")):
            if job.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        e = {k: v for k, v in env.items() if k != "DISTMEM_RUN_DIR"}
        hog = subprocess.Popen([sys.executable, JOB, "--hog", run_dir, str(keep)], env=e,
                               stdout=open(os.path.join(run_dir, "hog.log"), "wb"), stderr=subprocess.STDOUT,
                               start_new_session=True)
        while not os.path.exists(os.path.join(run_dir, "hog-ready")):
            if hog.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return hog


def _kill(p: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def postmortem_page(run_dir: str) -> Dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "distmem.cli", "postmortem", run_dir, "--json"], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, DISTMEM_QUIET="1"), capture_output=True, text=True,
                         timeout=120)
    text = subprocess.run([sys.executable, "-m", "distmem.cli", "postmortem", run_dir], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, DISTMEM_QUIET="1"), capture_output=True, text=True,
                          timeout=120).stdout
    try:
        page = json.loads(out.stdout)
    except ValueError:
        page = {"error": (out.stderr or out.stdout)[-2000:], "entries": []}
    page["text"] = text
    return page


def previous_rules(records: List[Dict[str, Any]]) -> Optional[str]:
    """The cause the previous post-mortem named first for the first rank that ran out: allocated +
    request over the limit, then a pool whose free bytes hold the request but no block does, then
    another process's bytes (the rules as they were before the whole step was priced)."""
    out = sorted((r for r in records if r.get("kind", "oom") == "oom"), key=lambda r: r.get("time") or 0)
    if not out:
        return None
    r = out[0]
    a, req, limit = r.get("allocated_bytes"), r.get("request_bytes"), r.get("limit_bytes")
    need = a + req if a is not None and req is not None else None
    row = next((s for s in r.get("stages") or [] if s.get("stage") == r.get("stage")), None) \
        if r.get("stage") is not None else None
    if row is not None and need is not None and need > (row.get("planned_bytes") or limit or 0):
        return "wrong_stage"
    if row is None and need is not None and limit and need > limit:
        return "over_plan"
    res, big = r.get("reserved_bytes"), r.get("largest_free_bytes")
    if None not in (res, a, big, req) and res - a >= max(req, 64 * MiB) and big < req:
        return "fragmentation"
    others = sum(p.get("bytes") or 0 for p in r.get("gpu_processes") or [] if p.get("who") == "other")
    if others - (r.get("foreign_planned_bytes") or 0) >= 64 * MiB:
        return "foreign_process"
    return "unexplained"


def change_args(change: Optional[Dict[str, Any]], run_dir: str) -> Tuple[Optional[List[str]], Dict[str, str], bool]:
    """The job's options (and environment) that apply ``change``, and whether the foreign process
    stays; None where the job has no way to apply it."""
    if not change:
        return None, {}, True
    kind = change.get("change")
    if kind == "balance_batch":
        if change.get("samples_per_rank"):
            return ["--samples-per-rank", str(change["samples_per_rank"]),
                    "--elements-per-rank", str(change["elements_per_rank"])], {}, True
        return ["--elements-per-rank", str(change["elements_per_rank"])], {}, True
    if kind == "micro_batch":
        return ["--micro-batch", str(change["micro_batch"])], {}, True
    if kind == "release_kept":
        return ["--keep", "cpu"], {}, True
    if kind in ("plan_from", "limit"):
        return ["--from-report", run_dir], {}, True
    if kind == "expandable_segments":
        return [], {"DISTMEM_TORCH_EXPANDABLE_SEGMENTS": "1"}, True
    if kind == "stop_foreign":
        return [], {}, False
    if kind == "plan_foreign":
        return ["--foreign", str(change["foreign_bytes"])], {}, True
    if kind == "outside_cap":
        return ["--reuse-group", "--overhead", str(change["overhead_bytes"])], {}, True
    if kind == "plan_overhead":
        return ["--overhead", str(change["overhead_bytes"])], {}, True
    if kind == "recompute":
        return ["--recompute"], {}, True
    return None, {}, True


def fragmentation_lengths() -> str:
    """The fragmentation job's sequence lengths, one per step: 1280 to 4224 tokens, each step a
    longer one (its position table kept, its activations needing larger blocks than the last
    step's); the same on the CPU stand-in, whose width is a quarter and whose bytes count 4 times."""
    return ",".join(str(1280 + 128 * k) for k in range(24))


def run_scenario(runner: Runner, name: str, launcher: str) -> Dict[str, Any]:
    spec = SCENARIOS[name]
    kind = "cpu" if runner.cpu else "gpu"
    args = list(spec[kind])
    if name == "fragmentation":
        args += ["--lengths", fragmentation_lengths()]
    base = os.path.join(runner.out, f"{name}-{launcher}")
    shutil.rmtree(base, ignore_errors=True)
    run_dir = os.path.join(base, "oom")
    keep = (spec.get("hog_keep") or {}).get(kind)
    first = runner.launch(name, launcher, run_dir, args, hog_keep=keep)
    page = postmortem_page(run_dir)
    from distmem.observe.oom_record import read_records

    records = read_records(run_dir)
    ooms = {r: t for r, t in first["truth"].items() if t and t.get("oom")}
    earliest = min(ooms, key=lambda r: ooms[r]["oom_time"]) if ooms else None
    # ranks whose errors reached the job within SAME_MOMENT of the earliest failed at the same moment
    # (lockstep ranks in one step: which allocation failed a millisecond first is not the job's to say)
    firsts = sorted(r for r in ooms if ooms[r]["oom_time"] <= ooms[earliest]["oom_time"] + SAME_MOMENT) if ooms else []
    entry = (page.get("entries") or [None])[0]
    named_first = page.get("first")
    cause = entry["causes"][0] if entry and entry.get("causes") else None
    allowed = sorted(ooms) if spec["first"] == "any" else spec["first"]
    row: Dict[str, Any] = {
        "scenario": name, "launcher": launcher, "expected_cause": spec["cause"], "ranks": spec["ranks"],
        "ran_out": sorted(ooms), "earliest_truth": earliest, "first_named": named_first,
        "first_right": named_first is not None and named_first in allowed and named_first in firsts,
        "first_by_clock": firsts,
        "cause_named": cause["kind"] if cause else None, "confidence": cause.get("confidence") if cause else None,
        "cause_right": bool(cause) and cause["kind"] == spec["cause"],
        "causes": [c["kind"] for c in (entry or {}).get("causes", [])], "message": cause.get("message") if cause else None,
        "change": cause.get("change") if cause else None, "remedy": cause.get("remedy") if cause else None,
        "baseline_cause": previous_rules(records), "step_need_bytes": (entry or {}).get("step_need_bytes"),
        "step_need_source": (entry or {}).get("step_need_source"), "oom_run": {k: first[k] for k in ("rc", "seconds")},
        "page_text": page.get("text", "")[-3000:],
    }
    row["baseline_right"] = row["baseline_cause"] == spec["cause"]
    if not ooms:
        row["oom_run"]["log_tail"] = first["log_tail"]
    extra, env, hog_stays = change_args(row["change"], run_dir)
    if extra is None:
        row.update(rerun_trained=False, rerun={"applied": None, "why": "no change the job can apply was named"})
        return row
    rerun_args = args + extra
    rerun = runner.launch(name, launcher, os.path.join(base, "rerun"), rerun_args, extra_env=env,
                          hog_keep=keep if hog_stays else None)
    trained = rerun["rc"] == 0 and all(t and t.get("trained") for t in rerun["truth"].values())
    row["rerun_trained"] = trained
    row["rerun"] = {"applied": (row["change"] or {}).get("change"), "args": extra, "env": env, "foreign": bool(
        hog_stays and keep), "rc": rerun["rc"], "seconds": rerun["seconds"],
        "steps_done": {r: (t or {}).get("steps_done") for r, t in rerun["truth"].items()}}
    if not trained:
        row["rerun"]["log_tail"] = rerun["log_tail"]
    return row


def summary(rows: List[Dict[str, Any]], device: str, seconds: float) -> Dict[str, Any]:
    n = len(rows)
    cause = sum(r["cause_right"] for r in rows)
    base = sum(r["baseline_right"] for r in rows)
    by_scenario = {}
    for r in rows:
        s = by_scenario.setdefault(r["scenario"], {"cause_right": 0, "first_right": 0, "rerun_trained": 0, "runs": 0})
        s["runs"] += 1
        s["cause_right"] += r["cause_right"]
        s["first_right"] += r["first_right"]
        s["rerun_trained"] += bool(r.get("rerun_trained"))
    return {"figure": "scenarios whose cause distmem postmortem names right (real jobs, torchrun and mpirun)",
            "device": device, "runs": n, "cause_right": cause, "first_right": sum(r["first_right"] for r in rows),
            "rerun_trained": sum(bool(r.get("rerun_trained")) for r in rows), "baseline": "the previous rules",
            "baseline_cause_right": base, "ratio": round(cause / base, 2) if base else None,
            "seconds": round(seconds, 1), "by_scenario": by_scenario}


def table(path: str) -> str:
    """The results file as the markdown table the docs quote."""
    if not os.path.exists(path):
        return f"{path}: not run yet (the command above writes it to OUT; copy it here)"
    with open(path) as f:
        data = json.load(f)
    lines = ["| scenario | launcher | first rank named | cause named (expected) | change applied | rerun trained | "
             "previous rules |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['scenario']} | {r['launcher']} | {r['first_named']} ({'right' if r['first_right'] else 'wrong'})"
                     f" | {r['cause_named']} ({r['expected_cause']}) | {(r.get('change') or {}).get('change')} | "
                     f"{'yes' if r.get('rerun_trained') else 'no'} | {r['baseline_cause']} |")
    s = data["summary"]
    lines.append("")
    lines.append(f"{s['device']}: first rank right {s['first_right']}/{s['runs']}, cause right {s['cause_right']}/"
                 f"{s['runs']}, rerun trained {s['rerun_trained']}/{s['runs']}; the previous rules named "
                 f"{s['baseline_cause_right']}/{s['runs']} ({s['seconds']} s)")
    return "\n".join(lines)


def fixtures(src: str, dest: str) -> List[str]:
    """The records of every scenario's first run (the one that ran out of memory) from a run's OUT
    folder or its records archive, into ``dest/<scenario>-<launcher>/`` with a ``manifest.json`` (the
    cause it should name, the ranks that ran out, the one that did first by its own clock): the
    fixtures the post-mortem's tests read (tests/fixtures/postmortem/, tests/unit/report/test_postmortem_jobs.py)."""
    import tempfile

    work = src
    if os.path.isfile(src):
        work = tempfile.mkdtemp(prefix="pm-records-")
        with tarfile.open(src) as tar:
            tar.extractall(work, filter="data")
    done = []
    for name in sorted(os.listdir(work)):
        run = os.path.join(work, name, "oom")
        scenario, _, launcher = name.rpartition("-")
        if scenario not in SCENARIOS or not os.path.isdir(os.path.join(run, "oom")):
            continue
        out = os.path.join(dest, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(os.path.join(out, "oom"))
        for f in sorted(os.listdir(os.path.join(run, "oom"))):
            if f.startswith("rank-") and f.endswith(".json"):
                shutil.copy(os.path.join(run, "oom", f), os.path.join(out, "oom", f))
        truth = {}
        for f in sorted(os.listdir(run)):
            if f.startswith("truth-"):
                with open(os.path.join(run, f)) as fh:
                    t = json.load(fh)
                truth[t["rank"]] = t
        ooms = {r: t for r, t in truth.items() if t.get("oom")}
        spec = SCENARIOS[scenario]
        earliest = min((t["oom_time"] for t in ooms.values()), default=None)
        manifest = {"scenario": scenario, "launcher": launcher, "cause": spec["cause"], "ran_out": sorted(ooms),
                    "first": sorted(r for r, t in ooms.items() if t["oom_time"] <= earliest + SAME_MOMENT),
                    "first_allowed": spec["first"]}
        with open(os.path.join(out, "manifest.json"), "w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
        done.append(out)
    return done


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/postmortem-scenarios")
    ap.add_argument("--cpu", action="store_true", help="the CPU stand-in (torch CPU, Gloo): a smoke run of the bench")
    ap.add_argument("--only", nargs="*", default=None, choices=list(SCENARIOS))
    ap.add_argument("--launchers", nargs="*", default=list(LAUNCHERS), choices=LAUNCHERS)
    ap.add_argument("--parallel", type=int, default=None, help="shared-GPU scenarios at once (default: all)")
    ap.add_argument("--timeout", type=float, default=None, help="per launch, seconds")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for every launch together: a launch that cannot start in what is left is not run")
    ap.add_argument("--copy-to", default=None, help="copy the results and the records' archive here")
    ap.add_argument("--table", default=None, help="print a results file as the docs' table and stop")
    ap.add_argument("--fixtures", nargs=2, metavar=("SRC", "DEST"),
                    help="copy the records of SRC (an OUT folder or the records archive) to DEST as test fixtures")
    a = ap.parse_args()
    if a.table:
        print(table(a.table))
        return 0
    if a.fixtures:
        for d in fixtures(*a.fixtures):
            print(d)
        return 0
    os.makedirs(a.out, exist_ok=True)
    names = a.only or list(SCENARIOS)
    runner = Runner(a.out, a.cpu, a.timeout or (900.0 if a.cpu else 120.0), a.budget)
    if a.cpu:
        device = "CPU stand-in (torch CPU, Gloo)"
    else:
        from distmem.discover.gpus import inventory  # NVML: the parent starts no CUDA context of its own

        gpus = inventory(quiet=True).gpus
        device = gpus[0].name if gpus else "none"
    t0 = time.monotonic()
    jobs = [(n, lch) for n in names for lch in a.launchers]
    shared = [j for j in jobs if not SCENARIOS[j[0]]["exclusive"]]
    alone = [j for j in jobs if SCENARIOS[j[0]]["exclusive"]]
    rows: List[Dict[str, Any]] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.parallel or max(len(shared), 1)) as pool:
        for row in pool.map(lambda j: _safe(runner, *j), shared):
            rows.append(row)
            print(f"{row['scenario']}/{row['launcher']}: first {row['first_named']} ({row['first_right']}), cause "
                  f"{row['cause_named']} ({row['cause_right']}), rerun trained {row.get('rerun_trained')}",
                  file=sys.stderr, flush=True)
    for j in alone:
        row = _safe(runner, *j)
        rows.append(row)
        print(f"{row['scenario']}/{row['launcher']}: first {row['first_named']} ({row['first_right']}), cause "
              f"{row['cause_named']} ({row['cause_right']}), rerun trained {row.get('rerun_trained')}",
              file=sys.stderr, flush=True)
    result = {"summary": summary(rows, device, time.monotonic() - t0), "rows": rows}
    path = os.path.join(a.out, "postmortem_scenarios.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    archive = os.path.join(a.out, "postmortem_scenarios_records.tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        for n, lch in jobs:
            for part in ("oom", "rerun"):
                d = os.path.join(a.out, f"{n}-{lch}", part)
                for sub in ("oom",):
                    if os.path.isdir(os.path.join(d, sub)):
                        tar.add(os.path.join(d, sub), arcname=f"{n}-{lch}/{part}/{sub}")
                for fname in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                    if fname.startswith("truth-") or fname == "launch.log":
                        tar.add(os.path.join(d, fname), arcname=f"{n}-{lch}/{part}/{fname}")
    if a.copy_to:
        os.makedirs(a.copy_to, exist_ok=True)
        shutil.copy(path, a.copy_to)
        shutil.copy(archive, a.copy_to)
    print(json.dumps(result["summary"]), flush=True)
    return 0


def _safe(runner: Runner, name: str, launcher: str) -> Dict[str, Any]:
    try:
        return run_scenario(runner, name, launcher)
    except Exception as exc:  # noqa: BLE001 - one scenario's failure is its row, not the bench's end
        import traceback

        return {"scenario": name, "launcher": launcher, "expected_cause": SCENARIOS[name]["cause"],
                "first_named": None, "first_right": False, "cause_named": None, "cause_right": False,
                "baseline_cause": None, "baseline_right": False, "rerun_trained": False,
                "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}


if __name__ == "__main__":
    sys.exit(main())
