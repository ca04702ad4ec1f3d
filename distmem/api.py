"""The public entry points: init, snapshot, report. The only module that wires the pieces together."""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Dict, List, Optional

from . import comm as _comm
from . import devices as _devices
from . import topology as _topology
from .errors import ConfigError, DistmemError, DoesNotFitError
from .frameworks import adapter, detect_framework
from .plan import Plan, make_plan
from .render import write_json
from .stats import Report, Snapshot
from .units import format_bytes

__all__ = ["init", "plan_from_env", "snapshot", "report", "current_plan", "reset", "check_plan"]

log = logging.getLogger("distmem")

_state: Dict[str, Any] = {"plan": None, "framework": None, "applied": None, "topology": None, "inventory": None}


def _say(msg: str) -> None:
    """Rank-prefixed line on stderr: visible in horovodrun/mpirun logs without logging setup."""
    if os.environ.get("DISTMEM_QUIET") != "1":
        print(msg, file=sys.stderr, flush=True)


def _inventory(fleet: Optional[str]) -> _devices.Inventory:
    fleet = fleet or os.environ.get("DISTMEM_FLEET")
    inv = _devices.inventory(quiet=True)
    if inv.gpus:
        return inv
    if fleet:
        return _devices.fleet_inventory(fleet)
    return inv


def plan_from_env(strategy: str = "data", *, fleet: Optional[str] = None, **options: Any) -> Plan:
    """Compute this job's plan from the launcher environment and NVML, without applying anything.

    ``fleet`` (or ``DISTMEM_FLEET``, e.g. ``"4x16GiB"``) declares GPUs for a dry run on a machine
    without them; real GPUs found through NVML take precedence.
    """
    topo = _topology.detect()
    inv = _inventory(fleet)
    plan = make_plan(strategy, topo, inv, **options)
    _state.update(topology=topo, inventory=inv)
    return plan


def _measured_overhead(fw: str, how: str) -> Any:
    """overhead="measure": this machine's per-process overhead; "auto": measured on a GPU with torch,
    else the default."""
    inv = _devices.inventory(quiet=True)
    if not (inv.real and inv.gpus and fw == "torch"):
        if how == "measure":
            raise ConfigError("overhead='measure' needs a GPU seen by NVML and framework='torch' (it runs a short "
                              "PyTorch probe); pass overhead='768MiB' or your own figure")
        return None
    from .frameworks.torch import measure_context_overhead

    topo = _topology.detect()
    try:
        return measure_context_overhead(topo.local_rank % len(inv.gpus))
    except ConfigError:  # no transport yet to agree over (torchrun/horovodrun before their init)
        if how == "measure":
            raise
        return None


def _check_foreign(plan: Plan, inv: _devices.Inventory) -> None:
    """Warn (never fail) about memory used on our GPUs by processes that are not ours."""
    if not inv.real:
        return
    mine = plan.mine
    for slot in mine.devices:
        gpu = next((g for g in inv.gpus if g.index == slot.index), None)
        if gpu is None:
            continue
        # Neighbour ranks of this job that started first hold about one overhead each: not foreign.
        job_share = (slot.shared_by - 1) * plan.overhead_bytes
        foreign = [p for p in gpu.processes if p.pid != os.getpid()]
        if sum(p.used_bytes or 0 for p in foreign) <= job_share:
            continue
        if foreign and mine.local_rank == min(a.local_rank for a in plan.allocations
                                              if a.node == mine.node and any(d.index == slot.index for d in a.devices)):
            used = sum(p.used_bytes or 0 for p in foreign)
            msg = (f"GPU {slot.index} already holds {format_bytes(used)} in {len(foreign)} other process(es) "
                   f"(pid {', '.join(str(p.pid) for p in foreign[:5])}); the plan assumed "
                   f"{format_bytes(plan.options.get('foreign_bytes', 0))} foreign use")
            free_needed = slot.planned_bytes * slot.shared_by
            if gpu.free_bytes and free_needed > gpu.free_bytes + used:
                msg += f"; only {format_bytes(gpu.free_bytes)} is free - pass foreign='{format_bytes(used)}'"
            plan.warnings.append(msg)


