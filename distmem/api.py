"""The facade: ``init``, ``snapshot``, ``report``, ``check_plan``. It only wires the stages together
(discover -> plan -> apply, observe -> report); nothing below it imports it."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional

from . import session, settings
from .apply import adapter, detect_framework
from .comm import get_comm, resolve_timeout, set_comm
from .console import say, say_back
from .discover import gpus as discover_gpus
from .discover import identity, runtime
from .errors import ConfigError, DistmemError, DoesNotFitError
from .observe.snapshot import Snapshot, take
from .plan import Plan, PlanRequest
from .plan.request import plan_in
from .plan import get as get_strategy
from .plan.foreign import foreign_warnings
from .report.aggregate import Report

__all__ = ["init", "plan_from_env", "snapshot", "report", "current_plan", "reset", "check_plan", "use_strategy",
           "resolve_overhead"]

log = logging.getLogger("distmem")


def resolve_overhead(value: Any, framework: str) -> Any:
    """``overhead`` as the plan takes it: ``"measure"`` probes this machine's per-process overhead with
    PyTorch on its GPU (a short subprocess; every rank of a job takes the largest), ``"auto"`` does
    where that can run and otherwise uses the measured model (distmem.plan.outside: CUDA context,
    cuBLAS/cuDNN workspaces), NCCL's buffers included when the job runs NCCL; anything else as given.
    The one place every door resolves it."""
    if value not in ("measure", "auto"):
        return value
    fw = detect_framework(framework)
    inv = discover_gpus.inventory(quiet=True)
    if not (inv.real and inv.gpus and fw == "torch"):
        return value  # the plan models it (distmem.plan.request), or refuses 'measure' with the remedy
    from .plan.outside import nccl_env, outside_allocator_bytes

    nccl = runtime.nccl_communicators()
    modelled = outside_allocator_bytes("torch", nccl_communicators=nccl, nccl_buffsize=nccl_env(os.environ)["buffsize"])
    from .apply.torch_probe import measure_context_overhead

    topo = identity.detect()
    try:
        measured = measure_context_overhead(topo.local_rank % len(inv.gpus))
    except ConfigError:  # no transport yet to agree over (torchrun/horovodrun before their init)
        if value == "measure":
            raise
        return modelled
    if nccl:  # the probe runs without NCCL: add what its communicators hold
        measured += modelled - outside_allocator_bytes("torch", nccl_communicators=0)
    return measured


def _job_agreement() -> Any:
    """In a launched job of several ranks with a transport up: a function that runs a computation on
    rank 0 (an estimate's measurement, strategy auto's search) and hands every rank its result or its
    error; None otherwise (one process, or no transport yet: the request then plans from the model)."""
    if identity.detect().size <= 1:
        return None
    try:
        comm = get_comm()
    except ConfigError:
        return None
    from .estimate.isolated import CHILD_TIMEOUT_S

    # Rank 0 may measure a model for minutes; the others wait as long as a measurement may take.
    wait = max(resolve_timeout(None), CHILD_TIMEOUT_S + 60.0)

    def agree(compute: Any) -> Any:
        answer = None
        if comm.rank == 0:
            try:
                answer = ("ok", compute())
            except Exception as exc:  # noqa: BLE001 - every rank raises rank 0's error, not a timeout
                answer = ("error", exc)
        kind, value = comm.allgather(answer, wait)[0]
        if kind == "error":
            raise value
        return value

    return agree


def _request(strategy: str, framework: Optional[str], memory: Optional[str], reserve: Any, limit: Any, overhead: Any,
             foreign: Any, fleet: Optional[str], estimate: Optional[str], options: Dict[str, Any],
             from_report: Optional[str] = None, from_margin: Optional[float] = None) -> PlanRequest:
    settings.validate()
    if overhead is None:
        overhead = settings.overhead()
    return PlanRequest(strategy=strategy, options=dict(options), framework=framework,
                       memory=None if memory in (None, "auto") else memory, reserve=reserve, limit=limit,
                       overhead=resolve_overhead(overhead, framework), foreign=foreign, fleet=fleet, estimate=estimate,
                       agree=_job_agreement(), from_report=from_report, from_margin=from_margin)


def _planned(request: PlanRequest) -> Plan:
    ctx, strategy, opts = request.context()
    plan = plan_in(ctx, strategy, opts)
    session.state.topology, session.state.inventory, session.state.layout = ctx.topo, ctx.inventory, ctx.layout
    return plan


def plan_from_env(strategy: str = "data", framework: Optional[str] = None, *, memory: Optional[str] = None,
                  reserve: Any = None, limit: Any = None, overhead: Any = None, foreign: Any = 0,
                  fleet: Optional[str] = None, estimate: Optional[str] = None, from_report: Optional[str] = None,
                  from_margin: Optional[float] = None, **options: Any) -> Plan:
    """The plan :func:`init` would apply, computed the same way (one :class:`~distmem.plan.PlanRequest`:
    the same defaults, ``DISTMEM_*`` settings, fleet and layout), without applying anything.

    The plan follows the layout the job really has: every rank's host and local rank from its
    launcher, its GPUs after ``CUDA_VISIBLE_DEVICES``, and what the other ranks of its host see,
    learnt through a bounded host-local exchange (:mod:`distmem.discover.layout`).
    ``fleet`` (or ``DISTMEM_FLEET``, e.g. ``"4x16GiB"`` or ``"a=2x80GiB;b=2x16GiB"``) declares GPUs
    for a dry run on a machine without them; real GPUs found through NVML take precedence.
    ``from_report``: the last run's report (or run folder), as in :func:`init`.
    """
    return _planned(_request(strategy, framework, memory, reserve, limit, overhead, foreign, fleet, estimate, options,
                             from_report, from_margin))


def plan_for_exec(wrapper: str, strategy: str = "data", **kwargs: Any) -> Plan:
    """The plan :func:`init` will make in the command that the launcher wrapper ``wrapper``
    (``"distmem-exec"``) is about to exec, made in the wrapper: :func:`plan_from_env`'s arguments and
    answer. The wrapper is the rank's own process until the exec (the pid the launcher watches), so
    from now on this process starts no transport - an ``MPI_Init`` here would be the rank's, and the
    command's own would then fail - and meets the other wrappers of its host in a layout exchange of
    their own (:func:`distmem.discover.layout.leave` ends it before the exec): the command's
    ``init()`` meets its peers afresh, never a wrapper's record under its own pid."""
    session.wrapper = wrapper
    return plan_from_env(strategy, **kwargs)


