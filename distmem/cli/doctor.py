"""``distmem doctor``: what distmem sees, and what ``init()`` would do, without starting anything heavy.

    distmem doctor                          # this process: launcher, topology, GPUs, frameworks, plan
    distmem doctor --ranks 8 --fleet 4x80GiB  # would 8 ranks per node fit on these GPUs?
    horovodrun -np 4 -H localhost:4 distmem doctor --json   # every rank's view

Sections: launcher and topology (environment only), CUDA_VISIBLE_DEVICES, GPUs and their processes
from NVML (no CUDA context), installed frameworks and versions (package metadata: nothing is
imported), Horovod's build flags (``mpi_built``/``gloo_built``/``nccl_built``, probed in a
subprocess so this process never loads TensorFlow), and the plan ``init()`` would compute.
Exit status 1, with every reason and its remedy, when something would fail: a malformed
CUDA_VISIBLE_DEVICES, a plan that does not fit (more ranks than a GPU can hold), Horovod built
without the controller the launcher uses, inconsistent launcher variables.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from .. import settings
from ..errors import DistmemError
from ..plan import JobLayout, PlanRequest
from ..units import format_bytes, plural
from .request_args import add_request_arguments, request_from_args

__all__ = ["add_arguments", "run", "diagnose", "Diagnosis", "probe_horovod", "horovod_problems", "LAUNCHERS"]

#: Seconds doctor waits for the other ranks of its host (when they run doctor too) before it plans
#: as if they saw its GPUs.
DOCTOR_EXCHANGE_SECONDS = 5.0
LAUNCHERS = ("auto", "none", "mpirun", "horovodrun-gloo", "horovodrun-mpi", "mpich", "slurm", "torchrun",
             "tf-config")
_PACKAGES = ("tensorflow", "tensorflow-cpu", "keras", "tf-keras", "torch", "horovod", "mpi4py", "nvidia-ml-py",
             "psutil", "rich", "matplotlib", "tensorboard", "jax")

_PROBE = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
out = {}
for mod in ("horovod.tensorflow", "horovod.torch"):
    try:
        hvd = __import__(mod, fromlist=["mpi_built"])
    except Exception as exc:
        out.setdefault("errors", {})[mod] = f"{type(exc).__name__}: {exc}"
        continue
    flags = {}
    for name in ("mpi_built", "gloo_built", "nccl_built", "cuda_built", "rocm_built", "ccl_built", "ddl_built"):
        fn = getattr(hvd, name, None)
        try:
            flags[name] = bool(fn()) if fn else None
        except Exception as exc:
            flags[name] = None
    out["module"] = mod
    out["flags"] = flags
    break
print("DISTMEM_PROBE " + json.dumps(out))
"""


def add_arguments(p: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> None:
    add_request_arguments(p, argv)
    p.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                   help="check against this launcher instead of the detected one (e.g. before horovodrun --gloo)")
    p.add_argument("--no-horovod-probe", action="store_true", help="skip the Horovod build-flag subprocess")
    p.add_argument("--json", action="store_true", help="print everything as JSON")


@dataclass
class Diagnosis:
    """What doctor found: sections of facts, notes (worth knowing) and problems (would fail)."""

    facts: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {"facts": self.facts, "notes": self.notes, "problems": self.problems, "ok": not self.problems}


def probe_horovod(timeout: float = 180.0, python: Optional[str] = None) -> Dict[str, Any]:
    """Horovod's build flags from a subprocess (importing horovod.tensorflow loads TensorFlow, which
    doctor must not do in its own process). ``{"installed": False}`` without Horovod."""
    if not _has("horovod"):
        return {"installed": False}
    from .. import children  # an isolated sys.path: never a module from the working folder

    try:
        res = children.run(code=_PROBE, python=python, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    except subprocess.TimeoutExpired:
        return {"installed": True, "error": f"the probe did not finish within {timeout:.0f} s"}
    line = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith("DISTMEM_PROBE ")), None)
    if line is None:
        return {"installed": True, "error": f"probe exited {res.returncode}: {res.stderr.strip()[-400:]}"}
    out = json.loads(line[len("DISTMEM_PROBE "):])
    out["installed"] = True
    return out


