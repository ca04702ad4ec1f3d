"""What each rank should get, from the launcher's documented mapping and distmem's documented rules.

Mappings (which host each global rank lands on), as the launchers document them:

- Open MPI ``--map-by slot`` (the default, and horovodrun's): fill each host's slots in ``--host``
  order; ``--map-by node``: one rank per host in turn, skipping hosts whose slots are full.
  ``OMPI_COMM_WORLD_LOCAL_RANK`` numbers a host's ranks in global-rank order.
- SLURM ``--distribution=block``: consecutive tasks share a node; ``=cyclic``: task i goes to node
  ``i % N``. ``SLURM_LOCALID`` numbers a node's tasks in task order.
- torchrun: ``RANK = GROUP_RANK * nproc_per_node + LOCAL_RANK`` (the node order comes from the
  rendezvous, so it is read from the ranks' GROUP_RANK, not assumed).

distmem's rules (the contract the probe checks): declared GPU ``i`` of host ``h`` has UUID
``fleet_uuid(h, i)``; CUDA_VISIBLE_DEVICES filters a host's GPUs; a rank takes GPU
``visible[p % len(visible)]`` where ``p`` is its position among the ranks of its host that see the same
set; a GPU used by ``k`` ranks gives each ``floor_MiB((total - reserve - k * overhead) / k)``, enforced
as a hard limit when ``k > 1`` and as growth when ``k == 1``.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["MiB", "GiB", "fleet_uuid", "share_bytes", "parse_hosts", "map_slot", "map_node", "slurm_block",
           "slurm_cyclic", "torchrun_hosts", "parse_fleet_spec", "Expected", "expected", "compare", "table"]

MiB = 1 << 20
GiB = 1 << 30
RESERVE = 256 * MiB
OVERHEAD = 768 * MiB


def fleet_uuid(host: str, index: int) -> str:
    """The stable UUID of declared GPU ``index`` on ``host``."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"distmem-fleet://{host}/{index}"))


def share_bytes(total: int, k: int, reserve: int = RESERVE, overhead: int = OVERHEAD) -> int:
    """Bytes each of ``k`` ranks gets on a GPU of ``total`` bytes, floored to whole MiB."""
    return (total - reserve - k * overhead) // k // MiB * MiB


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """``"hosta:2,hostb:2"`` -> ``[("hosta", 2), ("hostb", 2)]`` (a host without ``:n`` has one slot)."""
    out = []
    for part in spec.split(","):
        name, _, n = part.partition(":")
        out.append((name, int(n) if n else 1))
    return out


def map_slot(spec: str, np: Optional[int] = None) -> List[str]:
    """Open MPI ``--map-by slot``: host of each rank."""
    hosts = parse_hosts(spec)
    order = [h for h, n in hosts for _ in range(n)]
    return order[:np] if np is not None else order


def map_node(spec: str, np: Optional[int] = None) -> List[str]:
    """Open MPI ``--map-by node``: round robin over hosts with free slots."""
    hosts = parse_hosts(spec)
    left = dict(hosts)
    total = np if np is not None else sum(left.values())
    order: List[str] = []
    while len(order) < total:
        for h, _ in hosts:
            if left[h] > 0 and len(order) < total:
                order.append(h)
                left[h] -= 1
    return order


def slurm_block(nodes: Sequence[str], per_node: int) -> List[str]:
    """``srun --distribution=block`` with ``per_node`` tasks on each node."""
    return [n for n in nodes for _ in range(per_node)]


def slurm_cyclic(nodes: Sequence[str], per_node: int) -> List[str]:
    """``srun --distribution=cyclic``: task i on node ``i % len(nodes)``."""
    return [nodes[i % len(nodes)] for i in range(per_node * len(nodes))]


def torchrun_hosts(group_host: Mapping[int, str], nproc: int) -> List[str]:
    """torchrun: host of each rank from the host of each GROUP_RANK (``RANK = GROUP_RANK*nproc + LOCAL_RANK``)."""
    return [group_host[g] for g in sorted(group_host) for _ in range(nproc)]


_PART = re.compile(r"^\s*(\d+)\s*x\s*([0-9.]+)\s*(GiB|MiB|GB|MB)\s*$", re.I)
_UNIT = {"gib": GiB, "mib": MiB, "gb": 10 ** 9, "mb": 10 ** 6}


def _totals(spec: str) -> List[int]:
    out: List[int] = []
    for part in spec.split(","):
        m = _PART.match(part)
        if not m:
            raise ValueError(f"fleet part {part!r}: write COUNTxSIZE such as 2x16GiB")
        out += [int(float(m.group(2)) * _UNIT[m.group(3).lower()])] * int(m.group(1))
    return out


def parse_fleet_spec(spec: str, hosts: Sequence[str]) -> Dict[str, List[int]]:
    """GPU totals (bytes) per host for ``"2x16GiB"`` or ``"hosta=2x80GiB;hostb=2x16GiB;*=1x16GiB"``."""
    if "=" not in spec:
        return {h: _totals(spec) for h in hosts}
    per: Dict[str, List[int]] = {}
    for item in spec.split(";"):
        name, _, value = item.partition("=")
        per[name.strip()] = _totals(value)
    return {h: per.get(h, per.get("*", [])) for h in hosts}


@dataclass
class Expected:
    """One rank's expected placement. ``index`` is the GPU's ordinal as the rank's framework sees it."""

    rank: int
    host: str
    local_rank: int
    index: int
    uuid: str
    shared_by: int
    enforce: bool
    planned_bytes: int

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


Visible = Callable[[int, str, int], Optional[Sequence[int]]]