def init(strategy: str = "data", framework: Optional[str] = None, *, memory: str = "auto",
         reserve: Any = None, limit: Any = None, overhead: Any = None, foreign: Any = 0,
         fleet: Optional[str] = None, enforce: str = "framework", verbose: bool = True, estimate: Optional[str] = None,
         from_report: Optional[str] = None, from_margin: Optional[float] = None, fail_fast: Optional[bool] = None, **strategy_options: Any) -> Plan:
    """Plan this job's GPU memory and apply this rank's share to the framework. Returns the Plan.

    Call it first, before the framework touches a GPU (before or after ``hvd.init()``).

    strategy: ``"data"`` (equal split), ``"pipeline"``, ``"model"``, ``"tenants"``, ``"auto"``
    (``model=``, ``global_batch_size=``: the best layout that fits, see :func:`distmem.fit`; the
    training loop reads ``plan.extras["fit"]``: micro-batch, accumulation, stage map), or any
    registered one (``distmem.plan.names()``).
    framework: ``"tensorflow"``, ``"torch"`` or ``"none"``; detected when omitted.
    memory: ``"auto"`` (growth alone on a GPU, a hard limit when shared; ``DISTMEM_MEMORY`` when
    set), ``"growth"`` or ``"limit"``.
    reserve: kept free on every GPU (bytes, ``"256MiB"`` or ``"5%"``; default 256 MiB).
    limit: an explicit per-rank limit for strategy="data" (bytes, ``"6GiB"``, ``"45%"`` or a fraction
    of the GPU; default ``DISTMEM_LIMIT``).
    overhead: per-process memory outside the framework allocator (default ``DISTMEM_OVERHEAD``, else
    768 MiB, see DESIGN); ``"measure"`` probes it with PyTorch on this GPU, ``"auto"`` measures where
    that is possible and otherwise uses the measured model (distmem.plan.outside), NCCL's buffers
    included when the job runs NCCL.
    foreign: memory other jobs hold on each GPU that the plan must leave alone.
    fleet: ``"4x16GiB"`` to plan against declared GPUs where none are present (dry run).
    estimate: how a ``model=`` is estimated: ``"auto"`` (default: measured with a few real training
    steps where the hardware is at hand - once per job, on rank 0, handed to every rank over the
    job's transport - else the model alone, warned), ``"measure"`` or ``"model"``.
    enforce: ``"framework"`` (the framework's own limit) or ``"native"`` (also require distmem's
    LD_PRELOAD cap, launched through ``distmem-exec``).
    from_report: the last run's report (``runs/last/report.json``) or run folder: each rank's (or
    pipeline stage's) limit is its observed peak - or, where it ran out, what it needed - plus
    ``from_margin`` (default 10%, :data:`distmem.defaults.FROM_REPORT_MARGIN`); a rank with no
    figure keeps the estimate's. ``plan.extras["from_report"]`` lists what changed.
    An out-of-memory error on this rank writes its record to ``RUN_DIR/oom/`` (``distmem postmortem
    RUN_DIR``) unless ``DISTMEM_POSTMORTEM=0``.
    fail_fast: when another rank dies (SIGKILL, the OOM killer, an exception), this rank prints one
    line naming it and the cause, aborts the job's communicators and exits within seconds instead of
    waiting for NCCL's / Gloo's / MPI's timeout (default ``DISTMEM_FAIL_FAST``, on; see
    :mod:`distmem.comm.heartbeat`).
    The strategy's own options (``stages=``, ``tenants=``, ``headroom=``...) follow; an unknown one
    is an error naming what the strategy takes. ``plan_from_env`` with the same arguments returns
    the same plan without applying it.
    """
    if enforce not in ("framework", "native"):
        raise ConfigError(f"enforce={enforce!r} is not 'framework' or 'native'")
    if fail_fast not in (None, True, False):
        raise ConfigError(f"fail_fast={fail_fast!r} is not True, False or None (None: DISTMEM_FAIL_FAST, default on)")
    # The options are checked first: a wrong one is named, whatever this process did before.
    PlanRequest(strategy=strategy, options=dict(strategy_options), framework=framework, limit=limit).strategy_options(
        get_strategy(strategy))
    asked = dict(strategy=strategy, framework=framework, memory=memory, reserve=reserve, limit=limit,
                 overhead=overhead, foreign=foreign, fleet=fleet, enforce=enforce, estimate=estimate,
                 **({"from_report": from_report, "from_margin": from_margin} if from_report else {}), **strategy_options)
    again = _same_call_again(asked)
    if again is not None:
        return again
    fw = detect_framework(framework)
    fw_adapter = adapter(fw)
    # Read before planning (the estimator may build a model): what the framework started on its own.
    live = None if session.was_reset else fw_adapter.started()
    # (read whatever a reset said: a torch that started CUDA cannot take the setting however the plan is applied)
    fixed_allocator = _allocator_fixed(fw, strategy, strategy_options, fw_adapter.started())
    if fixed_allocator:
        strategy_options = dict(strategy_options, expandable_segments=False)
    plan = _planned(_request(strategy, fw, memory, reserve, limit, overhead, foreign, fleet, estimate, strategy_options,
                             from_report, from_margin))
    if fixed_allocator:
        plan.warnings.append("CUDA started before init() and this torch cannot change its allocator settings at run "
                             "time, so expandable segments cannot be set for this job: the fit left each limit room "
                             "for the largest single allocation instead")
    inv = session.state.inventory
    assert inv is not None  # set by _planned
    plan.warnings.extend(foreign_warnings(plan, inv, os.getpid()))
    if enforce == "native":
        from .apply import native

        # Before the framework starts CUDA: a missing cap must fail while nothing is allocated yet.
        native.require_active(plan.mine.limit_bytes)
    applying = inv.real or bool(plan.extras.get("cpu_logical_devices"))
    if not applying and live is not None:
        # A dry run applies nothing, but a GPU node would refuse this order: the same error here.
        late = fw_adapter.too_late(plan, live)
        if late is not None:
            raise late
    prepared = fw_adapter.prepare(plan)
    # what the framework reads when it starts, set for the job in a dry run too (torch: the allocator
    # settings the plan needs); said with the rest
    applied: Dict[str, Any] = {"framework": fw, "applied": list(prepared) if fw == "torch" else [],
                               "dry_run": not inv.real}
    if applying:
        applied = fw_adapter.apply(plan)
        applied["dry_run"] = not inv.real
    applied["prepared"] = prepared
    plan.warnings.extend(applied.get("warnings") or [])
    session.state.plan, session.state.framework, session.state.applied = plan, fw, applied
    session.state.options = asked
    if settings.postmortem():  # every OOM of this rank writes its record (distmem postmortem RUN_DIR)
        from .guard.oom import install

        install()
    if verbose:
        _say_applied(plan, applied, fw, inv.real, bool(from_report))
    if settings.fail_fast() if fail_fast is None else fail_fast:
        _start_heartbeat(verbose)
    return plan


