"""One job, one answer: every door plans the same bytes, mode and GPU for every rank, or raises
the same error (DESIGN.md's contract; the generator and the doors are in tests/doors.py).

Hundreds of seeded jobs - strategy x framework x fleet (uniform, mixed, per host, per host with a
default, hosts with different GPU counts) x launcher layout (uneven hosts, block and cyclic
mapping, one GPU per rank, a CUDA_VISIBLE_DEVICES every rank inherits, one that names no GPU) x
DISTMEM_* settings - are asked at every door:

* ``distmem plan`` and ``distmem doctor`` for the whole job (the dry runs a user checks first);
* ``distmem.init()``, ``distmem.plan_from_env()`` and ``distmem doctor`` on every rank, played by
  worker processes under Open MPI's variables, each host's ranks meeting in the real exchange;
* ``distmem plan --emit k8s`` (the manifest's per-rank limits, and a refusal where one template
  cannot be right for every rank) and ``distmem fit`` for strategy auto (the chosen layout's
  limits).

``DISTMEM_DOORS_JOBS`` / ``DISTMEM_DOORS_SEED`` change the size and the seed.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional

import doors

SEED = int(os.environ.get("DISTMEM_DOORS_SEED", "24"))
COUNT = int(os.environ.get("DISTMEM_DOORS_JOBS", "300"))
MiB = 1024**2


def _norm(message: str) -> str:
    """An error's words without the rank, host and GPU it was found on (ranks that fail alike)."""
    return re.sub(r"\d+(\.\d+)?", "N", message)


def _kind(message: str) -> str:
    """What an error says, before the figures of the rank that found it (``... but its GPU offers``)."""
    return _norm(re.split(r" but |: ", message, maxsplit=1)[0])


def _whole(job: Dict[str, Any], workdir: str) -> Dict[str, Any]:
    layers = None
    if "layers" in job["options"]:
        layers = os.path.join(workdir, f"layers-{job['index']}.json")
        with open(layers, "w", encoding="utf-8") as f:
            json.dump(job["options"]["layers"], f)
    words = doors.job_words(job) + doors.cli_words(job, layers)
    env = dict(job["env"], DISTMEM_QUIET="1")
    out: Dict[str, Any] = {}
    rc, text, err = doors.run_cli(["plan", "--json"] + words, env)
    plan = json.loads(text) if rc == 0 else None
    out["plan"] = doors.answer_of_plan(plan) if plan else doors.error_answer(doors.cli_error(err, "plan"))
    rc, text, err = doors.run_cli(["doctor", "--json", "--no-horovod-probe"] + words, env)
    d = json.loads(text) if text.strip().startswith("{") else {"problems": [err]}
    problem = doors.doctor_error(d.get("problems", []))
    out["doctor"] = doors.error_answer(problem) if problem is not None else \
        doors.answer_of_plan(d["facts"]["plan"]) if "plan" in d.get("facts", {}) else doors.error_answer(err)
    if plan and any(a["devices"] for a in plan["allocations"]):
        rc, text, err = doors.run_cli(["plan", "--emit", "k8s", "--k8s-sharing", "hami"] + words, env)
        out["k8s"] = _k8s(rc, text, err, plan)
    if job["strategy"] == "auto" and job["visible"] is None:  # fit takes a fleet, not what each rank sees
        out["fit"] = _fit(job, layers, env)
    return out


