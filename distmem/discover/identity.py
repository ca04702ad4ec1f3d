"""Who this process is in the job: rank, size, its host, and its local rank as the launcher set it.

Read from the first source that answers, never more: an initialised Horovod; then the launcher's
own variables, innermost launcher first - torchrun (also inside SLURM or under srun), horovodrun
(Gloo), Open MPI (mpirun, horovodrun --mpi, also inside a SLURM allocation), MPICH / Intel MPI
(PMI), SLURM (srun), TF_CONFIG; then mpi4py, only when MPI is already initialised and nothing else
answered (its node split is a collective); else one process. The host is the launcher's node name
(``SLURMD_NODENAME``, ``HOROVOD_HOSTNAME``) or the machine's host name. Nothing here touches CUDA or
TensorFlow's GPU.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional

from ..errors import ConfigError
from . import runtime

__all__ = ["Topology", "detect", "from_env", "launcher_of", "host_name", "job_key", "launch_nonce", "LAUNCHER_ORDER",
           "JOB_ID_VARIABLES", "slurm_tasks_on_node", "MAX_RANKS", "MAX_LOCAL_RANKS"]

#: The most ranks a job, and a host, may have: every rank's plan is listed, and a host's ranks
#: each leave a layout record (no machine runs more processes; launcher variables beyond are a mistake).
MAX_RANKS = 1 << 24
MAX_LOCAL_RANKS = 1 << 16
#: The launchers in the order their variables are trusted: an inner launcher wins over an outer one.
LAUNCHER_ORDER = ("torchrun", "horovodrun-gloo", "openmpi", "mpich", "slurm", "tf-config")


@dataclass(frozen=True)
class Topology:
    """One process's place in the job: its rank of ``size``, its ``host``, and its local
    rank of ``local_size`` on that host as the launcher set them. ``source`` names where the
    figures came from, ``launcher`` which launcher started the process."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    """The launcher's own local rank (``OMPI_COMM_WORLD_LOCAL_RANK``, ``SLURM_LOCALID``...), never
    ``rank % local_size``: cyclic placements make the two differ."""
    local_size: int = 1
    host: str = ""
    """The host, as the launcher names it (see :func:`host_name`)."""
    source: str = "single"
    launcher: str = "none"

    @property
    def host_index(self) -> int:
        """This rank's host under the block mapping (consecutive ranks per host); the real host is
        ``host``, and the plan follows the observed layout, not this figure."""
        return self.rank // max(self.local_size, 1)

    @property
    def num_hosts(self) -> int:
        """Nodes of ``local_size`` ranks the job would fill (a lower bound when hosts differ)."""
        return max(1, -(-self.size // max(self.local_size, 1)))

    @property
    def is_distributed(self) -> bool:
        return self.size > 1

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["host_index"] = self.host_index
        return d


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment variable {name}={value!r} is not an integer; "
                                  "check the launcher's configuration") from None
    return None


def host_name(env: Mapping[str, str] = os.environ) -> str:
    """This process's host as the launcher names it (SLURM's node name, horovodrun's host), else
    the machine's host name."""
    for name in ("SLURMD_NODENAME", "HOROVOD_HOSTNAME"):
        value = (env.get(name) or "").strip()
        if value:
            return value
    return socket.gethostname()


#: The launchers' own per-launch ids: each names one launch, and no two launches alive at once
#: share them (a port bound by a live launcher, a job id the scheduler never hands out twice).
#: Open MPI: ``OMPI_MCA_ess_base_jobid``, ``OMPI_MCA_orte_hnp_uri`` (mpirun's address and port),
#: ``PMIX_NAMESPACE``; SLURM: job and step id; MPICH/PMIx: the namespace; horovodrun (Gloo): its
#: rendezvous server's address and port (a free port per launch); torchrun: the rendezvous id, the
#: restart count and the store's address - which a static rendezvous (``--master-addr/--master-port``)
#: keeps from one launch to the next (``TORCHELASTIC_RUN_ID=none``): :func:`launch_nonce` adds what
#: tells those launches apart.
JOB_ID_VARIABLES = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT",
                    "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "OMPI_MCA_orte_hnp_uri",
                    "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_ID_NAMESPACE", "SLURM_JOB_ID", "SLURM_STEP_ID")