def horovod_problems(launcher: str, probe: Dict[str, Any]) -> List[str]:
    """Problems for a Horovod build under a launcher: each names the flag and the rebuild."""
    if not probe.get("installed") or launcher not in ("horovodrun-gloo", "horovodrun-mpi", "mpirun"):
        return []
    flags = probe.get("flags")
    if not flags:
        if launcher.startswith("horovodrun"):
            return [f"Horovod is installed but neither horovod.tensorflow nor horovod.torch loads "
                    f"({probe.get('errors') or probe.get('error')}); reinstall Horovod against the installed framework "
                    "(pip install --no-cache-dir --force-reinstall horovod)"]
        return []
    rebuild = "pip install --no-cache-dir --force-reinstall horovod with {}=1 (check with horovodrun --check-build)"
    if launcher == "horovodrun-gloo" and not flags.get("gloo_built"):
        return [f"launched by horovodrun --gloo but {probe['module']}.gloo_built() is False: Horovod was built "
                f"without Gloo; run horovodrun --mpi, or rebuild: " + rebuild.format("HOROVOD_WITH_GLOO")]
    if launcher == "horovodrun-mpi" and not flags.get("mpi_built"):
        return [f"launched by horovodrun --mpi but {probe['module']}.mpi_built() is False: Horovod was built without "
                f"MPI; run horovodrun --gloo, or rebuild: " + rebuild.format("HOROVOD_WITH_MPI")]
    return []


