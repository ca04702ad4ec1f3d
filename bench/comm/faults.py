"""Fault injection with counts: one rank SIGKILLed or SIGSTOPped at a seeded point of distmem's calls.

    python bench/comm/faults.py --launcher mpirun --injections 100 --seed 1
    python bench/comm/faults.py --launcher all --injections 3          # the smoke run of tests/faults

Launchers: mpirun (mpi4py), hvd-gloo (horovodrun --gloo), hvd-mpi (horovodrun --mpi), torchrun
(torch.distributed Gloo), tf (tf.distribute MultiWorkerMirroredStrategy workers, ``distmem launch-tf``).
Each injection is one launch of tests/faults/progs/fault_rank.py on --np ranks: a seeded choice of
phase (distmem.init, report, a guard step, a periodic ReportEvery gather), signal (SIGKILL, or SIGSTOP
for a hung rank, thawed once the others are done), victim rank and point (a Python call-event count
inside the phase's distmem calls, drawn below the count a clean calibration launch measured).

What is counted, per launcher, over the surviving ranks (every rank but the victim):
  returned        a call came back (a report listing the missing rank, or all calls clean)
  distmem_error   a DistmemError subclass was raised (GatherTimeoutError, PeerError, ...)
  other_exception anything else raised (its types are listed)
  hang            no outcome within timeout + 5 s + --slack of entering a call (or of the fault)
  killed          the process vanished without an outcome (the launcher or the transport ended it)
plus the seconds past the timeout of the slowest call, the calls over timeout + 5 s, and a reader
thread that polls the report paths (report.json, periodic.json) every few ms and parses each new
version: partial reads are the versions that did not parse. Stray temp files left beside them
(by a writer killed mid-write) are counted too.

Baseline in the same run: --bare injections of the same fault against the transport's own all-gather
(mpi4py allgather, hvd.allgather_object, dist.all_gather_object, strategy.reduce) without distmem.

Launchers that end the whole job when one rank dies (horovodrun --gloo, torchrun, launch-tf) run each
rank under tests/faults/progs/keeper.py, which holds the dead rank's slot until the run is over, so that
the survivors meet distmem's timeouts rather than the launcher's teardown; mpirun and horovodrun --mpi
get ``--mca orte_abort_on_non_zero_status 0`` instead (Open MPI's own switch). One JSON line per
launcher on stdout; --out merges it into a results file keyed by launcher, --log appends one line per
injection.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["LAUNCHERS", "PHASES", "Injection", "run_launcher", "run_injection", "calibrate", "main"]

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT
PROGS = os.path.join(ROOT, "tests", "faults", "progs")
RANK_PROG = os.path.join(PROGS, "fault_rank.py")
KEEPER = os.path.join(PROGS, "keeper.py")
LAUNCHERS = ("mpirun", "hvd-gloo", "hvd-mpi", "torchrun", "tf")
PHASES = ("init", "report", "guard", "periodic")
TRANSPORT = {"mpirun": "mpi", "hvd-gloo": "horovod", "hvd-mpi": "horovod", "torchrun": "torch", "tf": "tf"}
OUTCOMES = ("returned", "distmem_error", "other_exception", "hang", "killed")
REPORT_FILES = ("report.json", "periodic.json")
OWN_FILES = ("progress-", "result-", "pid-", "injected-", "done", "launch.log", "stack-")


def command(launcher: str, np_: int, hard_timeout: float) -> List[str]:
    """The launch command line for one run of the rank program."""
    py = sys.executable
    if launcher == "mpirun":
        cmd = [runner.tool("mpirun"), "-np", str(np_), "--oversubscribe", "--bind-to", "none",
               "--mca", "orte_abort_on_non_zero_status", "0"]
        for key in ("PYTHONPATH", "DISTMEM_TIMEOUT", "DISTMEM_QUIET", "TF_CPP_MIN_LOG_LEVEL", "FAULT_DIR",
                    "FAULT_RANK", "FAULT_PHASE", "FAULT_SIGNAL", "FAULT_POINT", "FAULT_TRANSPORT", "FAULT_MODE",
                    "OMPI_MCA_btl", "OMPI_MCA_btl_vader_single_copy_mechanism"):
            cmd += ["-x", key]
        return cmd + [py, RANK_PROG]
    if launcher in ("hvd-gloo", "hvd-mpi"):
        cmd = [runner.tool("horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}"]
        if launcher == "hvd-gloo":
            return cmd + ["--gloo", py, KEEPER, RANK_PROG]
        return cmd + ["--mpi", "--mpi-args=--oversubscribe --mca orte_abort_on_non_zero_status 0", py, RANK_PROG]
    if launcher == "torchrun":
        return [runner.tool("torchrun"), "--standalone", "--nnodes", "1", "--nproc-per-node", str(np_),
                "--max-restarts", "0", "--no-python", py, KEEPER, RANK_PROG]
    if launcher == "tf":
        return [py, "-m", "distmem.cli", "launch-tf", "-n", str(np_), "--timeout", str(int(hard_timeout)),
                "--grace", "2", KEEPER, RANK_PROG]
    raise SystemExit(f"unknown launcher {launcher!r}; use one of {', '.join(LAUNCHERS)} or all")


@dataclass
class Injection:
    """One planned fault; every field is reproducible from (seed, launcher, index)."""
    index: int
    phase: str
    signal: str       # KILL | STOP | NONE (calibration)
    victim: int
    point: int
    mode: str = "distmem"   # distmem | bare

    def env(self) -> Dict[str, str]:
        return {"FAULT_PHASE": self.phase, "FAULT_SIGNAL": self.signal, "FAULT_RANK": str(self.victim),
                "FAULT_POINT": str(self.point), "FAULT_MODE": self.mode}


@dataclass
class Outcome:
    injection: Injection
    seconds: float = 0.0
    injected: Optional[Dict[str, Any]] = None
    survivors: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    thawed: Optional[Dict[str, Any]] = None
    reads: int = 0
    partial_reads: int = 0
    partial_samples: List[str] = field(default_factory=list)
    stray_files: List[str] = field(default_factory=list)
    launcher_rc: Optional[int] = None
    launcher_hung: bool = False
    problems: List[str] = field(default_factory=list)
    tail: str = ""
    stacks: Dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        inj = self.injection
        return {"index": inj.index, "mode": inj.mode, "phase": inj.phase, "signal": inj.signal,
                "victim": inj.victim, "point": inj.point, "seconds": round(self.seconds, 2),
                "injected_at": (self.injected or {}).get("where"),
                "survivors": {str(r): s for r, s in self.survivors.items()}, "thawed": self.thawed,
                "reads": self.reads, "partial_reads": self.partial_reads, "stray_files": self.stray_files,
                "partial_samples": self.partial_samples,
                "launcher_rc": self.launcher_rc, "launcher_hung": self.launcher_hung, "problems": self.problems,
                "stacks": {str(r): s for r, s in self.stacks.items()}}


class ReportReader(threading.Thread):
    """Polls the report paths and parses every new version it sees (size or mtime changed)."""

    def __init__(self, folder: str, poll: float = 0.003):
        super().__init__(daemon=True)
        self.folder, self.poll = folder, poll
        self.stop = threading.Event()
        self.reads = 0
        self.partial = 0
        self.samples: List[str] = []

    def run(self) -> None:
        seen: Dict[str, Any] = {}
        while not self.stop.is_set():
            for name in REPORT_FILES:
                path = os.path.join(self.folder, name)
                try:
                    st = os.stat(path)
                    key = (st.st_ino, st.st_size, st.st_mtime_ns)
                    if seen.get(name) == key:
                        continue
                    with open(path, "rb") as f:
                        data = f.read()
                except FileNotFoundError:
                    continue
                seen[name] = key
                self.reads += 1
                try:
                    json.loads(data)
                except ValueError as exc:
                    self.partial += 1
                    if len(self.samples) < 5:
                        self.samples.append(f"{name}: {len(data)} bytes, {exc}")
            self.stop.wait(self.poll)


def _load(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def _base_env(timeout: float) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1",
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "OMPI_MCA_btl": "self,vader,tcp", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
                "DISTMEM_TIMEOUT": str(timeout), "DISTMEM_QUIET": "1", "OMP_NUM_THREADS": "1",
                "HOROVOD_LOG_LEVEL": "error"})
    for key in ("DISTMEM_REPORT", "DISTMEM_FLEET", "LD_PRELOAD"):
        env.pop(key, None)
    return env


def run_injection(launcher: str, inj: Injection, *, np_: int, timeout: float, slack: float,
                  startup: float, work: str) -> Outcome:
    """One launch with one fault; every wait bounded; the process group killed at the end if needed."""
    folder = tempfile.mkdtemp(prefix=f"fault-{launcher}-{inj.index}-", dir=work)
    env = _base_env(timeout)
    env.update(inj.env())
    env.update({"FAULT_DIR": folder, "FAULT_TRANSPORT": TRANSPORT[launcher]})
    hard = startup + 4 * (timeout + 5 + slack) + 60
    env["FAULT_KEEPER_WAIT"] = str(hard)
    out = Outcome(inj)
    reader = ReportReader(folder)
    reader.start()
    log_path = os.path.join(folder, "launch.log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(launcher, np_, hard), cwd=folder, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    limit_in_call = timeout + 5 + slack
    ranks = list(range(np_))
    survivors = [r for r in ranks if r != inj.victim] if inj.signal != "NONE" else ranks
    status: Dict[int, str] = {}
    t_inj: Optional[float] = None
    thaw_at: Optional[float] = None
    victim_pid: Optional[int] = None

    def pid_of(r: int) -> Optional[int]:
        d = _load(os.path.join(folder, f"pid-{r}.json"))
        return None if d is None else int(d["pid"])

    try:
        while True:
            now_wall, now = time.time(), time.monotonic()
            exited = proc.poll() is not None
            if inj.signal != "NONE" and t_inj is None:
                out.injected = _load(os.path.join(folder, f"injected-{inj.victim}.json"))
                if out.injected is not None:
                    t_inj = out.injected["wall"]
                    victim_pid = pid_of(inj.victim)
                elif exited or now - t0 > startup + 4 * limit_in_call:
                    out.problems.append("no injection happened (launch ended or stalled before the point)")
                    break
            for r in survivors:
                if r in status:
                    continue
                res = _load(os.path.join(folder, f"result-{r}.json"))
                if res is not None:
                    status[r] = "done"
                    continue
                prog = _load(os.path.join(folder, f"progress-{r}.json"))
                since = max(filter(None, [t_inj, prog["wall"] if prog else None])) if (t_inj or prog) else None
                pid = pid_of(r)
                if exited or (pid is not None and not _alive(pid)):
                    time.sleep(0.2)  # the result file may land just after the exit
                    if _load(os.path.join(folder, f"result-{r}.json")) is not None:
                        status[r] = "done"
                    else:
                        status[r] = "killed"
                        out.survivors[r] = {"outcome": "killed", "where": prog}
                elif since is not None and now_wall - since > limit_in_call and (t_inj or inj.signal == "NONE"):
                    status[r] = "hang"
                    out.survivors[r] = {"outcome": "hang", "where": prog,
                                        "seconds_without_outcome": round(now_wall - since, 1)}
                elif since is None and now - t0 > startup + limit_in_call:
                    status[r] = "hang"
                    out.survivors[r] = {"outcome": "hang", "where": "before its first call (setup)"}
            if len(status) == len(survivors):
                if inj.signal == "STOP" and victim_pid is not None and thaw_at is None:
                    os.kill(victim_pid, signal.SIGCONT)
                    thaw_at = time.time()
                if thaw_at is None:
                    break
                res = _load(os.path.join(folder, f"result-{inj.victim}.json"))
                # A thawed rank may go on through the phases left: it hangs only when one call (or the
                # gap since it was thawed or last moved) outlasts the bound.
                vprog = _load(os.path.join(folder, f"progress-{inj.victim}.json"))
                moved = max(thaw_at, vprog["wall"] if vprog else 0.0)
                if res is not None or not _alive(victim_pid) or time.time() - moved > limit_in_call:
                    out.thawed = _summarise(res, timeout) if res else {
                        "outcome": "hang" if _alive(victim_pid) else "killed",
                        "where": _load(os.path.join(folder, f"progress-{inj.victim}.json"))}
                    break
            if now - t0 > hard:
                out.problems.append(f"hard limit of {hard:.0f} s reached")
                break
            time.sleep(0.05)
        open(os.path.join(folder, "done"), "w").close()
        # A hung rank never leaves: no point waiting for the launcher then (it is killed below).
        hung = any(s.get("outcome") == "hang" for s in out.survivors.values()) or \
            (out.thawed or {}).get("outcome") == "hang"
        # mpirun with orte_abort_on_non_zero_status=0 (set here so that survivors live on) never exits
        # when a rank was killed before MPI_Init and the others left without starting MPI: Open MPI's
        # own wait, not distmem's (reproduced without distmem); the survivors' outcomes are what counts.
        never_started = launcher in ("mpirun", "hvd-mpi") and inj.phase == "init" and inj.signal == "KILL" and \
            all(s.get("outcome") in ("returned", "distmem_error") for s in out.survivors.values())
        try:
            out.launcher_rc = proc.wait(timeout=5 if hung or never_started else 60)
        except subprocess.TimeoutExpired:
            if not hung and not never_started:
                out.launcher_hung = True
                out.problems.append("the launcher did not exit within 60 s after the run was over")
    finally:
        # Stragglers (a hung rank, an orted, a stopped victim) go: the ranks by their pid files (launch-tf
        # starts each worker in a session of its own), then the launcher's group.
        for r in ranks:
            pid = pid_of(r)
            if pid is not None and _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        reader.stop.set()
        reader.join(5)
    out.seconds = time.monotonic() - t0
    for r in survivors:
        if status.get(r) == "done":
            out.survivors[r] = _summarise(_load(os.path.join(folder, f"result-{r}.json")), timeout)
    out.reads, out.partial_reads, out.partial_samples = reader.reads, reader.partial, reader.samples
    for name in os.listdir(folder):
        if name in REPORT_FILES or name.startswith(OWN_FILES):
            continue
        out.stray_files.append(name)
    for name in REPORT_FILES:  # the final versions, read once more after everything stopped
        path = os.path.join(folder, name)
        if os.path.exists(path) and _load(path) is None:
            out.partial_reads += 1
            out.partial_samples.append(f"{name}: final version does not parse")
    with open(log_path, errors="replace") as f:
        out.tail = f.read()[-3000:]
    for r in ranks:  # stacks of calls that overran timeout + 6 s (faulthandler in the rank program)
        path = os.path.join(folder, f"stack-{r}.txt")
        if os.path.exists(path) and os.path.getsize(path):
            with open(path, errors="replace") as f:
                out.stacks[r] = f.read()[-4000:]
    if not os.environ.get("FAULT_KEEP"):
        shutil.rmtree(folder, ignore_errors=True)
    else:
        out.problems.append(f"kept {folder}")
    return out


def _summarise(res: Optional[Dict[str, Any]], timeout: float) -> Dict[str, Any]:
    calls = res["calls"]
    last = calls[-1] if calls else {}
    past = max([c["seconds"] - timeout for c in calls] or [0.0])
    return {"outcome": last.get("outcome", "returned"), "stopped_by": res["stopped_by"],
            "error": last.get("error"), "last_call": last.get("call"), "last_seconds": round(last.get("seconds", 0), 3),
            "max_call_seconds": round(max([c["seconds"] for c in calls] or [0.0]), 3),
            "seconds_past_timeout": round(past, 3), "counts": res.get("counts") or {},
            "calls": len(calls)}


def calibrate(launcher: str, *, np_: int, timeout: float, slack: float, startup: float,
              work: str) -> Dict[str, Any]:
    """A clean launch: every rank must complete; counts each phase's call events per rank."""
    out = run_injection(launcher, Injection(-1, "", "NONE", -1, 0), np_=np_, timeout=timeout, slack=slack,
                        startup=startup, work=work)
    bad = {r: s for r, s in out.survivors.items() if s.get("stopped_by") != "completed"}
    if bad or out.problems or len(out.survivors) != np_:
        raise SystemExit(f"bench/comm/faults.py: the clean {launcher} launch did not complete on every rank: "
                         f"{json.dumps(bad or out.problems)}\n{out.tail}")
    counts = {phase: {r: s["counts"].get(phase, 0) for r, s in out.survivors.items()} for phase in PHASES}
    return {"seconds": out.seconds, "counts": counts,
            "max_call_seconds": max(s["max_call_seconds"] for s in out.survivors.values())}