def expected(rank_hosts: Sequence[str], fleet: Mapping[str, Sequence[int]],
             visible: Optional[Visible] = None) -> List[Expected]:
    """Expected rows, one per rank, given each rank's host (``rank_hosts[r]``) and the fleet per host.

    ``visible(rank, host, local_rank)`` gives the physical GPU indices in that rank's
    CUDA_VISIBLE_DEVICES (None: all of the host's GPUs).
    """
    local: List[int] = []
    seen: Dict[str, int] = {}
    for h in rank_hosts:
        local.append(seen.get(h, 0))
        seen[h] = seen.get(h, 0) + 1
    vis: List[Tuple[int, ...]] = []
    for r, h in enumerate(rank_hosts):
        v = visible(r, h, local[r]) if visible else None
        vis.append(tuple(range(len(fleet[h]))) if v is None else tuple(v))
    # Position among the ranks of the same host that see the same set, in global-rank order.
    pos: List[int] = []
    counter: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    for r, h in enumerate(rank_hosts):
        key = (h, vis[r])
        pos.append(counter.get(key, 0))
        counter[key] = counter.get(key, 0) + 1
    chosen = [(h, vis[r][pos[r] % len(vis[r])]) for r, h in enumerate(rank_hosts)]
    users: Dict[Tuple[str, int], int] = {}
    for c in chosen:
        users[c] = users.get(c, 0) + 1
    rows = []
    for r, h in enumerate(rank_hosts):
        phys = chosen[r][1]
        k = users[chosen[r]]
        rows.append(Expected(rank=r, host=h, local_rank=local[r], index=pos[r] % len(vis[r]),
                             uuid=fleet_uuid(h, phys), shared_by=k, enforce=k > 1,
                             planned_bytes=share_bytes(fleet[h][phys], k)))
    return rows


def compare(want: Sequence[Expected], got: Sequence[Mapping[str, object]]) -> List[str]:
    """Every difference between expected and probed rows, one line each ("rank 2: local_rank 1 != 0")."""
    problems: List[str] = []
    by_rank: Dict[int, Mapping[str, object]] = {}
    claims: Dict[int, List[Mapping[str, object]]] = {}
    for row in got:
        if "error" in row:
            problems.append(f"{row.get('hostname')} pid {row.get('pid')} env {row.get('env')}: {row['error']}")
            continue
        claims.setdefault(int(row["rank"]), []).append(row)  # type: ignore[arg-type]
        by_rank[int(row["rank"])] = row  # type: ignore[arg-type]
    errors = len(problems)
    for rank, rows in sorted(claims.items()):
        if len(rows) > 1:
            problems.append(f"{len(rows)} processes planned as rank {rank}: "
                            + ", ".join(f"{r.get('hostname')} pid {r.get('pid')} env {_launcher_rank(r)}" for r in rows))
    missing = [w.rank for w in want if w.rank not in by_rank]
    if (missing and not errors) or len(by_rank) > len(want):
        problems.append(f"ranks probed {sorted(by_rank)}, expected 0..{len(want) - 1} (missing {missing})")
    for w in want:
        row = by_rank.get(w.rank)
        if row is None or len(claims.get(w.rank, [])) > 1:
            continue  # a rank claimed twice is reported above; its fields would compare a random claimant
        diffs = []
        if row.get("hostname") != w.host:
            diffs.append(f"launcher put it on {row.get('hostname')}, documented {w.host}")
        if row.get("host") != w.host:
            diffs.append(f"host {row.get('host')!r} != {w.host!r}")
        if row.get("local_rank") != w.local_rank:
            diffs.append(f"local_rank {row.get('local_rank')} != {w.local_rank}")
        devs = row.get("devices") or []
        if len(devs) != 1:  # type: ignore[arg-type]
            diffs.append(f"{len(devs)} devices != 1")  # type: ignore[arg-type]
        else:
            d = devs[0]  # type: ignore[index]
            for key, value in (("uuid", w.uuid), ("index", w.index), ("shared_by", w.shared_by),
                               ("enforce", w.enforce), ("planned_bytes", w.planned_bytes)):
                if d.get(key) != value:
                    if key == "planned_bytes" and isinstance(d.get(key), int):
                        diffs.append(f"planned {d[key] // MiB} MiB != {value // MiB} MiB")
                    else:
                        diffs.append(f"{key} {d.get(key)!r} != {value!r}")
        if diffs:
            problems.append(f"rank {w.rank}: " + "; ".join(diffs))
    return problems


def _launcher_rank(row: Mapping[str, object]) -> str:
    env = row.get("env") or {}
    keys = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "HOROVOD_RANK")
    return " ".join(f"{k}={env[k]}" for k in keys if k in env)  # type: ignore[operator,index]


def table(want: Sequence[Expected], got: Sequence[Mapping[str, object]]) -> str:
    """Expected and probed rows side by side, for a failure message."""
    by_rank = {int(r["rank"]): r for r in got if "rank" in r}  # type: ignore[arg-type]
    lines = ["rank | expected host/local/index/uuid/k/enforce/MiB | probed node(hostname)/local/index/uuid/k/enforce/MiB"]
    for w in want:
        r = by_rank.get(w.rank, {})
        d = (r.get("devices") or [{}])[0] if r.get("devices") else {}  # type: ignore[index]
        mib = d.get("planned_bytes")
        lines.append(f"{w.rank:>4} | {w.host}/{w.local_rank}/{w.index}/{w.uuid[:12]}/{w.shared_by}/{w.enforce}/"
                     f"{w.planned_bytes // MiB} | {r.get('host')}({r.get('hostname')})/{r.get('local_rank')}/"
                     f"{d.get('index')}/{str(d.get('uuid'))[:12]}/{d.get('shared_by')}/{d.get('enforce')}/"
                     f"{mib // MiB if isinstance(mib, int) else mib}")
    return "\n".join(lines)
