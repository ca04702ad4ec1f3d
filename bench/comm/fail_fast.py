"""Fail fast, counted: one rank of a 4-rank training loop is SIGKILLed at a random time, and every
other rank must exit within 10 s printing one line that names the dead rank and the cause; or it
ends on an uncaught exception (``--exceptions``: a MemoryError outside the guard), and every other
rank must exit within 5 s naming it and its exception.

    python bench/comm/fail_fast.py --launcher all --injections 100 --exceptions 20 --bare 5 --seed 1 \
        --out bench/results/fail_fast.json

Each injection is one launch of tests/faults/progs/train_loop.py on 4 ranks (a tiny data parallel
loop: 64 floats all-reduced every 5 ms by the framework's own collective - torch.distributed Gloo
under torchrun, mpi4py Allreduce under mpirun, horovod.tensorflow's allreduce under
``horovodrun --gloo`` (launcher ``horovodrun``) and ``horovodrun --mpi`` (``horovodrun-mpi``: Horovod
under mpirun)) with ``distmem.init()`` first (fail fast on by default; under Horovod before
``hvd.init()``, as users write it); the victim (a random rank) kills itself at a random time 0.2-2 s
into the loop.

The launcher must not tear the job down itself, as it does not on a real cluster when the rank is
lost with its node (a lost host is unseen by the other hosts' launchers until their own timeouts):
under torchrun and horovodrun --gloo every rank runs under tests/faults/progs/keeper.py (which holds
the dead rank's slot until the run is over); mpirun and horovodrun --mpi get
``--mca orte_abort_on_non_zero_status 0``.

Counted over the survivors of each injection: ``line`` (exited within 10 s of the kill with the one
line), ``exited_other`` (exited within the bound without the line: the transport raised on its
own), ``late`` (exited after 10 s), ``hang`` (still running at the bound, then killed). The
baseline in the same run (--bare N): the same loop without distmem, bounded by --bare-bound seconds:
how long the survivors wait.

One JSON line per launcher on stdout; --out writes them all to a results file keyed by launcher.
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
import time
from typing import Any, Dict, List, Optional

__all__ = ["LAUNCHERS", "run_injection", "run_launcher", "run_exceptions", "main", "LINE_MARK", "WITHIN",
           "WITHIN_EXCEPTION"]

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import runner  # noqa: E402  the tree on sys.path, launchers, results, the JSON line

ROOT = runner.ROOT
PROGS = os.path.join(ROOT, "tests", "faults", "progs")
PROG = os.path.join(PROGS, "train_loop.py")
KEEPER = os.path.join(PROGS, "keeper.py")
LAUNCHERS = ("torchrun", "mpirun", "horovodrun", "horovodrun-mpi")
TRANSPORT = {"torchrun": "torch", "mpirun": "mpi", "horovodrun": "horovod", "horovodrun-mpi": "horovod"}
WITHIN = 10.0
#: A rank that ends on an exception sends its death notice itself: the others are out within this.
WITHIN_EXCEPTION = 5.0
LINE_MARK = "; stopping this rank"


def command(launcher: str, np_: int) -> List[str]:
    py = sys.executable
    if launcher == "torchrun":
        return [runner.tool("torchrun"), "--standalone", "--nnodes", "1", "--nproc-per-node", str(np_),
                "--max-restarts", "0", "--no-python", py, KEEPER, PROG]
    if launcher == "mpirun":
        cmd = [runner.tool("mpirun"), "-np", str(np_), "--oversubscribe", "--bind-to", "none",
               "--mca", "orte_abort_on_non_zero_status", "0"]
        for key in ("PYTHONPATH", "DISTMEM_TIMEOUT", "DISTMEM_FAIL_FAST", "FF_DIR", "FAULT_DIR", "FF_VICTIM", "FF_AT",
                    "FF_HOW", "FF_MODE", "FF_TRANSPORT", "FF_LIMIT", "FF_REPLACE_EXCEPTHOOK"):
            cmd += ["-x", key]
        return cmd + [py, PROG]
    if launcher == "horovodrun":
        return [runner.tool("horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", py, KEEPER, PROG]
    if launcher == "horovodrun-mpi":
        return [runner.tool("horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--mpi",
                "--mpi-args=--oversubscribe --bind-to none --mca orte_abort_on_non_zero_status 0", py, PROG]
    raise SystemExit(f"unknown launcher {launcher!r}; use one of {', '.join(LAUNCHERS)} or all")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def run_injection(launcher: str, victim: int, at: float, *, how: str = "kill", mode: str = "distmem", np_: int = 4,
                  bound: float = 30.0, startup: float = 120.0, work: Optional[str] = None) -> Dict[str, Any]:
    """One launch with one fault. Returns the victim, the seconds from the fault to each survivor's
    exit (None: still running at ``bound``), each survivor's fail-fast line (or None), its outcome,
    and problems (the fault never fired, a rank never started)."""
    folder = tempfile.mkdtemp(prefix="ff-", dir=work)
    env = dict(os.environ, FF_DIR=folder, FAULT_DIR=folder, FF_VICTIM=str(victim), FF_AT=f"{at:.3f}", FF_HOW=how,
               FF_MODE=mode, FF_TRANSPORT=TRANSPORT[launcher], FF_LIMIT=str(at + bound + 30),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), FAULT_KEEPER_WAIT=str(bound + 60))
    env.setdefault("DISTMEM_TIMEOUT", "30")
    log = open(os.path.join(folder, "launch.log"), "wb")
    proc = subprocess.Popen(command(launcher, np_), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    out: Dict[str, Any] = {"launcher": launcher, "mode": mode, "victim": victim, "at": round(at, 3), "how": how,
                           "survivors": {}, "problems": []}
    pids: Dict[int, int] = {}
    t_start = time.monotonic()
    try:
        fault_wall: Optional[float] = None
        exits: Dict[int, float] = {}
        while True:
            now = time.monotonic()
            for r in range(np_):
                if r not in pids:
                    text = _read(os.path.join(folder, f"pid-{r}"))
                    if text:
                        pids[r] = int(text)
            if fault_wall is None:
                text = _read(os.path.join(folder, "fault"))
                if text:
                    fault_wall = float(text)
                    fault_mono = now - (time.time() - fault_wall)
                    out["start_seconds"] = round(fault_mono - t_start - at, 2)
            if fault_wall is None:
                if proc.poll() is not None or now - t_start > startup + at:
                    out["problems"].append("the fault never fired (a rank did not start, or the launch ended)")
                    break
                time.sleep(0.02)
                continue
            for r, pid in pids.items():
                if r != victim and r not in exits and not _alive(pid):
                    exits[r] = time.monotonic() - fault_mono
            if all(r in exits for r in range(np_) if r != victim) or now - fault_mono > bound:
                break
            time.sleep(0.02)
        for r in range(np_):
            if r == victim or fault_wall is None:
                continue
            text = _read(os.path.join(folder, f"stderr-{r}.txt")) or ""
            line = next((ln for ln in text.splitlines() if ln.startswith("distmem: rank") and LINE_MARK in ln), None)
            secs = exits.get(r)
            if secs is None:
                outcome = "hang"
            elif secs > WITHIN:
                outcome = "late"
            elif line is not None:
                outcome = "line"
            else:
                outcome = "exited_other"
            raised = _read(os.path.join(folder, f"raised-{r}"))
            out["survivors"][r] = {"seconds": None if secs is None else round(secs, 3), "outcome": outcome,
                                   "line": line, "raised": raised}
    finally:
        open(os.path.join(folder, "done"), "w").close()
        t_done = time.monotonic()
        for r, pid in pids.items():
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
        out["launcher_rc"] = proc.returncode
        out["launcher_exit_seconds"] = round(time.monotonic() - t_done, 2)
        out["tail"] = (_read(os.path.join(folder, "launch.log")) or "")[-1500:]
        shutil.rmtree(folder, ignore_errors=True)
    return out


def run_exceptions(launcher: str, injections: int, seed: int, bound: float, log_path: Optional[str] = None
                   ) -> Dict[str, Any]:
    """``injections`` launches in which a random rank ends on an uncaught MemoryError at a random
    time: each survivor out within :data:`WITHIN_EXCEPTION` s with the line naming it and its
    exception (issue 35: under mpirun the others used to wait 60-70 s)."""
    rng = random.Random(f"{seed}-{launcher}-exception")
    counts = {k: 0 for k in ("line", "exited_other", "late", "hang")}
    seconds: List[float] = []
    named = 0
    problems: List[str] = []
    for i in range(injections):
        victim, at = rng.randrange(4), rng.uniform(0.2, 2.0)
        res = run_injection(launcher, victim, at, how="oom", bound=bound)
        for r, s in res["survivors"].items():
            outcome = s["outcome"]
            if outcome == "line" and s["seconds"] is not None and s["seconds"] > WITHIN_EXCEPTION:
                outcome = "late"
            counts[outcome] += 1
            named += bool(s["line"] and f"rank {victim} " in s["line"] and "MemoryError: out of memory" in s["line"])
            if s["seconds"] is not None:
                seconds.append(s["seconds"])
        problems += [f"exception injection {i}: {p}" for p in res["problems"]]
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps({k: v for k, v in res.items() if k != "tail"}) + "\n")
        print(f"[fail_fast] {launcher} exception {i + 1}/{injections}: victim {victim} at {at:.2f} s: "
              + ", ".join(f"{r}={s['outcome']}:{s['seconds']}" for r, s in res["survivors"].items()),
              file=sys.stderr, flush=True)
    seconds.sort()
    return {"injections": injections, "survivors": sum(counts.values()), "exits_within_5s": counts["line"],
            "named_with_exception": named, "hangs": counts["hang"], "late": counts["late"],
            "exited_without_line": counts["exited_other"], "problems": problems,
            "exit_seconds_p50": _pct(seconds, 0.5), "exit_seconds_p99": _pct(seconds, 0.99),
            "exit_seconds_max": seconds[-1] if seconds else None}


def _pct(xs: List[float], q: float) -> Optional[float]:
    return None if not xs else round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def run_launcher(launcher: str, injections: int, bare: int, seed: int, bound: float, bare_bound: float,
                 log_path: Optional[str] = None, exceptions: int = 0) -> Dict[str, Any]:
    rng = random.Random(f"{seed}-{launcher}")
    counts = {k: 0 for k in ("line", "exited_other", "late", "hang")}
    seconds: List[float] = []
    problems: List[str] = []
    t0 = time.monotonic()
    for i in range(injections):
        victim, at = rng.randrange(4), rng.uniform(0.2, 2.0)
        res = run_injection(launcher, victim, at, bound=bound)
        for r, s in res["survivors"].items():
            counts[s["outcome"]] += 1
            if s["seconds"] is not None:
                seconds.append(s["seconds"])
        problems += [f"injection {i}: {p}" for p in res["problems"]]
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps({k: v for k, v in res.items() if k != "tail"}) + "\n")
        print(f"[fail_fast] {launcher} {i + 1}/{injections}: victim {victim} at {at:.2f} s: "
              + ", ".join(f"{r}={s['outcome']}:{s['seconds']}" for r, s in res["survivors"].items()),
              file=sys.stderr, flush=True)
    peer_counts = {k: 0 for k in ("line", "exited_other", "late", "hang")}
    peer_seconds: List[float] = []
    for i in range(bare):
        victim, at = rng.randrange(4), rng.uniform(0.2, 2.0)
        res = run_injection(launcher, victim, at, mode="bare", bound=bare_bound)
        for r, s in res["survivors"].items():
            peer_counts[s["outcome"]] += 1
            peer_seconds.append(s["seconds"] if s["seconds"] is not None else bare_bound)
        problems += [f"bare {i}: {p}" for p in res["problems"]]
        print(f"[fail_fast] {launcher} bare {i + 1}/{bare}: "
              + ", ".join(f"{r}={s['outcome']}:{s['seconds']}" for r, s in res["survivors"].items()),
              file=sys.stderr, flush=True)
    survivors = sum(counts.values())
    seconds.sort()
    peer_seconds.sort()
    pct = _pct
    exception = run_exceptions(launcher, exceptions, seed, bound, log_path) if exceptions else None

    return {
        "bench": "fail_fast", "launcher": launcher, "ranks": 4, "injections": injections, "survivors": survivors,
        "exits_within_10s": counts["line"], "hangs": counts["hang"], "late": counts["late"],
        "exited_without_line": counts["exited_other"], "problems": problems,
        "exit_seconds_p50": pct(seconds, 0.5), "exit_seconds_p99": pct(seconds, 0.99),
        "exit_seconds_max": seconds[-1] if seconds else None,
        "peer": {"what": "the same loop without distmem (survivors' wait, bounded)", "injections": bare,
                 "bound_seconds": bare_bound, "counts": peer_counts, "wait_seconds_p50": pct(peer_seconds, 0.5),
                 "wait_seconds_max": peer_seconds[-1] if peer_seconds else None},
        "ratio_p50_wait_over_exit": (round(pct(peer_seconds, 0.5) / pct(seconds, 0.5), 1)
                                     if seconds and peer_seconds and pct(seconds, 0.5) else None),
        "exception": exception,
        "heartbeat": "authenticated (HMAC challenge-response; the key over the transport, else the user's key file)",
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launcher", default="all", help=f"{', '.join(LAUNCHERS)} or all")
    ap.add_argument("--injections", type=int, default=100)
    ap.add_argument("--bare", type=int, default=5, help="baseline injections without distmem")
    ap.add_argument("--exceptions", type=int, default=20,
                    help="injections in which the rank ends on an uncaught MemoryError instead of SIGKILL")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bound", type=float, default=30.0, help="seconds after the fault before a survivor is hung")
    ap.add_argument("--bare-bound", type=float, default=20.0)
    ap.add_argument("--out", help="results JSON (keyed by launcher)")
    ap.add_argument("--log", help="append one JSON line per injection")
    args = ap.parse_args(argv)
    launchers = LAUNCHERS if args.launcher == "all" else (args.launcher,)
    results: Dict[str, Any] = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    for launcher in launchers:
        line = run_launcher(launcher, args.injections, args.bare, args.seed, args.bound, args.bare_bound, args.log,
                            args.exceptions)
        print(json.dumps(line), flush=True)
        results[launcher] = line
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