def _allocator_fixed(fw: str, strategy: str, options: Dict[str, Any], live: Any) -> bool:
    """Whether a torch job planned by ``strategy="auto"`` can no longer be given expandable segments
    (CUDA started before ``init()`` on a torch that cannot change allocator settings at run time),
    so its fit must leave room for the largest block instead."""
    if fw != "torch" or strategy != "auto" or live is None or "expandable_segments" in options:
        return False
    from .apply import torch as torch_adapter

    return not torch_adapter.allocator_settable()


def _same_call_again(asked: Dict[str, Any]) -> Optional[Plan]:
    """The applied plan when ``init()`` is called again with the same options; an error naming what
    changed when they differ; None on the first call."""
    earlier = session.state.options
    if session.state.plan is not None and earlier is not None:
        changed = {k: (earlier.get(k), asked.get(k)) for k in sorted(set(earlier) | set(asked))
                   if repr(earlier.get(k)) != repr(asked.get(k))}
        if not changed:
            return session.state.plan  # the same call again: the plan stands
        raise ConfigError(
            "distmem.init() was already called in this process with other options: "
            + "; ".join(f"{k}={old!r} then {new!r}" for k, (old, new) in changed.items())
            + ". A process applies one plan (the framework keeps the first configuration); call init() once, "
            "first, with the options you want (distmem.reset() exists for tests only)")
    return None


