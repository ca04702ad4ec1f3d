"""Kubernetes resources from a plan: a Horovod ``MPIJob`` (kubeflow.org/v2beta1) whose GPU and GPU
memory requests come from the plan, with three ways of giving GPUs to ranks.

    distmem plan --gpus 4x80GiB --ranks 8 --ranks-per-host 4 --emit k8s
    distmem plan --gpus 4x80GiB --ranks 16 --ranks-per-host 8 --emit k8s --k8s-sharing time-slicing
    distmem plan --gpus 2x80GiB --ranks 4 --ranks-per-host 4 --emit k8s --k8s-sharing hami

``whole`` (default): one worker pod per node holding that node's ranks (``slotsPerWorker``) and the
whole GPUs they use (``nvidia.com/gpu``); distmem inside the pod pins and limits each rank as planned.

``time-slicing``: one pod per rank asking for one ``nvidia.com/gpu`` replica of the NVIDIA device
plugin's time-slicing, with the device plugin ConfigMap (``replicas`` = ranks per GPU in the plan).
Time-slicing isolates no memory: each pod carries its planned limit in ``DISTMEM_LIMIT`` (strategy
data; the others derive limits from their own inputs) and distmem enforces it through the framework.

``hami``: one pod per rank with HAMi's per-container GPU memory ``nvidia.com/gpumem`` (MiB per GPU):
the rank's planned framework limit plus the per-process overhead outside the allocator (HAMi counts
everything the container allocates on the device), rounded down to whole MiB.

An MPIJob has one worker template, so per-rank modes ask for the largest rank's figure; the plan's
per-rank limits ride along in the ``distmem.io/plan`` annotation. ``runPolicy.activeDeadlineSeconds``
is the job's hard timeout.
"""
from __future__ import annotations

import argparse
import json
import shlex
from typing import Any, Dict, List, Optional

from ..errors import ConfigError
from ..plan.types import Plan
from ..units import MiB, plural
from .checks import k8s_name, k8s_quantity

__all__ = ["emit_k8s", "manifests", "render_yaml", "add_cli_arguments", "check_k8s_arguments", "SHARING_MODES",
           "API_VERSION"]

API_VERSION = "kubeflow.org/v2beta1"
SHARING_MODES = ("whole", "time-slicing", "hami")
_DEFAULTS = {"k8s_sharing": "whole", "k8s_name": "distmem-train", "k8s_image": "horovod/horovod:0.28.1",
             "k8s_command": "python examples/train.py", "k8s_namespace": None, "k8s_timeout": 86400,
             "k8s_host_memory": None}


def _host_ranks(plan: Plan) -> Dict[str, List[Any]]:
    nodes: Dict[str, List[Any]] = {}
    for a in plan.allocations:
        nodes.setdefault(a.host, []).append(a)
    return nodes


def _takes_limit(strategy: str) -> bool:
    """Whether ``strategy`` takes an explicit per-rank limit (``DISTMEM_LIMIT``) - its options say."""
    from ..plan import get

    try:
        return any(f.name == "limit" for f in get(strategy).fields())
    except ConfigError:
        return False


def _gpus_of(allocs: List[Any]) -> List[int]:
    return sorted({d.index for a in allocs for d in a.devices})


def _limit_env(bytes_: int) -> str:
    return f"{bytes_ // MiB}MiB"