def init(strategy: str = "data", framework: Optional[str] = None, *, memory: str = "auto",
         reserve: Any = "256MiB", limit: Any = None, overhead: Any = None, foreign: Any = 0,
         fleet: Optional[str] = None, enforce: str = "framework", verbose: bool = True, **strategy_options: Any) -> Plan:
    """Plan this job's GPU memory and apply this rank's share to the framework. Returns the Plan.

    Call it first, before the framework touches a GPU (before or after ``hvd.init()``).

    strategy: ``"data"`` (equal split), ``"pipeline"``, ``"model"`` or ``"tenants"``.
    framework: ``"tensorflow"``, ``"torch"`` or ``"none"``; detected when omitted.
    memory: ``"auto"`` (growth alone on a GPU, a hard limit when shared), ``"growth"`` or ``"limit"``.
    reserve: kept free on every GPU (bytes, ``"256MiB"`` or ``"5%"``).
    limit: an explicit per-rank limit (bytes, ``"6GiB"``, ``"45%"`` or a fraction of the GPU).
    overhead: per-process memory outside the framework allocator (default 768 MiB, see DESIGN);
    ``"measure"`` probes it with PyTorch on this GPU, ``"auto"`` measures where that is possible.
    foreign: memory other jobs hold on each GPU that the plan must leave alone.
    fleet: ``"4x16GiB"`` to plan against declared GPUs where none are present (dry run).
    enforce: ``"framework"`` (the framework's own limit) or ``"native"`` (also require distmem's
    LD_PRELOAD cap, launched through ``distmem-exec``).
    """
    if enforce not in ("framework", "native"):
        raise ConfigError(f"enforce={enforce!r} is not 'framework' or 'native'")
    # Per-rank settings from the environment (Kubernetes pods, launch wrappers); arguments win.
    if memory == "auto":
        memory = os.environ.get("DISTMEM_MEMORY") or memory
    if overhead is None:
        overhead = os.environ.get("DISTMEM_OVERHEAD") or None
    if limit is None and strategy == "data":
        limit = os.environ.get("DISTMEM_LIMIT") or None
    fw = detect_framework(framework)
    options = dict(memory=memory, reserve=reserve, limit=limit, overhead=overhead, foreign=foreign)
    if strategy != "data":
        options.pop("limit")
        if limit is not None:
            raise ConfigError(f"limit= applies to strategy='data'; strategy={strategy!r} derives limits from "
                              "its own inputs (stages, layers or tenants)")
    options.update(strategy_options)
    if strategy in ("pipeline", "model") and "headroom" not in options:
        # Limits come from allocator peaks; the allocator's own cache sits on top of them
        # (see distmem.estimate.table: torch reserved ran up to 52% above its allocated peak).
        options["headroom"] = {"torch": 0.52}.get(fw, 0.10)
    if strategy == "model" or strategy == "tenants":
        options.setdefault("framework", fw)
    if options.get("overhead") in ("measure", "auto"):
        options["overhead"] = _measured_overhead(fw, options["overhead"])
    plan = plan_from_env(strategy, fleet=fleet, **options)
    inv = _state["inventory"]
    _check_foreign(plan, inv)
    if enforce == "native":
        from . import native

        # Before the framework starts CUDA: a missing cap must fail while nothing is allocated yet.
        native.require_active(plan.mine.limit_bytes)
    applied: Dict[str, Any] = {"framework": fw, "applied": [], "dry_run": not inv.real}
    if inv.real or plan.extras.get("cpu_logical_devices"):
        applied = adapter(fw).apply(plan)
        applied["dry_run"] = not inv.real
    _state.update(plan=plan, framework=fw, applied=applied)
    if verbose:
        mine = plan.mine
        done = applied.get("applied") or []
        where = f"{fw}: {'; '.join(done)}" if done else ("dry run, nothing applied" if not inv.real
                                                          else f"{fw}: nothing to apply")
        _say(f"[distmem rank {mine.rank}] {mine.describe()} ({where})")
        for w in plan.warnings:
            _say(f"[distmem rank {mine.rank}] WARNING: {w}")
    return plan


def _fingerprint(plan: Plan) -> str:
    """The applied plan's fingerprint, hashed once: a plan of many ranks makes a large JSON, and
    every periodic snapshot carries it."""
    if _state.get("fingerprint_of") is not plan:
        _state.update(fingerprint=plan.fingerprint(), fingerprint_of=plan)
    return _state["fingerprint"]


def current_plan() -> Optional[Plan]:
    """The plan ``init()`` applied in this process, or None before ``init()``."""
    return _state["plan"]


def reset() -> None:
    """Forget the applied plan and cached transport (tests; a process cannot un-apply a framework)."""
    _state.update(plan=None, framework=None, applied=None, topology=None, inventory=None, fingerprint_of=None)
    _comm.set_comm(None)