def _versions() -> Dict[str, Optional[str]]:
    from importlib import metadata

    out: Dict[str, Optional[str]] = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _mpi_version() -> Optional[str]:
    exe = shutil.which("mpirun")
    if not exe:
        return None
    try:
        res = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = (res.stdout or res.stderr).strip().splitlines()
    return first[0] if first else None


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def diagnose(strategy: str = "data", ranks: Optional[int] = None, fleet: Optional[str] = None,
             launcher: str = "auto", env: Optional[Mapping[str, str]] = None,
             probe: Optional[Callable[[], Dict[str, Any]]] = probe_horovod,
             request: Optional[PlanRequest] = None, options: Optional[Dict[str, Any]] = None) -> Diagnosis:
    """Everything doctor reports, as data. ``probe`` returns Horovod's flags (None skips it).
    ``request``: the plan request to check (``distmem doctor``'s flags); else ``strategy`` with
    ``options``, ``fleet`` and, with ``ranks``, a declared host of that many ranks."""
    from .. import __version__
    from ..comm import mpi_launched
    from ..discover.gpus import inventory, nvml_available
    from ..apply import detect_framework
    from ..discover.identity import Topology, from_env, launcher_of

    env = dict(os.environ if env is None else env)
    d = Diagnosis()
    d.facts["distmem"] = {"version": __version__, "python": platform.python_version(), "host": socket.gethostname(),
                          "platform": platform.platform()}
    # Launcher and topology, from the environment alone.
    detected = launcher_of(env)
    used = detected if launcher == "auto" else launcher
    topo = None
    try:
        topo = from_env(env)
    except DistmemError as exc:
        d.problems.append(f"launcher variables: {exc}")
    topo = topo or Topology(host=socket.gethostname())
    d.facts["launcher"] = {"detected": detected, "checked_as": used, "topology": topo.to_dict()}
    if used in ("mpirun", "horovodrun-mpi", "mpich") and not _has("mpi4py"):
        d.notes.append("launched by MPI but mpi4py is not installed: distmem gathers through Horovod once "
                       "hvd.init() ran, and cannot time out on a missing rank as precisely (pip install mpi4py)")
    hv = probe() if probe is not None else None
    has_horovod = hv["installed"] if hv is not None else _has("horovod")
    if topo.size > 1 and not (mpi_launched(env) and _has("mpi4py")) and not has_horovod and not _has("torch"):
        d.problems.append(f"this is rank {topo.rank} of {topo.size} but no transport can gather the report: "
                          "install mpi4py (mpirun jobs) or Horovod")
    # CUDA_VISIBLE_DEVICES and NVML.
    spec = env.get("CUDA_VISIBLE_DEVICES")
    d.facts["cuda_visible_devices"] = spec
    inv = None
    try:
        inv = inventory(env, quiet=True)
    except DistmemError as exc:
        d.problems.append(str(exc))
    if inv is not None and not inv.real and spec not in (None, "", "-1", "NoDevFiles", "none"):
        from ..discover.gpus import VISIBLE_ITEM  # the same grammar inventory() checks once NVML is there

        bad = [item for item in spec.split(",") if not VISIBLE_ITEM.match(item.strip())]
        dup = sorted({item.strip() for item in spec.split(",") if spec.split(",").count(item) > 1})
        if bad or dup:
            d.problems.append(f"CUDA_VISIBLE_DEVICES={spec!r}: " + (f"cannot read item(s) {bad}" if bad else "")
                              + ("; " if bad and dup else "") + (f"item(s) {dup} listed twice" if dup else "")
                              + "; use GPU indices (0,1), GPU UUIDs (GPU-8c1f...) or MIG UUIDs separated by commas")
    if inv is not None:
        gpus = []
        for g in inv.gpus:
            procs = [{"pid": p.pid, "name": _process_name(p.pid), "used_bytes": p.used_bytes} for p in g.processes]
            gpus.append({"index": g.index, "nvml_index": g.nvml_index, "uuid": g.uuid, "name": g.name,
                         "total_bytes": g.total_bytes, "used_bytes": g.used_bytes, "free_bytes": g.free_bytes,
                         "mig": g.mig, "processes": procs})
            if procs:
                used_b = sum(p["used_bytes"] or 0 for p in procs)
                d.notes.append(f"GPU {g.index} already holds {format_bytes(used_b)} in {len(procs)} process(es): "
                               + ", ".join(f"pid {p['pid']} {p['name']} ({format_bytes(p['used_bytes'])})"
                                           for p in procs[:5]))
        d.facts["nvml"] = {"available": nvml_available(), "source": inv.source, "driver": inv.driver,
                           "note": inv.note, "gpus": gpus}
        d.facts["stray_contexts"] = stray = stray_contexts(inv, topo.host)
        for s in stray:
            d.problems.append(
                f"rank {s['rank']} (pid {s['pid']}) holds {format_bytes(s['bytes'])} on GPU {s['gpu_index']} "
                f"({s['gpu']}), a GPU the plan did not give it (it planned {s['planned_gpu']}): a CUDA context started "
                f"before distmem.init() - {STRAY_CAUSES}")
    # Frameworks, from package metadata only.
    versions = _versions()
    d.facts["packages"] = versions
    d.facts["mpi"] = _mpi_version()
    try:
        d.facts["framework_init_would_use"] = detect_framework(None)
    except DistmemError as exc:
        d.problems.append(str(exc))
    # Horovod's build.
    if hv is not None:
        d.facts["horovod"] = hv
        d.problems += horovod_problems(used, hv)
        if used == "mpirun" and hv.get("flags") and not hv["flags"].get("mpi_built"):
            d.notes.append("Horovod was built without MPI: under mpirun each Horovod process would run alone; "
                           "distmem itself still gathers with mpi4py")
        if hv.get("error"):
            d.notes.append(f"Horovod probe: {hv['error']}")
    # The plan init() would compute: the same request, from the same environment.
    req = request
    if req is None:
        job = JobLayout.declare(ranks=ranks, fleet=fleet or settings.fleet(env)) if ranks is not None else None
        req = PlanRequest(strategy=strategy, options=dict(options or {}), fleet=fleet, env=env, job=job)
    if req.job is None:
        # The host's other ranks may not run doctor: wait a little, unless DISTMEM_LAYOUT_TIMEOUT says how long.
        given = settings.raw("DISTMEM_LAYOUT_TIMEOUT", env) is not None
        req.exchange_timeout = settings.layout_timeout(env) if given else DOCTOR_EXCHANGE_SECONDS
        req.assume_on_timeout = True
    try:
        plan = req.plan()
        d.facts["plan"] = {"summary": plan.summary(), "warnings": list(plan.warnings),
                           "fingerprint": plan.fingerprint(), "source": plan.source,
                           "allocations": [a.to_dict() for a in plan.allocations]}
        d.notes += [f"plan: {w}" for w in plan.warnings] + list(req.notes)
        if not any(a.devices for a in plan.allocations):
            d.notes.append("no GPU found and no fleet declared: init() runs in CPU mode (pass --fleet 4x80GiB or "
                           "set DISTMEM_FLEET to check a plan for a GPU node)")
    except DistmemError as exc:
        where = (f"{plural(req.job.size, 'rank')} on {plural(len(req.job.hosts), 'host')}" if req.job is not None
                 else f"rank {topo.rank} of {topo.size}")
        d.problems.append(f"init(strategy={req.strategy!r}) would fail for {where}: {exc}")
    return d


STRAY_CAUSES = ("usual causes: torch.load without map_location, a DataLoader pin_memory thread before the device "
                "was set, JAX/XLA preallocating every visible GPU, TensorFlow touched before init()")


