"""One rank of a fault-injection launch (bench/comm/faults.py, tests/faults): the distmem calls a training
job makes, in order, with one rank (FAULT_RANK) killing or stopping itself at a chosen point.

Phases, each a sequence of collective distmem calls every rank makes:
  init      distmem.init(fleet=...)                                   (local: no collective)
  report    distmem.report(path=$FAULT_DIR/report.json)
  guard     3 steps of distmem.guard.step (its flag all-reduce; NumPy gradients, no framework)
  periodic  3 gathers of distmem.ReportEvery(1, path=$FAULT_DIR/periodic.json)

Injection: the victim counts Python call events (sys.setprofile) from the start of FAULT_PHASE and
sends itself FAULT_SIGNAL (KILL or STOP) at event FAULT_POINT, or at the end of the phase if the phase
made fewer calls. The point is a count, not a time, so a seed reproduces it on a loaded machine.
FAULT_SIGNAL=NONE counts the events of every phase instead (calibration) and injects nothing.

Every rank writes $FAULT_DIR/progress-<rank>.json (atomically) as it enters each call, and
$FAULT_DIR/result-<rank>.json at the end: every call with its duration and outcome. A survivor
stops at its first call that does not complete cleanly (a report with missing ranks, or an
exception); a thawed victim (SIGCONT from the harness) goes on the same way.

FAULT_MODE=bare runs the transport's own all-gather instead of distmem (the baseline).

Transport (FAULT_TRANSPORT): mpi (mpirun, mpi4py), horovod (hvd.init(), Gloo or MPI controller),
torch (torch.distributed Gloo under torchrun), tf (MultiWorkerMirroredStrategy under distmem
launch-tf). Environment: DISTMEM_TIMEOUT (seconds) bounds every collective.
"""
import faulthandler
import json
import os
import signal
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# These launches measure how each distmem call comes back when a peer is gone (its timeouts); fail
# fast would end the survivors first (tests/faults/test_fail_fast.py covers it).
os.environ.setdefault("DISTMEM_FAIL_FAST", "0")

PHASES = ("init", "report", "guard", "periodic")
STEPS = 3  # guard steps and periodic gathers per phase

transport = os.environ.get("FAULT_TRANSPORT", "mpi")
out_dir = os.environ["FAULT_DIR"]
victim = int(os.environ.get("FAULT_RANK", "-1"))
phase_hit = os.environ.get("FAULT_PHASE", "")
sig_name = os.environ.get("FAULT_SIGNAL", "NONE")
point = int(os.environ.get("FAULT_POINT", "1"))
timeout = float(os.environ.get("DISTMEM_TIMEOUT", "5"))


def launcher_rank() -> int:
    for key in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "RANK", "PMI_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    cfg = os.environ.get("TF_CONFIG")
    if cfg:
        return int(json.loads(cfg)["task"]["index"])
    return 0


rank = launcher_rank()
stack_file = open(os.path.join(out_dir, f"stack-{rank}.txt"), "w")
calls = []        # every distmem call: phase, name, start (wall s), seconds, outcome, error
counts = {}       # calibration: Python call events per phase
state = {"events": 0, "injected": None}