def _k8s(rc: int, text: str, err: str, plan: Dict[str, Any]) -> Optional[str]:
    """A disagreement of the manifest with the plan, or None."""
    limits = [sum(d["planned_bytes"] for d in a["devices"]) // MiB for a in plan["allocations"] if a["devices"]]
    if rc != 0:
        if len(set(limits)) > 1 or "different numbers" in err:
            return None  # one template cannot hold ranks planned differently: refused, rightly
        return f"k8s refused a plan whose ranks agree: {err.strip()[-300:]}"
    m = re.search(r"distmem\.io/plan: '(\{.*?\})'", text) or re.search(r'"distmem\.io/plan": "(\{.*?\})"', text)
    if not m:
        return "k8s manifest has no plan annotation"
    note = json.loads(m.group(1).replace('\\"', '"'))
    planned = [[d["planned_bytes"] // MiB for d in a["devices"]] or None for a in plan["allocations"]]
    if note["rank_limits_mib"] != planned:
        return f"k8s annotation {note['rank_limits_mib']} != plan {planned}"
    gpumem = re.search(r"nvidia\.com/gpumem: (\d+)", text)
    per_gpu: Dict[Any, int] = {}
    for a in plan["allocations"]:
        for uuid in {d["uuid"] for d in a["devices"]}:
            held = sum(d["planned_bytes"] for d in a["devices"] if d["uuid"] == uuid) + plan["overhead_bytes"]
            per_gpu[(a["rank"], uuid)] = held
    want = max(per_gpu.values()) // MiB
    if gpumem and int(gpumem.group(1)) != want:
        return f"k8s gpumem {gpumem.group(1)} MiB != the plan's {want} MiB"
    return None


def _fit(job: Dict[str, Any], layers: Optional[str], env: Dict[str, str]) -> Any:
    counts = [n for _, n in job["hosts"]]
    a = job["args"]
    words = ["fit", "--json", "--top", "1", "--layers", layers or "", "--layers-batch-size",
             str(job["options"].get("layers_batch_size", 1)), "--global-batch-size",
             str(job["options"]["global_batch_size"]), "--gpus", job["fleet"], "--hosts", str(len(counts)),
             "--ranks-per-host", str(counts[0])]
    for key in ("framework", "reserve", "overhead", "foreign", "memory"):
        if key in a:
            words += [f"--{key}", str(a[key])]
    rc, text, err = doors.run_cli(words, env)
    if rc not in (0, 3):
        return doors.error_answer(doors.cli_error(err, "fit"))
    res = json.loads(text)
    chosen = res.get("chosen")
    if not chosen:
        return ["error", "no layout fits", ""]
    p = chosen["layout"]["pipeline"]
    size = sum(counts)
    return {r: chosen["stages"][r % p]["planned_bytes"] for r in range(size)}


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, list) and x and x[0] == "error" and isinstance(y, list) and y and y[0] == "error":
        return x[2] == y[2]
    return x == y


def _compare(job: Dict[str, Any], whole: Dict[str, Any], ranks: Dict[Any, Any]) -> List[str]:
    size = sum(n for _, n in job["hosts"])
    bad: List[str] = []
    w_plan, w_doc = whole["plan"], whole["doctor"]
    if not _same(w_plan, w_doc):
        bad.append(f"distmem plan {str(w_plan)[:300]} != distmem doctor {str(w_doc)[:300]}")
    live = {door: {r: ranks.get((job["index"], door, r)) for r in range(size)}
            for door in ("init", "plan_from_env", "doctor")}
    for r in range(size):
        first = live["init"][r]
        for door in ("plan_from_env", "doctor"):
            if not _same(first, live[door][r]):
                bad.append(f"rank {r}: init {str(first)[:300]} != {door} {str(live[door][r])[:300]}")
    errors = {r: a for r, a in live["init"].items() if isinstance(a, list) and a and a[0] == "error"}
    if isinstance(w_plan, dict):
        for r in range(size):
            if w_plan.get(r) != live["init"][r]:
                bad.append(f"rank {r}: distmem plan {w_plan.get(r)} != init {str(live['init'][r])[:300]}")
    else:
        message = w_plan[2]
        if not any(a[2] == message for a in errors.values()):
            bad.append(f"distmem plan raises {message[:300]!r} but no rank's init does (init: "
                       f"{ {r: (a[2][:120] if r in errors else 'planned') for r, a in live['init'].items()} })")
        stray = {r: a[2] for r, a in errors.items() if _kind(a[2]) != _kind(message)}
        if stray:
            bad.append(f"distmem plan raises {message[:200]!r}; ranks raise others: { {r: m[:200] for r, m in stray.items()} }")
    if whole.get("k8s"):
        bad.append(whole["k8s"])
    if "fit" in whole:
        fit = whole["fit"]
        if isinstance(w_plan, dict):
            got = {r: w_plan[r][1][0][1] if w_plan[r][1] else None for r in range(size)}
            if fit != got:
                bad.append(f"distmem fit chooses limits {fit} but strategy auto plans {got}")
        elif isinstance(fit, dict):
            bad.append(f"distmem fit finds {fit} but strategy auto raises {w_plan[2][:200]!r}")
    return bad


def test_every_door_plans_the_same_for_every_rank(tmp_path):
    all_jobs = doors.jobs(SEED, COUNT)
    ranks = doors.run_workers(all_jobs, str(tmp_path), timeout=1500)
    failures: List[str] = []
    kinds: Dict[str, int] = {}
    for job in all_jobs:
        whole = _whole(job, str(tmp_path))
        kind = "error" if isinstance(whole["plan"], list) else "planned"
        kinds[kind] = kinds.get(kind, 0) + 1
        for problem in _compare(job, whole, ranks):
            failures.append(f"job {job['index']} ({job['strategy']}, fleet {job['fleet']!r}, hosts {job['hosts']}, "
                            f"{job['mapping']}, visible {job['visible']}, env {job['env']}, args {job['args']}, "
                            f"options { {k: v for k, v in job['options'].items() if k != 'layers'} }): {problem}")
    # The generator must reach both outcomes, or the property says little.
    assert kinds.get("planned", 0) > COUNT // 3 and kinds.get("error", 0) > COUNT // 20, kinds
    assert not failures, f"{len(failures)} disagreements in {COUNT} jobs ({kinds}):\n" + "\n".join(failures[:40])