def job_key(env: Mapping[str, str] = os.environ, nonce: str = "") -> Optional[str]:
    """A name for this launch that every rank of it shares and a later launch does not (None for a
    single process): the launcher's own job ids and rendezvous address (:data:`JOB_ID_VARIABLES`),
    and ``nonce`` (:func:`launch_nonce`) where the launcher's ids alone repeat across launches."""
    parts: List[str] = []
    for name in JOB_ID_VARIABLES:
        value = env.get(name)
        if value:
            parts.append(f"{name}={value}")
    if env.get("TF_CONFIG"):
        # Every worker's TF_CONFIG names the same cluster but its own task: the cluster is the job.
        try:
            cluster = json.loads(env["TF_CONFIG"]).get("cluster")
        except (ValueError, AttributeError):
            cluster = env["TF_CONFIG"]
        parts.append("TF_CONFIG=" + json.dumps(cluster, sort_keys=True))
    if not parts:
        return None
    if nonce:
        parts.append(f"nonce={nonce}")
    import hashlib

    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def launch_nonce(env: Mapping[str, str] = os.environ, timeout: float = 30.0) -> str:
    """A random value every rank of this launch agrees on and no other launch has, where the
    launcher's ids (:func:`job_key`) can repeat; ``""`` where they cannot.

    torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``, the default of its static and c10d rendezvous)
    serves a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` for the life of the launch: the first rank
    to ask puts a random value there (``compare_set``, under a key of distmem's own and the restart
    count), every other rank reads it back, and the next launch - a new store, even on the same port
    - draws another. Elsewhere the ids are per launch already (an Open MPI job id and mpirun's port,
    SLURM's job and step, horovodrun's rendezvous port: see :data:`JOB_ID_VARIABLES`), and the
    records' liveness (a lock each rank holds for its life) keeps a dead launch's records out. A
    store that cannot be reached within ``timeout`` gives ``""`` (the ids alone, with a warning)."""
    if (launcher_of(env) != "torchrun" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or not env.get("MASTER_ADDR") or not (env.get("MASTER_PORT") or "").isdigit()):
        return ""
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore
    except Exception:  # noqa: BLE001 - torchrun's Python without torch.distributed: the ids alone
        return ""
    import secrets

    key = f"distmem/layout-nonce/{env.get('TORCHELASTIC_RESTART_COUNT') or '0'}"
    try:
        store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)
        return store.compare_set(key, "", secrets.token_hex(16)).decode()
    except Exception as exc:  # noqa: BLE001 - a store that is gone or refuses: the ids alone, said
        import logging

        logging.getLogger("distmem").warning(
            "distmem: torchrun's store at %s:%s did not answer (%s: %s); the layout exchange meets under the "
            "launcher's ids alone", env["MASTER_ADDR"], env["MASTER_PORT"], type(exc).__name__, str(exc)[:200])
        return ""


def launcher_of(env: Mapping[str, str] = os.environ) -> str:
    """Name the (innermost) launcher that started this process, from its environment."""
    if "TORCHELASTIC_RUN_ID" in env or ("LOCAL_WORLD_SIZE" in env and "RANK" in env):
        return "torchrun"
    if "HOROVOD_RANK" in env or "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env:
        return "horovodrun-gloo"
    if "OMPI_COMM_WORLD_SIZE" in env:
        # horovodrun --mpi starts mpirun and exports no HOROVOD_* variable of its own (0.28.1), so it
        # reads as mpirun unless the user set HOROVOD_* settings themselves.
        return "horovodrun-mpi" if any(k.startswith("HOROVOD_") for k in env) else "mpirun"
    if "PMI_SIZE" in env or "PMIX_RANK" in env or "MPI_LOCALNRANKS" in env:
        return "mpich"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return "slurm"
    if "TF_CONFIG" in env:
        return "tf-config"
    return "none"


def slurm_tasks_on_node(env: Mapping[str, str]) -> Optional[int]:
    """Tasks of this step on this node, from ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``
    (``"2(x3),1"``: two tasks on each of the first three nodes, one on the fourth) and
    ``SLURM_NODEID``; ``SLURM_NTASKS_PER_NODE`` when only that is set."""
    name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
                 if env.get(n)), None)
    raw = env.get(name) if name else None
    node = _int(env, "SLURM_NODEID")
    if raw:
        counts: List[int] = []
        for item in raw.split(","):
            item = item.strip()
            try:
                if "(x" in item:
                    n, rep = item.split("(x")
                    if len(counts) + int(rep.rstrip(")")) > MAX_RANKS:
                        raise ValueError("more nodes than ranks a job may have")
                    counts += [int(n)] * int(rep.rstrip(")"))
                elif item:
                    counts.append(int(item))
            except ValueError:
                raise ConfigError(f"{name}={raw!r}: cannot read {item!r}; SLURM writes e.g. '2(x3),1'") from None
        if counts:
            if node is None:
                return counts[0] if len(set(counts)) == 1 else None
            if 0 <= node < len(counts):
                return counts[node]
    return None