def write_atomic(name: str, obj) -> None:
    path = os.path.join(out_dir, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def finish(stopped_by: str) -> None:
    faulthandler.cancel_dump_traceback_later()
    write_atomic(f"result-{rank}.json", {"rank": rank, "pid": os.getpid(), "victim": rank == victim,
                                         "injected": state["injected"], "calls": calls, "counts": counts,
                                         "stopped_by": stopped_by, "transport": transport})
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave only when the harness says the run is over: a rank that exits early (without MPI_Finalize)
    # makes mpirun end the job, and with it a thawed rank that is still finishing. Bounded.
    deadline = time.monotonic() + float(os.environ.get("FAULT_KEEPER_WAIT", "300"))
    while time.monotonic() < deadline and not os.path.exists(os.path.join(out_dir, "done")):
        time.sleep(0.05)
    # A collective abandoned after a timeout (a helper thread, Horovod's background loop) must not
    # hold up the exit; the harness has everything it needs in the result file.
    os._exit(0)


def inject(where: str) -> None:
    sys.setprofile(None)
    state["injected"] = {"phase": phase_hit, "signal": sig_name, "point": point, "at_event": state["events"],
                         "where": where, "wall": time.time()}
    write_atomic(f"injected-{rank}.json", state["injected"])
    os.kill(os.getpid(), signal.SIGKILL if sig_name == "KILL" else signal.SIGSTOP)
    # Only a stopped rank gets here, once the harness sends SIGCONT.
    state["injected"]["thawed_wall"] = time.time()


def _profile(frame, event, arg):
    if event == "call":
        state["events"] += 1
        if state["events"] >= point:
            inject(f"{frame.f_code.co_filename.replace(ROOT + os.sep, '')}:{frame.f_lineno} {frame.f_code.co_name}")


def _count(frame, event, arg):
    if event == "call":
        state["events"] += 1


def begin_phase(phase: str) -> None:
    state["events"] = 0
    state["hook"] = None
    if sig_name == "NONE":
        state["hook"] = _count
    elif rank == victim and phase == phase_hit and state["injected"] is None:
        state["hook"] = _profile


def end_phase(phase: str) -> None:
    if sig_name == "NONE":
        counts[phase] = state["events"]
    elif rank == victim and phase == phase_hit and state["injected"] is None:
        inject("end of phase")  # the phase made fewer calls than the point: inject at its end
    state["hook"] = None


def call(phase: str, name: str, fn):
    """Runs one distmem call, records it; returns its value, or finishes this rank on a non-clean outcome."""
    write_atomic(f"progress-{rank}.json", {"phase": phase, "call": name, "wall": time.time(), "in_call": True})
    t0 = time.time()
    entry = {"phase": phase, "call": name, "start": t0}
    # Where a call that overruns its bound is stuck: every thread's stack, once, into stack-<rank>.txt.
    faulthandler.dump_traceback_later(timeout + 6, repeat=False, file=stack_file)
    try:
        # Only events inside the distmem call count towards the injection point.
        if state.get("hook") is not None and (state["injected"] is None or sig_name == "NONE"):
            sys.setprofile(state["hook"])
        try:
            value = fn()
        finally:
            sys.setprofile(None)
    except BaseException as exc:  # noqa: BLE001 - the outcome is what is being measured
        import distmem

        entry.update(seconds=time.time() - t0,
                     outcome="distmem_error" if isinstance(exc, distmem.DistmemError) else "other_exception",
                     error=f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:300]}",
                     traceback=traceback.format_exc()[-1500:])
        calls.append(entry)
        finish(f"{name}: {type(exc).__name__}")
    faulthandler.cancel_dump_traceback_later()
    entry["seconds"] = time.time() - t0
    missing = list(getattr(value, "missing", None) or [])
    if getattr(value, "aggregates", None) and value.aggregates.get("complete") is False:
        missing = missing or ["?"]
    entry["outcome"] = "returned"
    entry["missing"] = missing
    calls.append(entry)
    write_atomic(f"progress-{rank}.json", {"phase": phase, "call": name, "wall": time.time(), "in_call": False})
    if missing:
        finish(f"{name}: returned with missing rank(s) {missing}")
    return value


# ---- transport setup (not injected: the launcher's and the framework's part) ---------------------
hvd = None
if transport == "horovod":
    import horovod.tensorflow as hvd  # noqa: E402

    hvd.init()
elif transport == "torch":
    import datetime

    import torch.distributed as dist  # noqa: E402

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(30.0, 4 * timeout)))

import numpy as np  # noqa: E402

import distmem  # noqa: E402
import distmem.guard  # noqa: E402

write_atomic(f"pid-{rank}.json", {"rank": rank, "pid": os.getpid()})


def bare_collective():
    """The transport's own all-gather, without distmem: the baseline the harness compares with."""
    if transport == "mpi":
        from mpi4py import MPI

        return lambda x: MPI.COMM_WORLD.allgather(x)
    if transport == "horovod":
        return hvd.allgather_object
    if transport == "torch":
        def gather(x):
            rows = [None] * dist.get_world_size()
            dist.all_gather_object(rows, x)
            return rows
        return gather
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return lambda x: strategy.reduce("SUM", strategy.run(lambda: tf.constant(float(x))), axis=None)


if os.environ.get("FAULT_MODE") == "bare":
    # FAULT_MODE=bare: the same fault against the transport alone. Every rank takes part in one clean
    # all-gather (setup done everywhere), then the victim injects and the others enter a second one.
    bare = bare_collective()
    call("bare", "bare warm-up", lambda: bare(rank))
    if rank == victim:
        inject("before the bare collective")
    call("bare", "bare collective", lambda: bare(rank))
    finish("completed")

# ---- init -----------------------------------------------------------------------------------------
begin_phase("init")
call("init", "init", lambda: distmem.init(fleet=os.environ.get("FAULT_FLEET", "2x16GiB"), framework="none",
                                          verbose=False))
end_phase("init")

if transport == "tf":
    import tensorflow as tf  # noqa: E402

    import distmem  # noqa: E402

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    distmem.use_strategy(strategy)

# ---- report ---------------------------------------------------------------------------------------
begin_phase("report")
call("report", "report", lambda: distmem.report(path=os.path.join(out_dir, "report.json"), timeout=timeout,
                                                print_table=False))
end_phase("report")

# ---- guard ----------------------------------------------------------------------------------------
weights = np.ones(64, dtype=np.float32)


def grads_of(x):
    return [x.mean(axis=0) * weights], float(x.sum())


guard = distmem.guard.step(grads_of, micro_batch_size=4, apply=lambda grads: None, reduce_gradients=None,
                           timeout=timeout)
batch = np.ones((8, 64), dtype=np.float32)
begin_phase("guard")
for i in range(STEPS):
    call("guard", f"guard step {i}", lambda: guard(batch))
end_phase("guard")

# ---- periodic -------------------------------------------------------------------------------------
every = distmem.ReportEvery(1, path=os.path.join(out_dir, "periodic.json"), timeout=timeout, flush_seconds=0.0)
begin_phase("periodic")
for i in range(STEPS):
    call("periodic", f"periodic gather {i}", lambda: every.step())
end_phase("periodic")

finish("completed")