def _say_applied(plan: Plan, applied: Dict[str, Any], fw: str, real: bool, from_report: bool) -> None:
    """init()'s lines: what this rank was planned and given, what changed from the last run, warnings."""
    mine = plan.mine
    topo = session.state.topology
    if topo is not None and topo.source == "single" and identity.launcher_of() == "none":
        say("[distmem] no launcher detected: 1 rank (start with horovodrun, mpirun, srun or torchrun for "
            "more)")
    done = applied.get("applied") or []
    where = f"{fw}: {'; '.join(done)}" if done else ("dry run, nothing applied" if not real
                                                      else f"{fw}: nothing to apply")
    say(f"[distmem rank {mine.rank}] {mine.describe()} ({where})")
    say_back(f"[distmem rank {mine.rank}]")  # sizes given in decimal units, said back once
    if from_report:
        from .plan.from_report import describe_changes

        lines = describe_changes(plan)
        own = [ln.strip() for ln in lines[1:] if ln.strip().startswith((f"rank {mine.rank}:", f"rank {mine.rank} "))]
        for line in lines[:1] + own:  # the summary, then this rank's own change
            say(f"[distmem rank {mine.rank}] {line.strip()}")
    for w in plan.warnings:
        say(f"[distmem rank {mine.rank}] WARNING: {w}")


def _start_heartbeat(verbose: bool = True) -> None:
    """Fail fast: the heartbeat over the job's transport when one is up, else torchrun's store."""
    from .comm import heartbeat

    topo = session.state.topology or identity.detect()
    if topo.size <= 1 or heartbeat.current() is not None:
        return
    try:
        comm: Any = get_comm()
    except ConfigError:
        comm = None  # no transport yet: torchrun's store, or off (the heartbeat says so)
    if comm is not None and comm.size <= 1:
        comm = None
    hb = heartbeat.start(topo.rank, topo.size, topo.host, comm, verbose=verbose, local_size=topo.local_size)
    if hb is not None and settings.postmortem():
        stop = hb.on_death

        def record_then_stop(death: Any) -> None:
            # what this rank held when another failed: the post-mortem compares the failed rank with it
            from .guard.oom import record_stopped

            record_stopped(death.line())
            stop(death)

        hb.on_death = record_then_stop


def current_plan() -> Optional[Plan]:
    """The plan ``init()`` applied in this process, or None before ``init()``."""
    return session.current_plan()


def reset() -> None:
    """Forget the applied plan and cached transport (tests; a process cannot un-apply a framework, so
    after a reset a dry-run ``init()`` no longer treats a started framework as too late: tests of that
    check run in a fresh process)."""
    from .comm import heartbeat

    heartbeat.stop()
    session.clear()
    set_comm(None)
    from .guard.oom import uninstall

    uninstall()