def _from_tf_config(raw: str, host: str) -> Optional[Topology]:
    try:
        cfg = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON ({exc}); it must look like "
                          '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}') from None
    form = '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'
    if not isinstance(cfg, dict):
        raise ConfigError(f"TF_CONFIG is JSON but a {type(cfg).__name__}, not an object; it must look like {form}")
    cluster = cfg.get("cluster")
    task = cfg.get("task")
    cluster = {} if cluster is None else cluster
    task = {} if task is None else task
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise ConfigError(f"TF_CONFIG: 'cluster' and 'task' must be objects (got {type(cluster).__name__} and "
                          f"{type(task).__name__}); it must look like {form}")
    ttype, tindex = task.get("type"), task.get("index")
    if ttype is None or tindex is None:
        return None
    try:
        index = int(tindex)
    except (TypeError, ValueError):
        raise ConfigError(f"TF_CONFIG: task index {tindex!r} is not a whole number; it must look like {form}") from None
    # Ranks are workers in order; a "chief" task counts as rank 0 ahead of the workers.
    order = []
    for kind in ("chief", "worker"):
        addrs = cluster.get(kind, [])
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise ConfigError(f"TF_CONFIG: cluster[{kind!r}] must be a list of 'host:port' strings, got {addrs!r}; "
                              f"it must look like {form}")
        order += [(kind, i, addr) for i, addr in enumerate(addrs)]
    if not order:
        return None
    try:
        pos = [(k, i) for k, i, _ in order].index((ttype, index))
    except ValueError:
        if ttype in ("chief", "worker"):
            raise ConfigError(f"TF_CONFIG: task {ttype} {index} is not in the cluster's {len(cluster.get(ttype, []))} "
                              f"{ttype} address(es); check the task index") from None
        return None  # an evaluator or parameter server takes no training rank
    host_of = lambda addr: addr.rsplit(":", 1)[0]  # noqa: E731
    my_host = host_of(order[pos][2])
    same = [p for p, (_, _, addr) in enumerate(order) if host_of(addr) == my_host]
    return Topology(rank=pos, size=len(order), local_rank=same.index(pos), local_size=len(same),
                    host=host if my_host in ("localhost", "127.0.0.1") else my_host,
                    source="TF_CONFIG", launcher="tf-config")


def from_env(env: Mapping[str, str] = os.environ, host: Optional[str] = None) -> Optional[Topology]:
    """Topology from launcher variables alone (innermost launcher first, see :data:`LAUNCHER_ORDER`),
    or None when no launcher variables are present."""
    host = host or host_name(env)
    launcher = launcher_of(env)
    sets = [
        ("torchrun", ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
        ("horovodrun", ("HOROVOD_RANK",), ("HOROVOD_SIZE",), ("HOROVOD_LOCAL_RANK",), ("HOROVOD_LOCAL_SIZE",)),
        ("openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",),
         ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
        ("mpich/pmi", ("PMI_RANK", "PMIX_RANK"), ("PMI_SIZE",), ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID"),
         ("MPI_LOCALNRANKS", "PALS_LOCAL_SIZE")),
        ("slurm", ("SLURM_PROCID",), ("SLURM_NTASKS",), ("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",)),
    ]
    for source, rank_v, size_v, lrank_v, lsize_v in sets:
        rank, size = _int(env, *rank_v), _int(env, *size_v)
        if rank is None or size is None:
            continue
        if source == "torchrun" and launcher != "torchrun":
            continue  # RANK/WORLD_SIZE alone are too generic to trust
        local_rank = _int(env, *lrank_v)
        local_size = None
        if source == "slurm":
            local_size = slurm_tasks_on_node(env)
        else:
            local_size = _int(env, *lsize_v)
        if local_rank is None:
            local_rank = 0 if local_size in (None, 1) else rank % local_size
        if local_size is None:
            local_size = 1 if size == 1 else max(local_rank + 1, 1)
        if not (0 <= rank < size) or not (0 <= local_rank < local_size):
            raise ConfigError(f"inconsistent launcher variables from {source}: rank={rank} size={size} "
                              f"local_rank={local_rank} local_size={local_size}; check the launch command")
        if size > MAX_RANKS or local_size > MAX_LOCAL_RANKS:
            raise ConfigError(f"launcher variables from {source} give {size} ranks, {local_size} on this host: more "
                              f"than distmem plans for (at most {MAX_RANKS} ranks, {MAX_LOCAL_RANKS} per host); "
                              "check the launch command")
        return Topology(rank, size, local_rank, local_size, host, source, launcher)
    if "TF_CONFIG" in env:
        return _from_tf_config(env["TF_CONFIG"], host)
    return None


def _from_horovod(env: Mapping[str, str]) -> Optional[Topology]:
    hvd = runtime.horovod()
    if hvd is None:
        return None
    try:
        return Topology(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), host_name(env), "horovod",
                        launcher_of(env))
    except Exception:  # noqa: BLE001 - a Horovod that cannot answer is "not Horovod"
        return None


def _from_mpi4py() -> Optional[Topology]:
    mpi_mod = runtime.mpi()
    if mpi_mod is None:
        return None
    comm = mpi_mod.COMM_WORLD
    local = comm.Split_type(mpi_mod.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return Topology(comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size(),
                        mpi_mod.Get_processor_name(), "mpi4py", launcher_of())
    finally:
        local.Free()


def detect(env: Mapping[str, str] = os.environ) -> Topology:
    """This process's topology from the first source that answers. Never initialises CUDA,
    TensorFlow's GPU or MPI, and runs MPI's node split only when no variable answered."""
    for source in (_from_horovod, from_env, lambda e: _from_mpi4py()):
        found = source(env)
        if found is not None:
            return found
    return Topology(host=host_name(env))