def plan(launcher: str, seed: int, n: int, np_: int, counts: Dict[str, Dict[int, int]], stop_share: float,
         mode: str = "distmem", offset: int = 0) -> List[Injection]:
    """The seeded faults: phase round-robin from a seeded start (even coverage), the rest drawn."""
    out = []
    for i in range(offset, offset + n):
        rng = random.Random(f"{seed}:{launcher}:{mode}:{i}")
        victim = rng.randrange(np_)
        sig = "STOP" if rng.random() < stop_share else "KILL"
        if mode == "bare":
            out.append(Injection(i, "bare", sig, victim, 1, mode))
            continue
        phase = PHASES[(i + seed) % len(PHASES)]
        top = max(1, int(counts[phase].get(victim, counts[phase].get(str(victim), 1))))
        out.append(Injection(i, phase, sig, victim, rng.randint(1, top), mode))
    return out


def _hang_where(s: Dict[str, Any]) -> str:
    """'distmem' when a hung survivor was inside a distmem call, else 'outside' (framework setup)."""
    where = s.get("where")
    return "distmem" if isinstance(where, dict) and where.get("in_call") else "outside"


def tally(records: List[Dict[str, Any]], timeout: float) -> Dict[str, Any]:
    """Counts over injection records (Outcome.to_dict(), as in the --log file)."""
    per_phase: Dict[str, Dict[str, int]] = {}
    surv = {k: 0 for k in OUTCOMES}
    thawed = {k: 0 for k in OUTCOMES}
    types: Dict[str, int] = {}
    hang_places = {"distmem": 0, "outside": 0}
    hang_by_phase: Dict[str, int] = {}
    past, late, worst = 0.0, 0, None
    failures = []
    for o in records:
        per_phase.setdefault(o["phase"], {"KILL": 0, "STOP": 0})[o["signal"]] += 1
        bad = list(o["problems"])
        for r, s in o["survivors"].items():
            surv[s["outcome"]] += 1
            if s["outcome"] == "other_exception":
                kind = (s.get("error") or "?").split(":")[0]
                types[kind] = types.get(kind, 0) + 1
            if s["outcome"] == "hang":
                hang_places[_hang_where(s)] += 1
                hang_by_phase[o["phase"]] = hang_by_phase.get(o["phase"], 0) + 1
            if s["outcome"] in ("other_exception", "hang", "killed"):
                bad.append(f"rank {r}: {s['outcome']} ({s.get('error') or s.get('where')})")
            p = s.get("seconds_past_timeout", 0.0)
            if p > past:
                past, worst = p, o["index"]
            if s.get("max_call_seconds", 0.0) > timeout + 5:
                late += 1
                bad.append(f"rank {r}: a call took {s['max_call_seconds']:.1f} s (> timeout + 5 s)")
        if o.get("thawed"):
            thawed[o["thawed"]["outcome"]] += 1
            if o["thawed"]["outcome"] == "hang":
                bad.append(f"thawed rank {o['victim']}: hang ({o['thawed'].get('where')})")
        if o["partial_reads"]:
            bad.append(f"partial reads: {o.get('partial_samples')}")
        if o["stray_files"]:
            bad.append(f"stray files: {o['stray_files']}")
        if bad:
            slim = {k: v for k, v in o.items() if k not in ("tail", "stacks")}
            failures.append({**slim, "why": bad, "tail": (o.get("tail") or "")[-1000:],
                             "stacks": {r: st[-1200:] for r, st in (o.get("stacks") or {}).items()}})
    n = len(records)
    return {"injections": n, "per_phase": per_phase, "survivors": surv, "other_exception_types": types,
            "thawed_victims": thawed, "hangs": surv["hang"], "hangs_inside_distmem_call": hang_places["distmem"],
            "hangs_outside_distmem": hang_places["outside"], "hangs_by_phase": hang_by_phase,
            "max_seconds_past_timeout": round(past, 3),
            "worst_injection": worst, "calls_over_timeout_plus_5s": late,
            "report_reads": sum(o["reads"] for o in records), "partial_reads": sum(o["partial_reads"] for o in records),
            "stray_temp_files": sum(len(o["stray_files"]) for o in records),
            "launcher_hangs": sum(bool(o["launcher_hung"]) for o in records),
            "seconds_per_injection": round(sum(o["seconds"] for o in records) / n, 2) if n else None,
            "failures": failures[:12], "failure_count": len(failures)}