def stray_contexts(inv: Any, host: str, directory: Optional[str] = None) -> List[Dict[str, Any]]:
    """Processes of a running distmem job on this host (known from the layout exchange) that NVML
    shows on a GPU their plan did not give them: rank, pid, GPU, bytes, and the GPU planned."""
    from ..discover.layout import live_layouts
    from ..plan.places import places

    out: List[Dict[str, Any]] = []
    for key, layout in live_layouts(host, directory).items():
        planned = {p.rank: p.gpu.uuid if p.gpu is not None else None for p in places(layout)}
        pid_rank = {v.pid: v.rank for v in layout.views}
        for g in inv.gpus:
            for pid, used in g.holders().items():
                rank = pid_rank.get(pid)
                if rank is not None and planned.get(rank) not in (None, g.uuid):
                    out.append({"job": key, "rank": rank, "pid": pid, "host": host, "gpu": g.uuid,
                                "gpu_index": g.index, "bytes": used, "planned_gpu": planned.get(rank)})
    return out


def _has(module: str) -> bool:
    """Whether ``module`` is installed, without importing it. A folder of the same name on sys.path
    (e.g. a test suite's ``horovod/``) is a namespace package without an origin: not the package."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def _print(d: Diagnosis) -> None:
    f = d.facts
    w = print
    w(f"distmem {f['distmem']['version']} on {f['distmem']['host']} (Python {f['distmem']['python']}, "
      f"{f['distmem']['platform']})")
    lau = f["launcher"]
    t = lau["topology"]
    w(f"\nlauncher: {lau['detected']}" + (f" (checked as {lau['checked_as']})" if lau["checked_as"] != lau["detected"]
                                          else ""))
    w(f"  rank {t['rank']} of {t['size']}, local rank {t['local_rank']} of {t['local_size']}, host {t['host']} "
      f"(from {t['source']})")
    w(f"\nCUDA_VISIBLE_DEVICES: {f['cuda_visible_devices'] if f['cuda_visible_devices'] is not None else '(unset)'}")
    nv = f.get("nvml")
    if nv:
        w(f"NVML: {'driver ' + nv['driver'] if nv['driver'] else 'not available'}"
          + (f" - {nv['note']}" if nv["note"] else ""))
        for g in nv["gpus"]:
            w(f"  GPU {g['index']} {g['name']} {g['uuid']}: total {format_bytes(g['total_bytes'])}, used "
              f"{format_bytes(g['used_bytes'])}, free {format_bytes(g['free_bytes'])}" + (" (MIG)" if g["mig"] else ""))
            for p in g["processes"]:
                w(f"    pid {p['pid']:>8} {p['name']:<20} {format_bytes(p['used_bytes'])}")
    w("\npackages: " + (", ".join(f"{k} {v}" for k, v in f["packages"].items()) or "none of interest"))
    if f.get("mpi"):
        w(f"MPI: {f['mpi']}")
    if "framework_init_would_use" in f:
        w(f"init() would configure: {f['framework_init_would_use']}")
    hv = f.get("horovod")
    if hv is not None:
        if not hv.get("installed"):
            w("Horovod: not installed")
        elif hv.get("flags"):
            flags = ", ".join(f"{k}={v}" for k, v in hv["flags"].items() if v is not None)
            w(f"Horovod ({hv['module']}): {flags}")
        else:
            w(f"Horovod: installed, build flags unknown ({hv.get('error') or hv.get('errors')})")
    if "plan" in f:
        w("\n" + f["plan"]["summary"])
    if d.notes:
        w("")
        for n in d.notes:
            w(f"note: {n}")
    w("")
    if d.problems:
        for p in d.problems:
            w(f"PROBLEM: {p}")
        w(f"\ndoctor: {plural(len(d.problems), 'problem')} found")
    else:
        w("doctor: no problems found")


def run(args: argparse.Namespace) -> int:
    declared = any(getattr(args, k, None) is not None for k in ("ranks", "ranks_per_host", "hosts"))
    request = request_from_args(args, job=declared)
    if args.gpus:  # a fleet given on the command line is an input: refused in one line, not a finding
        from ..discover.gpus import fleet_hosts, parse_fleet

        for host in fleet_hosts(args.gpus, "--gpus"):
            parse_fleet(args.gpus, host if host != "*" else None, "--gpus")
    d = diagnose(strategy=args.strategy, fleet=args.gpus, launcher=args.launcher, request=request,
                 probe=None if args.no_horovod_probe else probe_horovod)
    if args.json:
        # One write: under a launcher that tags each write (horovodrun), many small ones shred the document.
        sys.stdout.write(json.dumps(d.to_dict(), indent=1, default=str) + "\n")
        sys.stdout.flush()
    else:
        _print(d)
    return 1 if d.problems else 0
