"""Generated jobs and the doors that plan them, for the "one job, one answer" property test.

A job is a strategy with its options, a framework, a fleet (uniform, mixed, per host, per host with
a default), a launcher layout (hosts with their ranks - uneven too -, block or cyclic mapping,
what each rank sees through CUDA_VISIBLE_DEVICES) and DISTMEM_* settings. Each door is asked the
same job its own way:

* whole-job doors, in the test process: ``distmem plan --json``, ``distmem doctor --json`` with the
  job's flags, ``distmem plan --emit k8s`` (its per-rank limits), ``distmem fit`` (strategy auto);
* per-rank doors, in worker processes that play the ranks (one worker per rank slot, each job's
  ranks of one host meeting in the real host-local exchange): ``distmem.init()``,
  ``distmem.plan_from_env()`` and ``distmem doctor --json`` under the rank's launcher variables.

Each door's answer is reduced to, per rank, ``(mode, [(gpu uuid, planned bytes, enforced), ...])``
or the error's class and message (the part after the door's own prefix).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

FLEETS = ["1x16GiB", "2x16GiB", "4x80GiB", "2x80GiB,2x40GiB", "2x24GiB", "1x8GiB", "a=2x80GiB;b=2x16GiB",
          "b=2x16GiB;a=2x80GiB", "a=4x40GiB;*=4x16GiB", "a=2x80GiB;b=4x16GiB", "a=1x16GiB;b=1x8GiB"]
FRAMEWORKS = ["none", "torch", "tensorflow"]
GiB = 1024**3


def _gpus_of(fleet: str, host: str) -> List[int]:
    from distmem.discover.gpus import parse_fleet

    return parse_fleet(fleet, host)


def _named(fleet: str) -> List[str]:
    from distmem.discover.gpus import fleet_hosts

    return [h for h in fleet_hosts(fleet) if h != "*"]


def _layers(rng: random.Random, n: int) -> List[Dict[str, Any]]:
    return [{"name": f"l{k}", "state_bytes": rng.randint(1, 40) * 64 * 1024**2,
             "activation_bytes": rng.randint(1, 40) * 32 * 1024**2, "output_bytes": rng.randint(1, 8) * 1024**2}
            for k in range(n)]


def make_job(rng: random.Random, index: int) -> Dict[str, Any]:
    """One generated job (plain data: JSON goes to the workers)."""
    fleet = rng.choice(FLEETS)
    named = _named(fleet)
    strategy = rng.choices(["data", "pipeline", "pipeline-layers", "model", "tenants", "auto"],
                           [40, 15, 10, 10, 15, 10])[0]
    if named:
        hosts = list(named)
        if "*" in fleet and rng.random() < 0.3:
            hosts.append("host1" if "host1" not in hosts else "host9")
    else:
        hosts = ["host0"] if rng.random() < 0.6 else ["host0", "host1"]
    uniform = strategy in ("auto", "pipeline", "pipeline-layers", "model") or rng.random() < 0.5
    base = rng.randint(1, 4)
    counts = [base if uniform else rng.randint(1, 4) for _ in hosts]
    while sum(counts) > 8:
        counts = [max(1, c - 1) for c in counts]
    mapping = "cyclic" if rng.random() < 0.2 and strategy not in ("auto",) else "block"
    if mapping == "cyclic" and len(set(counts)) > 1:
        mapping = "block"
    gpus = [len(_gpus_of(fleet, h)) for h in hosts]
    visible: Optional[str] = None
    roll = rng.random()
    if roll < 0.15 and all(c <= g for c, g in zip(counts, gpus)):
        visible = "own"
    elif roll < 0.25:
        visible = "0"
    elif roll < 0.30 and min(gpus) >= 2:
        visible = "1,0"
    elif roll < 0.34:
        visible = "5"
    env: Dict[str, str] = {}
    args: Dict[str, Any] = {"framework": rng.choice(FRAMEWORKS)}
    if rng.random() < 0.25:
        (env.__setitem__("DISTMEM_MEMORY", rng.choice(["auto", "growth", "limit"])) if rng.random() < 0.5
         else args.__setitem__("memory", rng.choice(["growth", "limit"])))
    if rng.random() < 0.2:
        (env.__setitem__("DISTMEM_OVERHEAD", rng.choice(["512MiB", "1GiB", "auto"])) if rng.random() < 0.5
         else args.__setitem__("overhead", rng.choice(["512MiB", "2GiB"])))
    if rng.random() < 0.2:
        args["reserve"] = rng.choice(["1GiB", "5%", "0"])
    if rng.random() < 0.1:
        args["foreign"] = rng.choice(["2GiB", "10%"])
    size = sum(counts)
    options: Dict[str, Any] = {}
    if strategy == "data":
        if rng.random() < 0.3:
            value = rng.choice(["0.4", "6GiB", "45%", "200GiB", "0.9"])
            (env.__setitem__("DISTMEM_LIMIT", value) if rng.random() < 0.5 else args.__setitem__("limit", value))
    elif strategy == "pipeline":
        p = counts[0]
        n = p if rng.random() < 0.85 else p + 1
        options["stages"] = [f"{rng.randint(1, 20)}GiB" for _ in range(n)]
        if rng.random() < 0.3:
            options["headroom"] = rng.choice(["0", "20%", "0.05"])
        if rng.random() < 0.1:
            env["DISTMEM_LIMIT"] = "4GiB"  # a data-only setting: every door must refuse it the same way
    elif strategy == "pipeline-layers":
        strategy = "pipeline"
        options["layers"] = _layers(rng, rng.randint(4, 10))
        options["num_stages"] = counts[0] if size % counts[0] == 0 else size
        options["num_micro_batches"] = rng.randint(1, 6)
        options["schedule"] = rng.choice(["1f1b", "gpipe"])
        options["recompute"] = rng.random() < 0.3
    elif strategy == "model":
        options["layers"] = _layers(rng, rng.randint(3, 8))
        if rng.random() < 0.4:
            options["gpus_per_rank"] = rng.randint(1, 2)
    elif strategy == "tenants":
        options["tenants"] = rng.choice(["a=2GiB,b=auto", "bert=6GiB,resnet=8GiB", "x=auto", "a=40%,b=1GiB",
                                         "big=70GiB"])
    elif strategy == "auto":
        options["layers"] = _layers(rng, rng.randint(4, 8))
        options["layers_batch_size"] = 1
        options["global_batch_size"] = rng.choice([8, 16, 32, 64]) * max(1, size)
    return {"index": index, "strategy": strategy, "fleet": fleet, "hosts": list(zip(hosts, counts)),
            "mapping": mapping, "visible": visible, "env": env, "args": args, "options": options}


def jobs(seed: int, count: int) -> List[Dict[str, Any]]:
    rng = random.Random(seed)
    return [make_job(rng, i) for i in range(count)]


# -- what each rank is --------------------------------------------------------------------------------

def rank_places(job: Dict[str, Any]) -> List[Tuple[str, int, int]]:
    """(host, local rank, ranks on that host) of every rank, by the job's mapping."""
    hosts = job["hosts"]
    if job["mapping"] == "block":
        return [(h, lr, n) for h, n in hosts for lr in range(n)]
    out, seen = [], {h: 0 for h, _ in hosts}
    left = {h: n for h, n in hosts}
    while len(out) < sum(n for _, n in hosts):
        for h, n in hosts:
            if left[h]:
                out.append((h, seen[h], n))
                seen[h] += 1
                left[h] -= 1
    return out