def _rss() -> Optional[int]:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - psutil missing: fall back to /proc
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return None


def snapshot(step: Optional[int] = None) -> Snapshot:
    """This rank's memory now: allocator, NVML per-process and RSS figures beside its plan."""
    plan: Optional[Plan] = _state["plan"]
    if plan is None:
        raise DistmemError("distmem.snapshot()/report() need a plan: call distmem.init() first")
    mine = plan.mine
    fw = _state["framework"] or "none"
    st = adapter(fw).stats(plan)
    topo = _state["topology"] or _topology.detect()
    pid = os.getpid()
    nvml: Dict[int, Optional[int]] = {}
    gpu_pids: Dict[int, List[int]] = {}
    uuids: Dict[int, str] = {}
    procs: Dict[int, Dict[int, Optional[int]]] = {}
    inv = _state["inventory"]
    if inv is not None and inv.real:
        live = _devices.inventory(quiet=True)
        for g in live.gpus:
            if any(p.pid == pid for p in g.processes):
                nvml[g.index] = next(p.used_bytes for p in g.processes if p.pid == pid)
                uuids[g.index] = g.uuid
            if any(d.index == g.index for d in mine.devices):
                gpu_pids[g.index] = [p.pid for p in g.processes]
                uuids[g.index] = g.uuid
                procs[g.index] = {p.pid: p.used_bytes for p in g.processes}
    native_status = None
    if os.environ.get("DISTMEM_CAP_BYTES"):
        try:
            from . import native

            native_status = native.status()
        except Exception as exc:  # noqa: BLE001 - the report must not fail on the optional cap
            native_status = {"error": str(exc)}
    return Snapshot(rank=mine.rank, size=plan.world_size, local_rank=topo.local_rank, host=topo.node, pid=pid,
                    framework=fw, strategy=plan.strategy, devices=[d.index for d in mine.devices],
                    allocation=mine.to_dict(),
                    limit_bytes=mine.limit_bytes if mine.limit_bytes is not None else mine.breakdown.get("planned_bytes"),
                    enforced=any(d.enforce for d in mine.devices), current_bytes=st.get("current_bytes"),
                    peak_bytes=st.get("peak_bytes"), reserved_bytes=st.get("reserved_bytes"), nvml_bytes=nvml,
                    rss_bytes=_rss(), gpu_pids=gpu_pids, gpu_uuids=uuids, gpu_process_bytes=procs, stage=mine.stage, step=step,
                    plan_fingerprint=_fingerprint(plan), plan_source=plan.source, overhead_bytes=plan.overhead_bytes, native=native_status,
                    extra={"framework_devices": st.get("devices", [])})


def report(path: Optional[str] = None, timeout: Optional[float] = None, *, detail: str = "full",
           step: Optional[int] = None, print_table: bool = True) -> Optional[Report]:
    """Collective: every rank calls it; rank 0 gets the job's Report, prints the table and writes JSON
    to ``path`` (or ``DISTMEM_REPORT``); the other ranks get None.

    ``timeout`` (seconds, default ``DISTMEM_TIMEOUT`` or 60) bounds the wait for other ranks; ranks
    that do not arrive are listed as missing. ``detail="summary"`` reduces a fixed-size vector with
    all-reduce instead of gathering every row, for jobs of thousands of ranks.
    """
    from .timeline import collect  # the one gather path (it validates detail), shared with periodic reports

    rep = collect(step=step, timeout=timeout, detail=detail)
    if rep is None:
        return None
    if print_table:
        from .render import print_report

        print_report(rep)
    path = path or os.environ.get("DISTMEM_REPORT")
    if path:
        write_json(rep, path)
    return rep


def check_plan(timeout: Optional[float] = None) -> List[str]:
    """Collective: gather every rank's plan fingerprint; raise if they differ, listing each rank's."""
    plan = _state["plan"]
    if plan is None:
        raise DistmemError("check_plan() needs distmem.init() first")
    c = _comm.get_comm()
    prints = c.allgather(_fingerprint(plan), _comm.DEFAULT_TIMEOUT if timeout is None else timeout)
    if len(set(prints)) > 1:
        raise DoesNotFitError("ranks computed different plans: " + ", ".join(f"rank {r}: {p}" for r, p in enumerate(prints))
                              + "; pass identical options (and DISTMEM_FLEET) on every rank")
    return prints