def _plan_annotation(plan: Plan) -> str:
    """The plan in brief: every rank's planned limit per device in MiB (``null``: no GPU)."""
    return json.dumps({"strategy": plan.strategy, "ranks": plan.world_size, "source": plan.source,
                       "overhead_mib": plan.overhead_bytes // MiB, "reserve_mib": plan.reserve_bytes // MiB,
                       "rank_limits_mib": [[d.planned_bytes // MiB for d in a.devices] or None
                                           for a in plan.allocations]}, sort_keys=True, separators=(",", ":"))


def manifests(plan: Plan, *, sharing: str = "whole", name: str = "distmem-train",
              image: str = "horovod/horovod:0.28.1", command: str = "python examples/train.py",
              namespace: Optional[str] = None, timeout: int = 86400, host_memory: Optional[str] = None
              ) -> List[Dict[str, Any]]:
    """The Kubernetes objects for ``plan``: ``[MPIJob]``, or ``[ConfigMap, MPIJob]`` for time-slicing."""
    if sharing not in SHARING_MODES:
        raise ConfigError(f"--k8s-sharing {sharing!r} is not one of {', '.join(SHARING_MODES)}")
    if not timeout or int(timeout) <= 0:
        raise ConfigError(f"--k8s-timeout {timeout!r}: the MPIJob needs a positive hard deadline in seconds")
    nodes = _host_ranks(plan)
    per_host = len(next(iter(nodes.values())))
    if any(len(v) != per_host for v in nodes.values()):
        raise ConfigError(f"hosts run different numbers of ranks ({', '.join(f'{k}: {len(v)}' for k, v in nodes.items())});"
                          " an MPIJob gives every worker the same slots: give every host the same ranks")
    # An MPIJob has one worker template: every pod it makes must be right for the rank it holds.
    host_gpus = {h: len(_gpus_of(v)) for h, v in nodes.items()}
    if len(set(host_gpus.values())) > 1:
        raise ConfigError(f"hosts use different numbers of GPUs ({', '.join(f'{h}: {n}' for h, n in host_gpus.items())});"
                          " an MPIJob gives every worker the same template: emit one MPIJob per kind of host")
    limits_seen = sorted({a.limit_bytes for a in plan.allocations if a.devices})
    if sharing != "whole" and len(limits_seen) > 1:
        by = ", ".join(f"rank {a.rank}: {_limit_env(a.limit_bytes or 0)}" for a in plan.allocations[:8])
        raise ConfigError(f"--k8s-sharing {sharing} makes one pod per rank from one template, but the plan gives "
                          f"ranks different limits ({by}); a pod on a smaller GPU would get a larger rank's limit: "
                          "emit one MPIJob per kind of host (--gpus with one size), or use --k8s-sharing whole")
    has_gpus = any(a.devices for a in plan.allocations)
    if sharing != "whole" and not has_gpus:
        raise ConfigError(f"--k8s-sharing {sharing} shares GPUs, but this plan has none (devices from {plan.source}); "
                          "pass --gpus COUNTxSIZE")
    per_rank = sharing != "whole"
    # Every rank recomputes the plan in its pod: give it the overhead the plan assumed.
    env: List[Dict[str, str]] = [{"name": "DISTMEM_OVERHEAD", "value": _limit_env(plan.overhead_bytes)}]
    from ..apply.torch import plan_needs_expandable

    if plan_needs_expandable(plan):
        # the plan's limits hold only with torch's expandable segments: every rank's init() sets them
        # before CUDA starts (said here, so the job's own launch line carries it to every rank)
        env.append({"name": "DISTMEM_TORCH_EXPANDABLE_SEGMENTS", "value": "1"})
    limits: Dict[str, Any] = {}
    objects: List[Dict[str, Any]] = []
    if sharing == "whole":
        gpus = max(len(_gpus_of(v)) for v in nodes.values())
        if gpus:
            limits["nvidia.com/gpu"] = gpus
        slots, workers = per_host, len(nodes)
    else:
        slots, workers = 1, plan.world_size
        gpus_per_rank = max(len({d.index for d in a.devices}) for a in plan.allocations)
        limits["nvidia.com/gpu"] = gpus_per_rank
        largest = max((a for a in plan.allocations if a.devices), key=lambda a: a.limit_bytes or 0)
        if _takes_limit(plan.strategy):  # the others derive their limits from their own inputs
            env += [{"name": "DISTMEM_MEMORY", "value": "limit"},
                    {"name": "DISTMEM_LIMIT", "value": _limit_env(largest.limit_bytes or 0)}]
        if sharing == "hami":
            per_gpu: Dict[int, int] = {}
            for a in plan.allocations:
                for idx in {d.index for d in a.devices}:
                    held = sum(d.planned_bytes for d in a.devices if d.index == idx) + plan.overhead_bytes
                    per_gpu[idx] = max(per_gpu.get(idx, 0), held)
            limits["nvidia.com/gpumem"] = max(per_gpu.values()) // MiB
        else:
            replicas = max(d.shared_by for a in plan.allocations for d in a.devices)
            objects.append({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": f"{name}-time-slicing", "namespace": "gpu-operator",
                             "annotations": {"distmem.io/usage": "set as the GPU operator's devicePlugin.config "
                                                                  "(name), default 'any'"}},
                "data": {"any": "version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing:\n"
                                "    failRequestsGreaterThanOne: true\n    resources:\n"
                                f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n"},
            })
    if host_memory:
        limits["memory"] = host_memory
    worker_container: Dict[str, Any] = {"name": "worker", "image": image, "env": [dict(e) for e in env]}
    if limits:
        worker_container["resources"] = {"limits": limits}
    run = ["mpirun", "-np", str(plan.world_size), "--allow-run-as-root", "-bind-to", "none", "-map-by", "slot",
           "-x", "NCCL_DEBUG=WARN", "-x", "LD_LIBRARY_PATH", "-x", "PATH", "-mca", "pml", "ob1",
           "-mca", "btl", "^openib"]
    for var in env:
        run += ["-x", var["name"]]
    launcher = {"name": "launcher", "image": image, "command": run + shlex.split(command),
                "env": [dict(e) for e in env], "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}
    metadata: Dict[str, Any] = {"name": name, "annotations": {
        "distmem.io/plan": _plan_annotation(plan), "distmem.io/sharing": sharing}}
    if namespace:
        metadata["namespace"] = namespace
    job = {
        "apiVersion": API_VERSION, "kind": "MPIJob", "metadata": metadata,
        "spec": {
            "slotsPerWorker": slots,
            "runPolicy": {"cleanPodPolicy": "Running", "activeDeadlineSeconds": int(timeout), "backoffLimit": 0},
            "mpiImplementation": "OpenMPI",
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": {"containers": [launcher]}}},
                "Worker": {"replicas": workers, "template": {"spec": {"containers": [worker_container]}}},
            },
        },
    }
    if per_rank:
        job["metadata"]["annotations"]["distmem.io/note"] = (
            "one pod per rank; the worker template asks for the largest rank's share")
    objects.append(job)
    return objects


def render_yaml(objects: List[Dict[str, Any]], header: str = "") -> str:
    """YAML documents (JSON, which is YAML too, when PyYAML is missing), each after ``---``;
    ``header`` becomes comment lines on top."""
    try:
        import yaml

        class _Dumper(yaml.SafeDumper):
            pass

        def _str(dumper: Any, value: str) -> Any:
            style = "|" if "\n" in value else None
            return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

        _Dumper.add_representer(str, _str)
        docs = [yaml.dump(o, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120) for o in objects]
    except ImportError:
        docs = [json.dumps(o, indent=2) + "\n" for o in objects]
    top = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return top + "".join(f"---\n{d}" for d in docs)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``--k8s-*`` options of ``distmem plan --emit k8s`` (safe to call twice)."""
    def add(flag: str, **kw: Any) -> None:
        if flag not in parser._option_string_actions:  # noqa: SLF001 - argparse has no public test
            parser.add_argument(flag, **kw)

    add("--k8s-sharing", choices=list(SHARING_MODES), default=_DEFAULTS["k8s_sharing"],
        help="--emit k8s: whole GPUs per node pod, time-slicing replicas, or HAMi nvidia.com/gpumem per rank pod")
    add("--k8s-name", default=_DEFAULTS["k8s_name"], help="--emit k8s: MPIJob name")
    add("--k8s-image", default=_DEFAULTS["k8s_image"], help="--emit k8s: container image")
    add("--k8s-command", default=_DEFAULTS["k8s_command"], help="--emit k8s: training command every rank runs")
    add("--k8s-namespace", default=None, help="--emit k8s: namespace of the MPIJob")
    add("--k8s-timeout", type=int, default=_DEFAULTS["k8s_timeout"],
        help="--emit k8s: hard deadline of the job in seconds (runPolicy.activeDeadlineSeconds)")
    add("--k8s-host-memory", default=None, help="--emit k8s: host memory limit of each worker container, e.g. 64Gi")


def check_k8s_arguments(args: argparse.Namespace) -> None:
    """ConfigError naming the option and value of every ``--k8s-*`` text Kubernetes would refuse (or
    that would make a job that cannot run), and of any ``--k8s-*`` given without ``--emit k8s``."""
    given = [k for k, v in _DEFAULTS.items() if getattr(args, k, v) != v]
    if getattr(args, "emit", None) != "k8s":
        if given:
            raise ConfigError(f"{'--' + given[0].replace('_', '-')} {getattr(args, given[0])!r} only shapes the "
                              "manifests of --emit k8s; add --emit k8s or drop it")
        return
    k8s_name(getattr(args, "k8s_name", None) or _DEFAULTS["k8s_name"], "--k8s-name")
    if getattr(args, "k8s_namespace", None) is not None:
        k8s_name(args.k8s_namespace, "--k8s-namespace")
    if getattr(args, "k8s_host_memory", None) is not None:
        k8s_quantity(args.k8s_host_memory, "--k8s-host-memory")
    image = getattr(args, "k8s_image", _DEFAULTS["k8s_image"])
    if image is not None and (not image.strip() or any(c.isspace() for c in image.strip())):
        raise ConfigError(f"--k8s-image {image!r}: give a container image reference, e.g. horovod/horovod:0.28.1")
    command = getattr(args, "k8s_command", _DEFAULTS["k8s_command"])
    if command is not None:
        try:
            words = shlex.split(command)
        except ValueError as exc:
            raise ConfigError(f"--k8s-command {command!r} cannot be read as a command line ({exc}); check its "
                              "quotes") from None
        if not words:
            raise ConfigError(f"--k8s-command {command!r} is empty; give the training command every rank runs, "
                              "e.g. 'python examples/train.py'")
    timeout = getattr(args, "k8s_timeout", _DEFAULTS["k8s_timeout"])
    if timeout is not None and int(timeout) <= 0:
        raise ConfigError(f"--k8s-timeout {timeout}: the MPIJob needs a positive hard deadline in seconds")


def emit_k8s(plan: Plan, args: argparse.Namespace) -> str:
    """``distmem plan --emit k8s``: the manifests as YAML text (options missing from ``args`` take defaults)."""
    check_k8s_arguments(args)
    opt = {k: getattr(args, k, None) if getattr(args, k, None) is not None else v for k, v in _DEFAULTS.items()}
    objects = manifests(plan, sharing=opt["k8s_sharing"], name=opt["k8s_name"], image=opt["k8s_image"],
                        command=opt["k8s_command"], namespace=opt["k8s_namespace"], timeout=opt["k8s_timeout"],
                        host_memory=opt["k8s_host_memory"])
    header = (f"distmem plan: strategy {plan.strategy}, {plural(plan.world_size, 'rank')}, devices from {plan.source}, "
              f"GPU sharing {opt['k8s_sharing']}\n" + "\n".join(a.describe() for a in plan.allocations[:16]))
    return render_yaml(objects, header)