def snapshot(step: Optional[int] = None) -> Snapshot:
    """This rank's memory now: allocator, NVML per-process and RSS figures beside its plan."""
    return take(step)


def report(path: Optional[str] = None, timeout: Optional[float] = None, *, detail: str = "full",
           step: Optional[int] = None, print_table: bool = True, snapshot: Optional[Snapshot] = None) -> Optional[Report]:
    """Collective: every rank calls it; rank 0 gets the job's Report, prints the table and writes JSON
    to ``path`` (or ``DISTMEM_REPORT``); the other ranks get None.

    ``timeout`` (seconds, default ``DISTMEM_TIMEOUT`` or 60) bounds the wait for other ranks; ranks
    that do not arrive are listed as missing. ``detail="summary"`` reduces a fixed-size vector with
    all-reduce instead of gathering every row, for jobs of thousands of ranks. ``snapshot``: report
    this rank's snapshot taken earlier (:func:`snapshot`, e.g. at a step's peak) instead of one
    taken now; reporting one snapshot in both details gives figures that agree to the byte.
    """
    from .report.collect import collect  # the one gather path (it validates detail), shared with periodic reports
    from .report.sinks import print_report, write_json

    path = path or settings.report_path()
    if path and os.path.isdir(path):
        raise ConfigError(f"report path {path!r} is a folder; give a file name such as "
                          f"{os.path.join(path, 'report.json')!r} (checked on every rank, before the collective)")
    rep = collect(step=step, timeout=timeout, detail=detail, snapshot=snapshot)
    if rep is None:
        return None
    if not rep.timeline and session.state.extra.get("timeline"):
        # The job's periodic reports (ReportEvery, the Keras callback) collected a timeline: the final
        # report carries it, so `distmem report FILE --plot` draws it.
        rep.timeline = list(session.state.extra["timeline"])
    if settings.postmortem():
        from .report.postmortem import attach_to_report

        attach_to_report(rep, settings.run_dir())
    if print_table:
        print_report(rep)
    if path:
        try:
            write_json(rep, path)
        except OSError as exc:
            raise ConfigError(f"rank 0 could not write the report to {path!r}: {exc.strerror or exc}; give a "
                              "writable file path (report(path=...) or DISTMEM_REPORT)") from None
    return rep


def check_plan(timeout: Optional[float] = None) -> List[str]:
    """Collective: gather every rank's plan fingerprint (the job-wide part) and its host's (the
    allocations of the ranks it shares a host with); raise if ranks differ - across the job, or
    between ranks of one host - listing each rank's. Returns the job-wide fingerprints by rank."""
    plan = session.current_plan()
    if plan is None:
        raise DistmemError("check_plan() needs distmem.init() first")
    mine = (session.fingerprint(plan), plan.mine.host, plan.host_fingerprint())
    rows = get_comm().allgather(mine, resolve_timeout(timeout))
    prints = [r[0] for r in rows]
    if len(set(prints)) > 1:
        raise DoesNotFitError("ranks computed different plans: " + ", ".join(f"rank {r}: {p}" for r, p in enumerate(prints))
                              + "; pass identical options (and DISTMEM_FLEET) on every rank")
    by_host: Dict[str, Dict[str, List[int]]] = {}
    for r, (_, host, hfp) in enumerate(rows):
        by_host.setdefault(host, {}).setdefault(hfp, []).append(r)
    split = {h: fps for h, fps in by_host.items() if len(fps) > 1}
    if split:
        raise DoesNotFitError(
            "ranks of one host planned its GPUs differently: " + "; ".join(
                f"{h}: " + ", ".join(f"ranks {rs} -> {fp}" for fp, rs in fps.items()) for h, fps in split.items())
            + "; every rank of a host must see the same launcher variables and the same DISTMEM_* settings")
    return prints


def use_strategy(strategy: Any, *, prefer_mpi: bool = True) -> Any:
    """Make :func:`report` gather through a ``tf.distribute`` strategy from now on (call it once, after
    ``init()`` and after creating the strategy); returns the transport in use. Under an MPI launcher
    with mpi4py installed, MPI is used instead (``prefer_mpi=False`` forces the strategy): its gather
    names exactly the ranks that did not arrive."""
    from .comm.tf_strategy import use_strategy as through

    return through(strategy, prefer_mpi=prefer_mpi)