def rank_env(job: Dict[str, Any], rank: int, door: str, layout_dir: str) -> Dict[str, str]:
    """The environment rank ``rank`` of ``job`` runs with, under Open MPI's variables, for ``door``."""
    host, local, local_size = rank_places(job)[rank]
    size = sum(n for _, n in job["hosts"])
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
           "OMPI_MCA_ess_base_jobid": f"doors-{job['index']}-{door}", "HOROVOD_HOSTNAME": host,
           "DISTMEM_FLEET": job["fleet"], "DISTMEM_LAYOUT_DIR": layout_dir, "DISTMEM_LAYOUT_TIMEOUT": "300",
           "DISTMEM_QUIET": "1"}
    vis = job["visible"]
    if vis == "own":
        env["CUDA_VISIBLE_DEVICES"] = str(local)
    elif vis is not None:
        env["CUDA_VISIBLE_DEVICES"] = vis
    env.update(job["env"])
    return env


# -- answers ------------------------------------------------------------------------------------------

def answer_of_plan(plan: Dict[str, Any]) -> Dict[int, Any]:
    """Per rank: (mode, [(uuid, planned bytes, enforced)]) from a plan's JSON form."""
    return {a["rank"]: [a["mode"], [[d["uuid"], d["planned_bytes"], d["enforce"]] for d in a["devices"]]]
            for a in plan["allocations"]}