def _commit() -> str:
    """The commit measured: DISTMEM_BENCH_COMMIT where the tree was copied without its history
    (the GPU node), else git's HEAD."""
    if os.environ.get("DISTMEM_BENCH_COMMIT"):
        return os.environ["DISTMEM_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def run_launcher(launcher: str, *, injections: int, bare: int, seed: int, np_: int, timeout: float,
                 slack: float, stop_share: float, log: Optional[str], work: str,
                 deadline: Optional[float] = None, minutes: Optional[float] = None,
                 offset: int = 0) -> Dict[str, Any]:
    startup = 240.0 if launcher in ("tf", "hvd-gloo", "hvd-mpi") else 120.0
    started = time.time()
    if minutes is not None:
        deadline = min(deadline or float("inf"), started + 60 * minutes)
    cal = None
    for attempt in (1, 2):  # one retry: a clean launch on a loaded machine can miss its own timeout
        try:
            cal = calibrate(launcher, np_=np_, timeout=timeout, slack=slack, startup=startup, work=work)
            break
        except SystemExit as exc:
            if attempt == 2:
                return {"bench": "faults", "launcher": launcher, "transport": TRANSPORT[launcher], "np": np_,
                        "timeout_s": timeout, "seed": seed, "injections": 0, "calibration_failed": str(exc)[-4000:],
                        "commit": _commit(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    assert cal is not None
    faults = plan(launcher, seed, injections, np_, cal["counts"], stop_share, offset=offset)
    baseline = plan(launcher, seed, bare, np_, cal["counts"], stop_share, mode="bare")
    results: Dict[str, List[Outcome]] = {"distmem": [], "bare": []}
    stopped_early = None
    for inj in baseline + faults:
        if deadline is not None and time.time() > deadline:
            stopped_early = (f"stopped at the time budget (--until/--minutes) after {len(results['distmem'])} of "
                             f"{injections} injections")
            break
        o = run_injection(launcher, inj, np_=np_, timeout=timeout, slack=slack, startup=startup, work=work)
        results[inj.mode].append(o)
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"launcher": launcher, "seed": seed, **o.to_dict(),
                                    "survivor_outcomes": {r: s["outcome"] for r, s in o.survivors.items()},
                                    "wall": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
    meta = {"np": np_, "timeout_s": timeout, "hang_after_s": timeout + 5 + slack, "seed": seed,
            "stop_share": stop_share, "target_injections": injections,
            "clean_launch_seconds": round(cal["seconds"], 2), "calibration_counts": cal["counts"],
            "stopped_early": stopped_early, "commit": _commit(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return summary_line(launcher, [{**o.to_dict(), "tail": o.tail} for o in results["distmem"]],
                        [{**o.to_dict(), "tail": o.tail} for o in results["bare"]], meta)


def summary_line(launcher: str, records: List[Dict[str, Any]], bare_records: List[Dict[str, Any]],
                 meta: Dict[str, Any]) -> Dict[str, Any]:
    """The launcher's JSON line: the counts over its distmem faults beside the bare-transport baseline."""
    timeout = float(meta["timeout_s"])
    main_tally = tally(records, timeout)
    bare_tally = tally(bare_records, timeout)
    hung_bare = bare_tally["survivors"]["hang"]
    bare_n = sum(bare_tally["survivors"].values())
    n_surv = sum(main_tally["survivors"].values())
    return {"bench": "faults", "launcher": launcher, "transport": TRANSPORT[launcher], **meta, **main_tally,
            "baseline": {"what": "the same faults against the transport's own all-gather, without distmem",
                         "injections": bare_tally["injections"], "survivors": bare_tally["survivors"],
                         "other_exception_types": bare_tally["other_exception_types"],
                         "hangs": hung_bare, "failures": bare_tally["failures"][:3]},
            "figure": {"what": "survivors that returned or raised a DistmemError within the bound",
                       "bounded": sum(main_tally["survivors"][k] for k in ("returned", "distmem_error")),
                       "survivors": n_surv},
            "ratio": {"distmem_hang_share": round(main_tally["hangs"] / max(1, n_surv), 4),
                      "bare_hang_share": round(hung_bare / bare_n, 4) if bare_n else None}}


def retally(logs: List[str], out: str) -> List[Dict[str, Any]]:
    """Rebuilds each launcher's line from --log files (keeping the run's metadata from ``out``)."""
    old: Dict[str, Any] = {}
    if os.path.exists(out):
        with open(out) as f:
            old = json.load(f)
    by: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for path in logs:
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    by.setdefault(rec["launcher"], {"distmem": [], "bare": []})[rec["mode"]].append(rec)
    lines = []
    for launcher, recs in by.items():
        prev = old.get(launcher, {})
        keep = ("np", "timeout_s", "hang_after_s", "seed", "stop_share", "target_injections", "clean_launch_seconds",
                "calibration_counts", "stopped_early", "commit", "when", "hang_cause", "other_exception_cause",
                "calibration_counts_offset_run")
        meta = {k: prev[k] for k in keep if k in prev}
        meta.setdefault("timeout_s", 5.0)
        meta["retallied_from"] = [os.path.basename(p) for p in logs]
        if recs["distmem"] and len(recs["distmem"]) >= int(meta.get("target_injections", 0) or 0):
            meta["stopped_early"] = None
        elif meta.get("stopped_early"):
            meta["stopped_early"] = (f"{len(recs['distmem'])} of {meta.get('target_injections')} injections "
                                     "within the runs' time budgets")
        lines.append(summary_line(launcher, recs["distmem"], recs["bare"], meta))
    return lines


def _merge(path: str, line: Dict[str, Any]) -> None:
    data: Dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[line["launcher"]] = line
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launcher", default="all", help=f"one of {', '.join(LAUNCHERS)}, a comma list, or all")
    p.add_argument("--injections", type=int, default=100, help="faults per launcher (default 100)")
    p.add_argument("--bare", type=int, default=2, help="baseline faults against the bare transport (default 2)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--np", type=int, default=2, help="ranks per launch (default 2)")
    p.add_argument("--timeout", type=float, default=5.0, help="DISTMEM_TIMEOUT for every rank, seconds")
    p.add_argument("--slack", type=float, default=10.0,
                   help="seconds beyond timeout + 5 before a rank without an outcome counts as hung (load)")
    p.add_argument("--stop-share", type=float, default=0.25, help="share of SIGSTOP faults (rest SIGKILL)")
    p.add_argument("--out", default=None, help="merge each launcher's line into this JSON file")
    p.add_argument("--log", default=None, help="append one JSON line per injection here")
    p.add_argument("--minutes", type=float, default=None, help="time budget per launcher: no injection starts after it")
    p.add_argument("--offset", type=int, default=0,
                   help="first injection index (continue an earlier run of the same seed; merge with --retally)")
    p.add_argument("--retally", nargs="+", default=None, metavar="LOG",
                   help="rebuild the launchers' lines from these --log files into --out (no launches)")
    p.add_argument("--inject", default=None, metavar="PHASE:SIGNAL:VICTIM:POINT",
                   help="run this one fault (e.g. init:STOP:1:438, from a results file) and print its record")
    p.add_argument("--until", default=None, help="UTC HH:MM: start no injection after it (honest partial count)")
    args = p.parse_args(argv)
    if args.retally:
        if not args.out:
            p.error("--retally needs --out (the results file to update)")
        for line in retally(args.retally, args.out):
            print(json.dumps(line), flush=True)
            _merge(args.out, line)
        return 0
    chosen = LAUNCHERS if args.launcher == "all" else tuple(args.launcher.split(","))
    for name in chosen:
        if name not in LAUNCHERS:
            p.error(f"unknown launcher {name!r}; use one of {', '.join(LAUNCHERS)} or all")
    deadline = None
    if args.until:
        hh, mm = (int(v) for v in args.until.split(":"))
        now = time.gmtime()
        deadline = time.time() + ((hh * 60 + mm) - (now.tm_hour * 60 + now.tm_min)) * 60 - now.tm_sec
    work = tempfile.mkdtemp(prefix="distmem-faults-")
    try:
        if args.inject:
            phase, sig, victim, point = args.inject.split(":")
            inj = Injection(0, phase, sig, int(victim), int(point), "bare" if phase == "bare" else "distmem")
            for name in chosen:
                o = run_injection(name, inj, np_=args.np, timeout=args.timeout, slack=args.slack,
                                  startup=240.0, work=work)
                print(json.dumps({"launcher": name, **o.to_dict(), "tail": o.tail}, indent=1), flush=True)
            return 0
        for name in chosen:
            line = run_launcher(name, injections=args.injections, bare=args.bare, seed=args.seed, np_=args.np,
                                timeout=args.timeout, slack=args.slack, stop_share=args.stop_share, log=args.log,
                                work=work, deadline=deadline, minutes=args.minutes, offset=args.offset)
            print(json.dumps(line), flush=True)
            if args.out:
                _merge(args.out, line)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
