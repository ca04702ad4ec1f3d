"""One plan request: every door (``init``, ``plan_from_env``, ``distmem plan``, ``distmem doctor``,
``distmem fit``, ``strategy="auto"``, ``--emit k8s``) plans through :class:`PlanRequest`.

The request resolves, once and in this order: the ``DISTMEM_*`` settings (checked before anything
else, so a laptop refuses what a GPU node would); the strategy and its options (an unknown option
is an error naming the strategies that take it); the framework and the defaults that follow from
it (headroom, reserve, overhead: :mod:`distmem.defaults`); where the ranks run and which GPUs
each sees - the job as launched (this process's launcher, NVML or the declared fleet of its host
after ``CUDA_VISIBLE_DEVICES``, the host's other ranks through the bounded exchange) or a whole job
declared for a dry run (:class:`JobLayout`: hosts and their ranks, block or cyclic mapping, what
each rank sees, every host with its own GPUs of a per-host fleet) - and the budget
(:mod:`distmem.plan.budget`). The strategy then plans from the :class:`Context`. A dry run is the
real run minus the hardware: the same job asked at any door plans the same bytes, mode and GPU
for every rank, or raises the same error.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from .. import defaults, settings
from ..discover import runtime
from ..discover import gpus as discover_gpus
from ..discover.gpus import Gpu, Inventory, fleet_hosts, fleet_inventory, parse_fleet, parse_visible_devices
from ..discover.identity import Topology
from ..discover.layout import Layout, RankView
from ..errors import ConfigError
from ..units import SizeLike, parse_ratio, plural
from .budget import Budget, resolve_budget
from .places import Place, places
from .strategy import Strategy, get, make_options
from .types import Allocation, Plan

__all__ = ["PlanRequest", "JobLayout", "Context", "MAPPINGS", "MAX_RANKS", "REQUEST_ARGUMENTS", "worst_host", "job_hosts",
           "used_gpus", "plan_in", "ESTIMATE_METHODS", "refuse_framework_mismatch"]

#: How a launcher maps ranks to hosts: ``block`` fills each host in turn (mpirun --map-by slot,
#: horovodrun -H, srun --distribution=block); ``cyclic`` deals ranks round the hosts (mpirun
#: --map-by node, srun --distribution=cyclic).
MAPPINGS = ("block", "cyclic")
#: How ``model=`` is estimated (:func:`distmem.estimate.estimate`'s ``method``).
ESTIMATE_METHODS = ("auto", "measure", "model")
#: The most ranks a declared job may have (a dry run builds every rank's view).
MAX_RANKS = 1_000_000


@dataclass(frozen=True)
class JobLayout:
    """A whole job declared for a dry run: ``hosts`` in launch order with their rank counts, the
    ``mapping`` of ranks to hosts (:data:`MAPPINGS`) and what each rank sees: ``visible`` None
    (what ``CUDA_VISIBLE_DEVICES`` says in the environment, as a launched rank would inherit),
    ``"all"`` (every GPU of its host), ``"own"`` (one GPU each, by local rank, as ``srun
    --gpus-per-task=1`` gives) or a ``CUDA_VISIBLE_DEVICES`` text every rank gets."""

    hosts: Tuple[Tuple[str, int], ...]
    mapping: str = "block"
    visible: Optional[str] = None

    @property
    def size(self) -> int:
        return sum(n for _, n in self.hosts)

    def ranks(self) -> List[Tuple[str, int]]:
        """``(host, local rank)`` of every rank, in rank order."""
        if self.mapping == "block":
            return [(h, lr) for h, n in self.hosts for lr in range(n)]
        out: List[Tuple[str, int]] = []
        left = {h: n for h, n in self.hosts}
        seen = {h: 0 for h, _ in self.hosts}
        while len(out) < self.size:
            for h, _ in self.hosts:
                if left[h]:
                    out.append((h, seen[h]))
                    seen[h] += 1
                    left[h] -= 1
        return out

    @classmethod
    def declare(cls, *, ranks: Optional[int] = None, ranks_per_host: Optional[int] = None,
                hosts: Optional[str] = None, mapping: str = "block", visible: Optional[str] = None,
                fleet: Optional[str] = None, gpus_per_host: int = 1, fleet_what: str = "fleet") -> "JobLayout":
        """The job from the command line's words: ``hosts`` as ``a:4,b:2`` (horovodrun's ``-H``), or
        ``ranks`` in hosts of ``ranks_per_host`` named after the fleet's hosts in order
        (``a=2x80GiB;b=2x16GiB``; ``host0``, ``host1``... otherwise); by default one rank per GPU on
        every host the fleet names. Every count is checked, with the value and the remedy."""
        if mapping not in MAPPINGS:
            raise ConfigError(f"mapping {mapping!r} is not one of {', '.join(MAPPINGS)} (block: consecutive ranks per "
                              "host; cyclic: ranks dealt round the hosts)")
        for value, what in ((ranks, "--ranks"), (ranks_per_host, "--ranks-per-host")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{what} {value!r}: give a whole number of ranks, at least 1")
            if value is not None and value > MAX_RANKS:
                raise ConfigError(f"{what} {value}: a dry run plans at most {MAX_RANKS:,} ranks")
        named = _fleet_host_names(fleet, fleet_what)
        if hosts:
            pairs = _parse_hosts(hosts)
            total = sum(n for _, n in pairs)
            if ranks is not None and ranks != total:
                raise ConfigError(f"--ranks {ranks} but --hosts {hosts!r} holds {total} ranks; give one of them")
            if ranks_per_host is not None:
                raise ConfigError(f"--ranks-per-host {ranks_per_host} and --hosts {hosts!r} both say how many ranks run "
                                  "on each host; give one of them")
            return cls(tuple(pairs), mapping, visible)
        if named and ranks_per_host is None:
            # a per-host fleet names the job's hosts: one rank per GPU on each, or the ranks given
            # spread over them in proportion to their GPUs
            gpus = [max(len(parse_fleet(fleet or "", h, fleet_what)), 1) for h in named]
            return cls(tuple(zip(named, _spread(ranks, named, gpus, fleet or "", fleet_what))), mapping, visible)
        per = ranks_per_host or ranks or max(gpus_per_host, 1)
        total = ranks or (per * len(named) if named else per)
        count = -(-total // per)
        if count > len(named):
            fills = fleet is None or "*" in fleet_hosts(fleet, fleet_what) or not named
            if not fills:
                raise ConfigError(
                    f"{plural(total, 'rank')} at {per} per host need {plural(count, 'host')}, but the fleet {fleet!r} "
                    f"declares {plural(len(named), 'host')} ({', '.join(named)}) and no default; add *=COUNTxSIZE "
                    "for the others, name every host, or run fewer ranks")
            named = named + [f"host{i}" for i in range(len(named), count)]
        names = named[:count]
        sizes = [per] * count
        sizes[-1] = total - per * (count - 1)
        return cls(tuple(zip(names, sizes)), mapping, visible)


def _spread(ranks: Optional[int], named: Sequence[str], gpus: Sequence[int], fleet: str, what: str) -> List[int]:
    """The ranks of each host a per-host fleet names: one per GPU, or ``ranks`` in proportion to the
    hosts' GPUs; ConfigError with a ``--hosts`` that says it where the proportion is not whole."""
    total = sum(gpus)
    if ranks is None:
        return list(gpus)
    if all(ranks * g % total == 0 for g in gpus):
        return [ranks * g // total for g in gpus]
    share = [ranks * g // total for g in gpus]  # the rest to the largest remainders, in fleet order
    for i in sorted(range(len(gpus)), key=lambda i: -(ranks * gpus[i] % total))[:ranks - sum(share)]:
        share[i] += 1
    hosts = ",".join(f"{h}:{n}" for h, n in zip(named, share) if n)
    each = ", ".join(f"{h}: {plural(g, 'GPU')}" for h, g in zip(named, gpus))
    raise ConfigError(f"--ranks {ranks} over the {plural(len(named), 'host')} the fleet {what}={fleet!r} names ({each}) "
                      f"do not split in proportion to their GPUs; say where they run (--hosts {hosts}, or "
                      f"--ranks-per-host N), or give a multiple of {total // _gcd(gpus)} ranks")


def _gcd(values: Sequence[int]) -> int:
    import math

    out = 0
    for v in values:
        out = math.gcd(out, v)
    return max(out, 1)


def _fleet_host_names(fleet: Optional[str], what: str = "fleet") -> List[str]:
    if not fleet:
        return []
    return [h for h in fleet_hosts(fleet, what) if h != "*"]


def job_hosts(fleet: str, count: int) -> List[str]:
    """The first ``count`` hosts of a per-host fleet, in its order (then ``*``'s, as host0, host1...),
    as :meth:`JobLayout.declare` names them."""
    named = _fleet_host_names(fleet)
    if count > len(named) and "*" in fleet_hosts(fleet):
        named = named + [f"host{i}" for i in range(len(named), count)]
    return named[:count]


def _parse_hosts(text: str) -> List[Tuple[str, int]]:
    out: List[Tuple[str, int]] = []
    for item in (p.strip() for p in str(text).split(",")):
        if not item:
            continue
        name, sep, count = item.rpartition(":")
        try:
            n = int(count) if sep else None
        except ValueError:
            n = None
        if not sep or not name or n is None or n < 1:
            raise ConfigError(f"--hosts {text!r}: cannot read {item!r}; write HOST:RANKS pairs such as a:4,b:2 (as "
                              "horovodrun -H takes them)")
        if any(h == name for h, _ in out):
            raise ConfigError(f"--hosts {text!r}: host {name!r} is listed twice")
        out.append((name, n))
    if not out:
        raise ConfigError(f"--hosts {text!r}: give HOST:RANKS pairs such as a:4,b:2")
    if sum(n for _, n in out) > MAX_RANKS:
        raise ConfigError(f"--hosts {text!r}: a dry run plans at most {MAX_RANKS:,} ranks")
    return out


def worst_host(host_gpus: Sequence[Sequence[Gpu]]) -> List[Gpu]:
    """One host whose GPU ``i`` is the smallest GPU ``i`` of all ``host_gpus`` (what CUDA can hand out),
    as many GPUs as the host with the fewest: a layout gives every host the same ranks, so one that
    fits this host fits every host, whichever host each stage lands on."""
    if not host_gpus:
        return []
    count = min(len(g) for g in host_gpus)
    return [replace(min((h[i] for h in host_gpus), key=lambda g: (g.total_bytes - g.reserved_bytes, g.total_bytes)),
                    index=i) for i in range(count)]


@dataclass
class Context:
    """What a strategy plans from, resolved once by :meth:`PlanRequest.context`.

    ``topo``: this rank (the job as launched) or rank 0 (a declared job); ``inventory`` its host's
    GPUs as it sees them. ``layout``: the ranks
    known here - this host's (observed) or the whole job's (declared) - and ``places`` where each
    runs. ``host_gpus``: every host's GPUs where known (declared job, per-host fleet), else this
    host's for each host. ``budget``: the common options in bytes. ``source``: where GPU totals
    came from (``nvml``, ``fleet:<spec>``, ``none``). ``given_overhead``: the overhead in bytes when
    the caller or ``DISTMEM_OVERHEAD`` gave one (``fit`` models it per layout otherwise).
    """

    topo: Topology
    inventory: Inventory
    layout: Layout
    places: List[Place]
    budget: Budget
    framework: str
    source: str
    host_gpus: List[List[Gpu]]
    declared: bool = False
    given_overhead: Optional[int] = None  #: the overhead the caller or DISTMEM_OVERHEAD gave (None: default or modelled)
    estimate_method: str = "auto"  #: how model= is estimated: auto (measured where it can), measure, model
    #: In a launched job of several ranks: runs a computation on rank 0 and hands every rank its
    #: result (or its error), so what is measured once is planned alike everywhere. None: compute here.
    agree: Optional[Callable[[Callable[[], Any]], Any]] = None
    warnings: List[str] = field(default_factory=list)
    #: What the last run used (``from_report=``): the plan's limits follow it (distmem.plan.from_report).
    observed: Optional[Any] = None
    observed_margin: Optional[float] = None
    #: the environment the request read (``HOROVOD_*`` says which wrapper's buffers a plan counts)
    env: Mapping[str, str] = field(default_factory=dict)

    def agreed(self, compute: Callable[[], Any]) -> Any:
        """``compute()``'s result, the same on every rank of the job (see :attr:`agree`)."""
        return compute() if self.agree is None else self.agree(compute)

    def estimate_layers(self, model: Any, **options: Any) -> List[Any]:
        """Per-layer costs of ``model`` (:func:`distmem.plan.layers.estimate_layers`) with the request's
        estimate method; in a job of several ranks rank 0 measures and every rank plans from that
        one measurement, so every rank plans the same bytes."""
        from .layers import estimate_layers

        method = self.estimate_method
        if self.agree is None:
            return estimate_layers(model, method=method, **options)[0]
        measured = self.agree(lambda: estimate_layers(model, method=method, **options)[1])
        usable = measured if measured and "fallback" not in measured else None
        return estimate_layers(model, method=method if usable else "model", measurement=usable, **options)[0]

    def seen_gpus(self) -> Dict[str, Set[str]]:
        """Per host, the UUIDs of the GPUs its known ranks can see."""
        seen: Dict[str, Set[str]] = {}
        for p in self.places:
            seen.setdefault(p.host, set()).update(g.uuid for g in p.gpus)
        return seen

    def ranks_per_host(self, what: str) -> int:
        """The ranks every host runs (a strategy's default that assumes equal hosts, e.g. one
        pipeline per host); ConfigError naming ``what`` to give where the declared hosts differ."""
        if self.declared:
            counts = sorted({n for n in _host_counts(self.layout).values()})
            if len(counts) > 1:
                raise ConfigError(f"the hosts run different numbers of ranks ({_describe_counts(self.layout)}), so the "
                                  f"default {what} (the ranks per host) is not one number; give {what}=")
        return self.topo.local_size

    def make_plan(self, strategy: str, allocations: List[Allocation], options: Mapping[str, Any], *,
                  extras: Optional[Dict[str, Any]] = None, warnings: Optional[List[str]] = None) -> Plan:
        """The :class:`Plan` of ``allocations``: the budget's options and the strategy's ``options``
        recorded in it (they make the job-wide fingerprint)."""
        opts = self.budget.to_options()
        opts.update(options)
        return Plan(strategy, self.topo.size, self.topo.rank, sorted(allocations, key=lambda a: a.rank), self.source,
                    self.budget.overhead_bytes, self.budget.reserve_bytes, options=opts, extras=dict(extras or {}),
                    warnings=list(warnings or []))


def used_gpus(views: Sequence[RankView]) -> List[Gpu]:
    """The GPUs a host's ranks can see together, in the host's order (NVML index), numbered 0..n-1:
    what the ``auto`` strategy and ``fit`` hold that host's layouts against."""
    found: Dict[str, Gpu] = {}
    for v in views:
        for g in v.gpus:
            found.setdefault(g.uuid, g)
    ordered = sorted(found.values(), key=lambda g: (g.nvml_index if g.nvml_index is not None else g.index, g.uuid))
    return [replace(g, index=i) for i, g in enumerate(ordered)]


def plan_in(ctx: Context, strategy: Strategy, opts: Any) -> Plan:
    """``strategy``'s plan from ``ctx``, with what resolving the request had to say."""
    plan = strategy.plan(ctx, opts)
    if ctx.observed is not None:
        from .from_report import apply_observed

        apply_observed(plan, ctx.observed, ctx, ctx.observed_margin)
    plan.warnings.extend(w for w in ctx.warnings if w not in plan.warnings)
    return plan


def _takes_a_model(opts: Any) -> bool:
    return getattr(opts, "model", None) is not None


def _host_counts(layout: Layout) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for v in layout.views:
        counts[v.host] = counts.get(v.host, 0) + 1
    return counts


def _describe_counts(layout: Layout) -> str:
    return ", ".join(f"{h}: {n}" for h, n in _host_counts(layout).items())


@dataclass
class PlanRequest:
    """A plan asked for: the strategy and its options, the common options (None: the setting or the
    default), a declared ``fleet``, and either the job as launched (``job=None``) or a whole
    declared job (:class:`JobLayout`). ``env``: the environment read (default ``os.environ``).
    ``topology``/``inventory``/``layout``: given instead of discovered (pure callers, tests)."""

    strategy: str = field(default="data", metadata={"argument": True})
    options: Dict[str, Any] = field(default_factory=dict)
    framework: Optional[str] = field(default=None, metadata={"argument": True})
    memory: Optional[str] = field(default=None, metadata={"argument": True})
    reserve: Optional[SizeLike] = field(default=None, metadata={"argument": True})
    limit: Optional[SizeLike] = field(default=None, metadata={"argument": True})
    overhead: Optional[Any] = field(default=None, metadata={"argument": True})
    foreign: SizeLike = field(default=0, metadata={"argument": True})
    fleet: Optional[str] = field(default=None, metadata={"argument": True})
    estimate: Optional[str] = field(default=None, metadata={"argument": True})
    #: The last run's report (or run folder): each rank's limit from its observed peak + ``from_margin``
    #: (default :data:`distmem.defaults.FROM_REPORT_MARGIN`), see :mod:`distmem.plan.from_report`.
    from_report: Optional[str] = field(default=None, metadata={"argument": True})
    from_margin: Optional[Union[float, str]] = field(default=None, metadata={"argument": True})
    job: Optional[JobLayout] = None
    env: Optional[Mapping[str, str]] = None
    topology: Optional[Topology] = None
    inventory: Optional[Inventory] = None
    layout: Optional[Layout] = None
    fleet_what: str = "fleet"
    #: Seconds the host-local exchange may wait (None: DISTMEM_LAYOUT_TIMEOUT); with ``assume_on_timeout``
    #: a rank whose host's other ranks do not arrive plans as if they saw its GPUs (distmem doctor).
    exchange_timeout: Optional[float] = None
    assume_on_timeout: bool = False
    notes: List[str] = field(default_factory=list)
    #: How a launched job of several ranks agrees on what rank 0 computed (the facade gives the
    #: job's transport); None where there is none yet.
    agree: Optional[Callable[[Callable[[], Any]], Any]] = None

    # -- what the request reads ------------------------------------------------------------------

    @property
    def environ(self) -> Mapping[str, str]:
        return os.environ if self.env is None else self.env

    def resolved_strategy(self) -> Strategy:
        return get(self.strategy)

    def resolved_framework(self) -> str:
        """The framework given, else the one the model names (its spec's kind, or the object), else the
        one imported or installed here: ``distmem plan --model torchvision:resnet50`` on a node with
        TensorFlow installed plans a torch model's stages, not TensorFlow's."""
        named = _model_framework(self.options.get("model"))
        if self.framework is None:
            return named or runtime.detect_framework(None)
        refuse_framework_mismatch(self.framework, self.options.get("model"), named)
        return runtime.detect_framework(self.framework)

    def resolved_fleet(self) -> Tuple[Optional[str], str]:
        """The declared fleet and the name it goes by in errors (``fleet`` / ``--gpus`` / ``DISTMEM_FLEET``)."""
        if self.fleet:
            return self.fleet, self.fleet_what
        text = settings.fleet(self.environ)
        return text, "DISTMEM_FLEET"

    def strategy_options(self, strategy: Strategy) -> Any:
        """The strategy's options dataclass: the given options, ``limit`` where the strategy takes it
        (``DISTMEM_LIMIT`` when not given), an error where it does not."""
        given = dict(self.options)
        takes = {f.name for f in strategy.fields()}
        if self.limit is not None:
            if "limit" not in takes:
                raise ConfigError(f"limit= applies to strategy='data'; strategy={strategy.name!r} derives limits from "
                                  "its own inputs (stages, layers or tenants)")
            given["limit"] = self.limit
        elif "limit" in takes and given.get("limit") is None:
            env_limit = settings.limit(self.environ)
            if env_limit is not None:
                given["limit"] = env_limit
        elif "limit" not in takes and settings.limit(self.environ) is not None:
            raise ConfigError(f"DISTMEM_LIMIT={settings.limit(self.environ)!r} applies to strategy='data'; "
                              f"strategy={strategy.name!r} derives limits from its own inputs; unset DISTMEM_LIMIT")
        if "framework" in takes and given.get("framework") is None:
            given["framework"] = self.resolved_framework()
        return make_options(strategy, given, REQUEST_ARGUMENTS)

    # -- resolution ------------------------------------------------------------------------------

    def context(self) -> Tuple[Context, Strategy, Any]:
        """Resolve everything (see the module docstring): the context, the strategy and its options."""
        env = self.environ
        settings.validate(env)
        # the one rule for ratios: 10% or 0.1, never a bare 10 (+1000%)
        margin = None if self.from_margin is None else parse_ratio(
            self.from_margin, what="from_margin", default_hint=f"{defaults.FROM_REPORT_MARGIN:g} (the default)")
        strategy = self.resolved_strategy()
        opts = self.strategy_options(strategy)
        framework = self.resolved_framework()
        memory = self.memory if self.memory is not None else (settings.memory(env) or "auto")
        overhead = self.overhead if self.overhead is not None else settings.overhead(env)
        modelled = overhead in ("auto", "measure")
        if modelled:
            overhead = _modelled_overhead(framework, overhead)
        headroom: Any = defaults.LIMIT_HEADROOM
        if strategy.derives_limits:
            given = getattr(opts, "headroom", None)
            # a strategy that chooses torch layouts whose limits init() runs with expandable segments
            # (strategy="auto" unless the user turned them off) plans them with the headroom they need
            xs = (hasattr(opts, "expandable_segments")
                  and settings.torch_expandable_allowed(opts.expandable_segments, env))
            headroom = given if given is not None else defaults.headroom(framework, enforced=memory != "growth",
                                                                         expandable=xs)
        reserve = defaults.RESERVE if self.reserve is None else self.reserve
        # Checked before the GPUs are looked at, so a laptop refuses what a GPU node would.
        budget = resolve_budget(memory=memory, reserve=reserve, overhead=overhead, foreign=self.foreign,
                                headroom=headroom)
        topo, inv, layout, host_gpus, declared = self._where()
        budget = resolve_budget(memory=memory, reserve=reserve, overhead=overhead, foreign=self.foreign,
                                headroom=headroom)
        if hasattr(opts, "headroom"):
            opts = replace(opts, headroom=budget.headroom)
        method = self.estimate if self.estimate is not None else "auto"
        if method not in ESTIMATE_METHODS:
            raise ConfigError(f"estimate={method!r}: use auto (measured where the hardware is at hand, else the model), "
                              "measure or model")
        warnings: List[str] = []
        agree = None
        if not declared and topo.size > 1 and self.topology is None:
            agree = self.agree
            if agree is None and method != "model" and _takes_a_model(opts):
                warnings.append("model= was estimated from the model alone: a measured estimate is made once per job, "
                                "on rank 0, and needs the job's transport at init() (hvd.init(), torch.distributed or "
                                "mpirun with mpi4py first); pass estimate='model' to say so, or call init() later")
                method = "model"
        ctx = Context(topo, inv, layout, places(layout), budget, framework, inv.source, host_gpus, declared,
                      None if overhead is None or modelled else budget.overhead_bytes, method, agree, warnings,
                      env=dict(self.environ))
        if self.from_report:
            from .from_report import read_observed

            ctx.observed, ctx.observed_margin = read_observed(str(self.from_report)), margin
            ctx.warnings.extend(f"--from: left out {line}" for line in ctx.observed.ignored[:8])
        return ctx, strategy, opts

    def plan(self) -> Plan:
        """The plan: resolve, then let the strategy plan from the context."""
        ctx, strategy, opts = self.context()
        return plan_in(ctx, strategy, opts)

    def _where(self) -> Tuple[Topology, Inventory, Layout, List[List[Gpu]], bool]:
        """Where the ranks run: (this rank or rank 0, its host's GPUs, the layout known here, every
        host's GPUs, whether the job is declared)."""
        if self.topology is not None:
            inv = self.inventory or Inventory([], "none")
            from ..discover.layout import assumed

            if self.layout is None and self.topology.size % max(self.topology.local_size, 1):
                raise ConfigError(
                    f"{plural(self.topology.size, 'rank')} do not divide into hosts of {self.topology.local_size} ranks: a "
                    "topology alone says every host runs local_size ranks; declare uneven hosts with a JobLayout "
                    "(distmem plan --hosts a:4,b:2) or pass the observed layout")
            layout = self.layout or assumed(self.topology, inv)
            return self.topology, inv, layout, [list(inv.gpus)] * self.topology.num_hosts, self.layout is None
        if self.job is not None:
            return self._declared(self.job)
        return self._launched()

    def _launched(self) -> Tuple[Topology, Inventory, Layout, List[List[Gpu]], bool]:
        from ..discover import identity
        from ..discover.layout import LayoutTimeoutError, exchange

        env = self.environ
        topo = identity.detect(env)
        fleet, what = self.resolved_fleet()
        if fleet:
            parse_fleet(fleet, topo.host, what)  # a bad fleet is an error on every machine
        inv = discover_gpus.inventory(env=dict(env), quiet=True)
        if not inv.gpus and fleet:
            inv = fleet_inventory(fleet, topo.host, env.get("CUDA_VISIBLE_DEVICES"), what)
        try:
            layout = exchange(topo, inv, env=dict(env), timeout=self.exchange_timeout)
        except LayoutTimeoutError as exc:
            if not self.assume_on_timeout:
                raise
            self.notes.append(f"the other ranks of {topo.host} did not answer ({exc}); planned as if they see this "
                              "rank's GPUs")
            layout = Layout(topo.size, [RankView(topo.rank, topo.host, topo.local_rank, list(inv.gpus), os.getpid())]
                            + [RankView(-1 - lr, topo.host, lr, list(inv.gpus)) for lr in range(topo.local_size)
                               if lr != topo.local_rank], "launcher")
        mine = used_gpus([v for v in layout.views if v.host == topo.host])
        host_gpus = [mine] * topo.num_hosts
        if fleet and not inv.real and _fleet_host_names(fleet):
            # A per-host fleet declares the other hosts too (the job's hosts are its first ones, in order);
            # their ranks are taken to see the GPUs at the positions this host's ranks see.
            positions = [g.nvml_index for g in mine]
            host_gpus = []
            for h in job_hosts(fleet, topo.num_hosts):
                theirs = fleet_inventory(fleet, h, None, what).gpus
                host_gpus.append(mine if h == topo.host else
                                 [replace(theirs[p], index=i) for i, p in enumerate(positions) if p < len(theirs)])
        return topo, inv, layout, host_gpus, False

    def _declared(self, job: JobLayout) -> Tuple[Topology, Inventory, Layout, List[List[Gpu]], bool]:
        env = self.environ
        fleet, what = self.resolved_fleet()
        local = None if fleet else discover_gpus.inventory(env=dict(env), quiet=True)
        spec_env = env.get("CUDA_VISIBLE_DEVICES")
        all_gpus: Dict[str, List[Gpu]] = {}
        views: List[RankView] = []
        for rank, (host, local_rank) in enumerate(job.ranks()):
            if host not in all_gpus:
                all_gpus[host] = list(fleet_inventory(fleet, host, None, what).gpus) if fleet else \
                    list(local.gpus if local is not None else [])
            count = len(all_gpus[host])
            if job.visible == "own":
                if local_rank >= count:
                    raise ConfigError(f"--visible-devices own gives every rank one GPU of its host, but {host} runs "
                                      f"more ranks than its {plural(count, 'GPU')}; run at most {count} there")
                spec: Optional[str] = str(local_rank)
            elif job.visible == "all":
                spec = None
            else:
                spec = job.visible if job.visible is not None else spec_env
            gpus = _visible(all_gpus[host], spec, fleet, host, what)
            views.append(RankView(rank, host, local_rank, gpus))
        first_host = views[0].host
        counts = _host_counts(Layout(job.size, views))
        topo = Topology(rank=0, size=job.size, local_rank=0, local_size=counts[first_host], host=first_host,
                        source="declared", launcher="dry-run")
        source = f"fleet:{fleet}" if fleet else (local.source if local is not None else "none")
        inv = Inventory(list(views[0].gpus), source, note="declared job (dry run): planned, not applied")
        host_gpus = [used_gpus([v for v in views if v.host == h]) for h in counts]
        return topo, inv, Layout(job.size, views, "declared"), host_gpus, True


#: The request's own arguments (beside the strategy's options), named in unknown-argument errors.
REQUEST_ARGUMENTS = tuple(f.name for f in fields(PlanRequest) if f.metadata.get("argument"))


def _visible(gpus: List[Gpu], spec: Optional[str], fleet: Optional[str], host: str, what: str) -> List[Gpu]:
    """A host's GPUs as a rank with ``CUDA_VISIBLE_DEVICES=spec`` sees them (re-indexed)."""
    if fleet:
        return list(fleet_inventory(fleet, host, spec, what).gpus)
    chosen = parse_visible_devices(spec, [g.uuid for g in gpus])
    return [replace(gpus[int(v)], index=o) for o, v in enumerate(chosen)]


def _modelled_overhead(framework: str, how: str) -> int:
    """overhead='auto' in a dry run: the measured model of memory outside the allocator
    (:mod:`distmem.plan.outside`), NCCL's buffers included when the job runs NCCL now."""
    if how == "measure":
        raise ConfigError("overhead='measure' needs a GPU seen by NVML and framework='torch' (it runs a short PyTorch "
                          "probe in init()); pass overhead='768MiB', your own figure, or overhead='auto'")
    from .outside import nccl_env, outside_allocator_bytes

    return outside_allocator_bytes(framework if framework in ("torch", "tensorflow") else "torch",
                                   nccl_communicators=runtime.nccl_communicators(),
                                   nccl_buffsize=nccl_env(os.environ)["buffsize"])


def refuse_framework_mismatch(asked: Any, model: Any, named: Optional[str] = None) -> None:
    """Refuse a framework given explicitly (``--framework``, ``framework=``; ``asked``) that the
    model contradicts (a ``torchvision:`` spec planned as TensorFlow was priced with TensorFlow's
    rules without a word); ``named``: what the model is, where known otherwise (a built model's
    costs), else what its spec or object says (nothing: no refusal)."""
    if asked is None or model is None:
        return
    given = runtime.detect_framework(asked)
    named = named or _model_framework(model)
    both = ("torch", "tensorflow")
    if named in both and given in both and named != given:
        shown = model if isinstance(model, str) else type(model).__name__
        raise ConfigError(f"framework={asked!r} was given, but the model {shown!r} is a {named} model: its memory is "
                          f"planned by {named}'s rules; give framework={named!r} or leave the framework out (the "
                          f"model names its own)")


def _model_framework(model: Any) -> Optional[str]:
    """``"torch"`` / ``"tensorflow"`` where ``model`` says which it is without being built (a
    ``torchvision:`` / ``hf:`` / ``keras:`` spec, a saved Keras file, a built model); None where
    only building it would tell (``module:factory``) or there is no model."""
    if model is None:
        return None
    from ..estimate.loader import framework_of, spec_framework

    if isinstance(model, str):
        kind = spec_framework(model)
    else:
        try:
            kind = framework_of(model)
        except ConfigError:
            return None
    return runtime.detect_framework(kind) if kind else None