def error_answer(exc_or_text: Any) -> List[str]:
    if isinstance(exc_or_text, BaseException):
        return ["error", type(exc_or_text).__name__, str(exc_or_text)]
    return ["error", "", str(exc_or_text)]


def python_kwargs(job: Dict[str, Any]) -> Dict[str, Any]:
    kw = dict(job["args"], strategy=job["strategy"])
    kw.update(job["options"])
    return kw


def cli_words(job: Dict[str, Any], layers_path: Optional[str]) -> List[str]:
    """The job's strategy and common options as command-line flags."""
    words = ["--strategy", job["strategy"]]
    a = job["args"]
    for key in ("framework", "memory", "overhead", "reserve", "foreign"):
        if key in a:
            words += [f"--{key}", str(a[key])]
    if "limit" in a:
        words += ["--limit", str(a["limit"])]
    for key, value in job["options"].items():
        flag = "--" + key.replace("_", "-")
        if key == "layers":
            words += [flag, layers_path or ""]
        elif key == "stages":
            words += [flag, ",".join(value)]
        elif isinstance(value, bool):
            words += [flag] if value else []
        else:
            words += [flag, str(value)]
    return words


def job_words(job: Dict[str, Any]) -> List[str]:
    hosts = ",".join(f"{h}:{n}" for h, n in job["hosts"])
    return ["--gpus", job["fleet"], "--hosts", hosts, "--map-by", job["mapping"], "--visible-devices",
            job["visible"] or "all"]


def run_cli(words: List[str], env: Dict[str, str]) -> Tuple[int, str, str]:
    """``distmem WORDS`` in this process with ``env`` as the whole environment's DISTMEM_* part."""
    from distmem import cli

    saved = dict(os.environ)
    for k in list(os.environ):
        if k.startswith(("DISTMEM_", "OMPI_", "HOROVOD_", "CUDA_VISIBLE", "SLURM_", "TORCHELASTIC", "PMI")):
            del os.environ[k]
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(words)
            except SystemExit as exc:  # argparse usage errors
                rc = int(exc.code or 0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return rc, out.getvalue(), err.getvalue()


def cli_error(err: str, command: str) -> str:
    prefix = f"distmem {command}: error: "
    line = next((ln for ln in err.splitlines() if ln.startswith(prefix)), err.strip().splitlines()[-1:] or [""])
    return line[len(prefix):] if isinstance(line, str) and line.startswith(prefix) else (line[0] if line else "")


def doctor_error(problems: List[str]) -> Optional[str]:
    for p in problems:
        if p.startswith("init(strategy="):
            return p.split(": ", 1)[1] if ": " in p else p
    return None


def run_workers(all_jobs: List[Dict[str, Any]], layout_dir: str, timeout: float) -> Dict[Tuple[int, str, int], Any]:
    """Every per-rank door of every job, answered by worker processes that play the ranks."""
    slots = max(sum(n for _, n in j["hosts"]) for j in all_jobs)
    here = os.path.dirname(os.path.abspath(__file__))
    spec = os.path.join(layout_dir, "jobs.json")
    with open(spec, "w", encoding="utf-8") as f:
        json.dump(all_jobs, f)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTMEM_", "OMPI_", "HOROVOD_", "CUDA_VISIBLE", "SLURM_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here])
    # Files, not pipes: a worker blocked on a full pipe the test is not reading yet would stall its
    # host's exchange for every other worker.
    logs = [(open(os.path.join(layout_dir, f"worker{w}.out"), "w+"), open(os.path.join(layout_dir, f"worker{w}.err"), "w+"))
            for w in range(slots)]
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "doors_worker.py"), spec, str(w), layout_dir],
                              env=env, stdout=o, stderr=e, text=True) for w, (o, e) in enumerate(logs)]
    out: Dict[Tuple[int, str, int], Any] = {}
    problems = []
    deadline = time.monotonic() + timeout
    for w, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"worker {w} did not finish within {timeout:.0f} s")
    for w, (p, (o, e)) in enumerate(zip(procs, logs)):
        o.seek(0)
        e.seek(0)
        if p.returncode != 0:
            problems.append(f"worker {w} exited {p.returncode}: {e.read()[-3000:]}")
        for line in o.read().splitlines():
            if line.startswith("DOOR "):
                rec = json.loads(line[5:])
                out[(rec["job"], rec["door"], rec["rank"])] = rec["answer"]
        o.close()
        e.close()
    assert not problems, "\n".join(problems)
    return out
