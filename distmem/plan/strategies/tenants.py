"""Tenants: several named models in one process on one GPU, each on its own logical device.

    plan = distmem.init(strategy="tenants", tenants={"bert": "6GiB", "resnet": "8GiB"})
    with tf.device(plan.device("bert")):      # "/GPU:0"
        bert = build_bert()
    with tf.device(plan.device("resnet")):    # "/GPU:1"
        resnet = build_resnet()

The rank's GPU (local rank ``i`` takes visible GPU ``i % n``, as for data parallelism) is split
into one logical device per tenant, in the order given, each with a hard ``memory_limit`` of the
tenant's size (growth inside it). Once distmem has made only that GPU visible, TensorFlow names
the logical devices ``/GPU:0 .. /GPU:k-1``; ``plan.device(name)`` returns those strings.

Sizes are bytes, ``"6GiB"``, ``"45%"`` of the GPU, a fraction of it, or ``"auto"`` (an equal share of
what the sized tenants leave). They must fit the process's equal share of its GPU (:meth:`distmem.plan.budget.Budget.share`:
``total - driver reserved - reserve - foreign - k x per-process overhead`` split over the ``k``
ranks sharing the GPU, one overhead for the usual one process per GPU): the process's logical
devices share one CUDA context, so the overhead is paid once, not per tenant. A tenant alone on a
GPU gets no more than the data strategy's equal share.

Without a GPU the same flow runs over logical CPU devices (``/CPU:0 .. /CPU:k-1``, created by the
adapter from ``plan.extras["cpu_logical_devices"]``); TensorFlow cannot cap a CPU device, so the
limits are recorded, not enforced, and the plan's warnings and the allocation's notes say so. With a
declared fleet (``DISTMEM_FLEET``, ``distmem plan --gpus``) the plan describes the GPU machine
(``/GPU:k`` strings) and nothing is applied.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ...console import text_table
from ...errors import ConfigError, DoesNotFitError
from ...units import MiB, format_bytes, parse_bytes, plural
from ..budget import floor_mib, slot
from ..strategy import Strategy, option
from ..types import Allocation, Plan
from .text import whole_number

if TYPE_CHECKING:
    from ..request import Context

__all__ = ["TenantsOptions", "STRATEGY", "parse_tenants", "TenantsLike", "tenant_table", "DEFAULT_MAX_TENANTS",
           "MIN_TENANT_BYTES", "AUTO"]

#: Most tenants one process may split a GPU into unless ``max_tenants=`` says otherwise. Each logical
#: device gets its own allocator and streams, and small slices fragment quickly; past a handful,
#: several processes (strategy "data" with a limit) or a larger GPU serve better.
DEFAULT_MAX_TENANTS = 8
#: Smallest slice: TensorFlow takes ``memory_limit`` in whole MiB, and a slice below this cannot hold
#: a model's weights plus one batch of anything.
MIN_TENANT_BYTES = 64 * MiB
#: The size meaning "an equal share of what the sized tenants leave".
AUTO = "auto"

#: ``{name: size}``, ``[(name, size), ...]`` or ``"name=size,..."``.
TenantsLike = Union[Mapping[str, Any], Sequence[Tuple[str, Any]], str]


def parse_tenants(tenants: TenantsLike) -> List[Tuple[str, Any]]:
    """``{"bert": "6GiB", ...}``, ``[("bert", "6GiB"), ...]`` or ``"bert=6GiB,resnet=auto"`` -> ordered pairs.

    Checks names only (non-empty, unique); sizes are read against the GPU by :func:`plan_tenants`.
    """
    if isinstance(tenants, str):
        pairs: List[Tuple[str, Any]] = []
        for item in (p.strip() for p in tenants.split(",")):
            if not item:
                continue
            if "=" not in item:
                raise ConfigError(f"tenants {tenants!r}: cannot read {item!r}; write name=size pairs such as "
                                  "bert=6GiB,resnet=8GiB (size 'auto' takes an equal share of the rest)")
            name, size = item.split("=", 1)
            pairs.append((name.strip(), size.strip()))
    elif isinstance(tenants, Mapping):
        pairs = list(tenants.items())
    elif isinstance(tenants, (list, tuple)):
        try:
            pairs = [(n, s) for n, s in tenants]
        except (TypeError, ValueError):
            raise ConfigError(f"tenants={tenants!r}: give a dict {{name: size}} or a list of (name, size) "
                              "pairs") from None
    else:
        raise ConfigError(f"tenants={tenants!r}: give a dict such as {{'bert': '6GiB', 'resnet': '8GiB'}}")
    if not pairs:
        raise ConfigError("strategy='tenants' needs at least one tenant, e.g. tenants={'bert': '6GiB'}")
    seen = set()
    for name, _ in pairs:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"tenant name {name!r}: give each tenant a non-empty name")
        if name in seen:
            raise ConfigError(f"tenant {name!r} is listed twice; tenant names must be unique")
        seen.add(name)
    return pairs


def _is_auto(size: Any) -> bool:
    return size is None or (isinstance(size, str) and size.strip().lower() == AUTO)


def _size(name: str, size: Any, total: Optional[int]) -> int:
    what = f"tenant {name!r}"
    if isinstance(size, float) and 0 < size <= 1 and total is None:
        raise ConfigError(f"{what}: the fraction {size} of a GPU needs a GPU to refer to and none is visible; give "
                          "bytes such as '6GiB' (or DISTMEM_FLEET=1x16GiB for a dry run)")
    n = parse_bytes(size, total=total, what=what, allow_fraction=True)
    n = floor_mib(n)
    if n < MIN_TENANT_BYTES:
        raise ConfigError(f"{what}: size {size!r} is {format_bytes(n)}, below the smallest slice "
                          f"{format_bytes(MIN_TENANT_BYTES)}; give it more memory or drop it")
    return n


@dataclass
class TenantsOptions:
    tenants: Optional["TenantsLike"] = option(
        None, metavar="NAME=SIZE,...", help="named slices of one GPU, e.g. bert=6GiB,resnet=8GiB (size 'auto': an "
                                            "equal share of the rest)")
    max_tenants: int = option(8, parse=whole_number("max_tenants"), help="most slices per GPU (default 8)")
    framework: Optional[str] = option(None, cli=False, help="recorded only (the request's framework)")


def plan(ctx: "Context", opts: TenantsOptions) -> Plan:
    tenants, max_tenants, memory = opts.tenants, opts.max_tenants, ctx.budget.memory
    budget = ctx.budget
    if tenants is None:
        raise ConfigError("strategy='tenants' needs tenants=, e.g. tenants={'bert': '6GiB', 'resnet': '8GiB'} (on the "
                          "command line --tenants NAME=SIZE,..., e.g. --tenants bert=6GiB,resnet=8GiB)")
    pairs = parse_tenants(tenants)
    if not isinstance(max_tenants, int) or isinstance(max_tenants, bool) or max_tenants < 1:
        raise ConfigError(f"max_tenants={max_tenants!r}: give a whole number, at least 1")
    if len(pairs) > max_tenants:
        raise DoesNotFitError(
            f"{len(pairs)} tenants ({', '.join(n for n, _ in pairs)}) but at most {max_tenants} may share one GPU in "
            f"one process; merge tenants, run the rest in another process, or raise max_tenants=")
    if memory == "growth" and len(pairs) > 1:
        raise ConfigError(f"memory='growth' cannot split a GPU between {len(pairs)} tenants: TensorFlow needs a "
                          "memory_limit on every logical device of a GPU; use memory='auto' (a hard limit per tenant, "
                          "growth inside it)")
    gpus = any(pl.gpus for pl in ctx.places)
    kind = "GPU" if gpus else "CPU"
    devices = {name: f"/{kind}:{k}" for k, (name, _) in enumerate(pairs)}
    allocations: List[Allocation] = []
    summary: List[Dict[str, Any]] = []
    warnings: List[str] = []
    for pl in ctx.places:
        rank, local_rank, host = pl.rank, pl.local_rank, pl.host
        if pl.gpu is not None:
            gpu, k = pl.gpu, pl.shared_by
            sized = {n: _size(n, s, gpu.total_bytes) for n, s in pairs if not _is_auto(s)}
            auto = [n for n, s in pairs if _is_auto(s)]
            capacity = budget.share_or_zero(gpu, k)
            want = sum(sized.values()) + len(auto) * MIN_TENANT_BYTES
            if want > capacity:
                at_least = f"auto (at least {format_bytes(MIN_TENANT_BYTES)})"
                listing = " + ".join(f"{n} {format_bytes(sized[n]) if n in sized else at_least}" for n, _ in pairs)
                per = f"{k} processes share it, so each gets" if k > 1 else "one process gets"
                raise DoesNotFitError(
                    f"tenants {listing} = {format_bytes(want)} do not fit GPU {gpu.index} "
                    f"({format_bytes(gpu.total_bytes)}): {per} {format_bytes(max(capacity, 0))} after driver reserved "
                    f"{format_bytes(gpu.reserved_bytes)}, the reserve {format_bytes(budget.reserve_of(gpu))}, foreign "
                    f"{format_bytes(budget.foreign_of(gpu))} and {k} x per-process overhead "
                    f"{format_bytes(budget.overhead_bytes)}; shrink or drop a tenant, "
                    "lower reserve= or overhead=, run fewer processes per GPU, or use a larger GPU")
            if auto:
                each = floor_mib((capacity - sum(sized.values())) // len(auto))
                sizes = {n: sized.get(n, each) for n, _ in pairs}
            else:
                sizes = sized
            enforce = memory != "growth"
            slots = [slot(gpu, sizes[n], enforce=enforce, shared_by=k, label=n) for n, _ in pairs]
            how = "hard limit" if enforce else "memory growth, budget"
            notes = [f"tenant {n}: {devices[n]} on GPU {gpu.index}, {how} {format_bytes(sizes[n])}"
                     for n, _ in pairs]
            left = capacity - sum(sizes.values())
            if left >= MiB:
                notes.append(f"{format_bytes(left)} of the {format_bytes(capacity)} GPU {gpu.index} offers this "
                             "process stay unassigned (size a tenant 'auto' to give it the rest)")
            alloc = Allocation(rank, local_rank, host, "tenants", "limit" if enforce else "growth", slots,
                               replica=rank, demand_bytes=sum(sizes.values()), breakdown=dict(sizes), notes=notes)
        else:
            sizes_cpu = {n: (None if _is_auto(s) else _size(n, s, None)) for n, s in pairs}
            notes = [f"tenant {n}: {devices[n]} (logical CPU device), limit "
                     f"{format_bytes(sizes_cpu[n]) if sizes_cpu[n] else 'none'} recorded, not enforced (no GPU)"
                     for n, _ in pairs]
            alloc = Allocation(rank, local_rank, host, "tenants", "cpu", [], replica=rank,
                               demand_bytes=sum(v for v in sizes_cpu.values() if v) or None,
                               breakdown={n: v for n, v in sizes_cpu.items() if v}, notes=notes)
            sizes = sizes_cpu  # type: ignore[assignment]
        allocations.append(alloc)
        if rank == ctx.topo.rank:
            summary = [{"name": n, "device": devices[n], "limit_bytes": sizes.get(n),
                        "enforced": bool(gpus) and memory != "growth",
                        "gpu": pl.gpu.index if pl.gpu is not None else None} for n, _ in pairs]
    if not gpus:
        warnings.append(f"no GPU: the {plural(len(pairs), 'tenant')} run on logical CPU devices "
                        f"{', '.join(devices.values())}; their limits are recorded, not enforced")
    extras: Dict[str, Any] = {"devices": devices, "tenants": summary}
    if not gpus and len(pairs) > 1:
        extras["cpu_logical_devices"] = len(pairs)
    options = dict(tenants=[[n, s if isinstance(s, (int, float, str)) or s is None else str(s)] for n, s in pairs],
                   max_tenants=max_tenants, framework=ctx.framework)
    return ctx.make_plan("tenants", allocations, options, extras=extras, warnings=warnings)




def tenant_table(plan: Plan, usage: Optional[Mapping[str, Mapping[str, Optional[int]]]] = None) -> str:
    """This process's tenants as text: name, device, limit, enforced or not, and (``usage``, by
    device string without the leading slash, e.g. ``{"GPU:0": {"current_bytes": .., "peak_bytes": ..}}``)
    the allocator's figures for each logical device."""
    rows = []
    for t in plan.extras.get("tenants") or []:
        u = (usage or {}).get(t["device"].lstrip("/")) or {}
        rows.append([t["name"], t["device"] + (f" (GPU {t['gpu']})" if t.get("gpu") is not None else ""),
                     format_bytes(t["limit_bytes"]), "yes" if t["enforced"] else "no (recorded)",
                     format_bytes(u.get("current_bytes")), format_bytes(u.get("peak_bytes"))])
    lines = text_table(["tenant", "device", "limit", "enforced", "current", "peak"], rows, rule=True)
    if any(t["device"].startswith("/CPU") for t in plan.extras.get("tenants") or []) and usage:
        lines.append("(logical CPU devices share one host allocator: current/peak are the whole process's)")
    return "\n".join(lines)


STRATEGY = Strategy("tenants", "named slices of one GPU, one logical device each", TenantsOptions, plan)
