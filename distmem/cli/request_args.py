"""The command-line words of a plan request, shared by ``distmem plan`` and ``distmem doctor``: the
strategy (every registered one), the framework, the fleet, the job (ranks, hosts, mapping, what each
rank sees), the common options, and each strategy's own options - taken from its options dataclass
(:func:`distmem.plan.strategy.option`), so a new strategy brings its flags with it.

Strategy flags are parsed in two steps: the chosen strategy's flags are offered with their help,
every other strategy's flags are recognised only to say which strategy takes them.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Sequence

from .. import settings
from ..discover.runtime import FRAMEWORK_ALIASES, FRAMEWORKS
from ..errors import ConfigError
from ..plan import JobLayout, PlanRequest, get, names
from ..plan.request import MAPPINGS
from ..plan.strategy import Strategy
from ..units import parse_ratio

__all__ = ["add_request_arguments", "request_from_args", "strategy_in", "flag_of"]

_COMMON = ("memory", "reserve", "overhead", "foreign")



def _margin(text: str) -> str:
    """--from-margin read where it is given (a usage error naming the flag and the value), kept as the
    user wrote it ('10%') for the request, which reads it again by the same rule."""
    try:
        parse_ratio(text, what="--from-margin")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a margin: {exc}") from None
    return text

def flag_of(name: str) -> str:
    """The command-line flag of option ``name``: ``num_stages`` -> ``--num-stages``."""
    return "--" + name.replace("_", "-")


def strategy_in(argv: Optional[Sequence[str]]) -> str:
    """The ``--strategy`` an argument list asks for (``data`` when none), read before parsing."""
    args = list(argv or [])
    for i, a in enumerate(args):
        if a == "--strategy" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--strategy="):
            return a.split("=", 1)[1]
    return "data"


def add_request_arguments(p: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None, *,
                          job: bool = True) -> None:
    """Register the request's flags on ``p``; ``argv`` says which strategy's flags to offer."""
    chosen = strategy_in(argv)
    p.add_argument("--strategy", default="data", metavar="{" + ",".join(names()) + "}",
                   help="; ".join(f"{n}: {_summary(n)}" for n in names()) + " (default data; --strategy NAME --help "
                        "lists its options)")
    p.add_argument("--framework", default=None, choices=FRAMEWORKS + sorted(FRAMEWORK_ALIASES),
                   help="whose allocator defaults apply (default: the one --model names - a torchvision:, hf: or keras: "
                        "spec, a saved Keras file - else what init() detects here: the framework installed; one the model "
                        "contradicts is refused)")
    p.add_argument("--gpus", "--fleet", dest="gpus", metavar="FLEET",
                   help="declared GPUs per host, e.g. 4x80GiB, 2x80GiB,2x40GiB or a=2x80GiB;b=2x16GiB (default: "
                        "DISTMEM_FLEET, else this machine's GPUs from NVML)")
    if job:
        p.add_argument("--ranks", default=None, help="total ranks (default: one per GPU of every host)")
        p.add_argument("--ranks-per-host", default=None, help="ranks on each host (default: --ranks, one host)")
        p.add_argument("--hosts", default=None, metavar="HOST:N,...",
                       help="hosts and their ranks, as horovodrun -H takes them (a:4,b:2; uneven is fine)")
        p.add_argument("--map-by", default="block", choices=list(MAPPINGS),
                       help="block: consecutive ranks per host (mpirun --map-by slot, horovodrun, srun block); "
                            "cyclic: ranks dealt round the hosts (mpirun --map-by node, srun cyclic)")
        p.add_argument("--visible-devices", default=None, metavar="all|own|SPEC",
                       help="what each rank sees: all GPUs of its host, its own one by local rank (srun "
                            "--gpus-per-task=1), or a CUDA_VISIBLE_DEVICES text (default: CUDA_VISIBLE_DEVICES here)")
    p.add_argument("--memory", default=None, choices=["auto", "growth", "limit"],
                   help="auto: growth alone on a GPU, a hard limit when shared (default; DISTMEM_MEMORY); growth: "
                        "never limit; limit: always")
    p.add_argument("--reserve", default=None, help="kept free on every GPU (bytes, 256MiB, 5%%; default 256MiB)")
    p.add_argument("--overhead", default=None,
                   help="per-process memory outside the allocator (default DISTMEM_OVERHEAD, else 768MiB; auto: the "
                        "measured model)")
    p.add_argument("--foreign", default=None, help="memory other jobs hold on each GPU (default 0)")
    p.add_argument("--estimate", default=None, choices=["auto", "measure", "model"],
                   help="how --model is estimated: auto (measured with a few training steps where the hardware is "
                        "at hand, else the model; default), measure, model")
    p.add_argument("--from", dest="from_report", default=None, metavar="REPORT",
                   help="plan from the last run: its report (runs/last/report.json) or run folder; each rank's limit "
                        "is its observed peak (what it needed where it ran out) + --from-margin")
    p.add_argument("--from-margin", dest="from_margin", default=None, metavar="PCT", type=_margin,
                   help="the margin over the last run's peak: 10%% or 0.1 (default 10%%)")
    offered = set()
    try:
        mine = get(chosen)
    except ConfigError:
        mine = None  # reported when the request is resolved, with the known strategies
    if mine is not None:
        for f in mine.fields():
            if f.metadata.get("cli", True):
                _add_option(p, f, offered)
    for n in names():
        for f in _fields_of(n):
            if f.metadata.get("cli", True) and flag_of(f.name) not in offered:
                offered.add(flag_of(f.name))
                p.add_argument(flag_of(f.name), dest=f.name, nargs="?", const=True, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)


def _summary(name: str) -> str:
    try:
        return get(name).summary
    except ConfigError:
        return "not available in this build"


def _fields_of(name: str) -> List[Any]:
    try:
        return get(name).fields()
    except ConfigError:
        return []


def _add_option(p: argparse.ArgumentParser, f: Any, offered: set) -> None:
    meta = f.metadata
    flag = flag_of(f.name)
    offered.add(flag)
    kw: Dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=meta.get("help"))
    if meta.get("flag"):
        kw["action"] = "store_true"
    else:
        if meta.get("choices"):
            kw["choices"] = list(meta["choices"])
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
    p.add_argument(flag, **kw)


def _int(text: Optional[str], what: str) -> Optional[int]:
    if text is None:
        return None
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{what} {text!r}: give a whole number, at least 1") from None
    if value < 1:
        raise ConfigError(f"{what} {text!r}: give a whole number, at least 1")
    return value


def strategy_options(strategy: Strategy, args: argparse.Namespace) -> Dict[str, Any]:
    """The options given on the command line for ``strategy``, read by each option's ``parse``; a
    flag of another strategy is an error naming the strategies that take it."""
    out: Dict[str, Any] = {}
    mine = {f.name: f for f in strategy.fields()}
    for n in names():
        for f in _fields_of(n):
            if f.name in mine or not f.metadata.get("cli", True) or not hasattr(args, f.name):
                continue
            takers = [s for s in names() if any(g.name == f.name for g in _fields_of(s))]
            raise ConfigError(f"{flag_of(f.name)} applies to --strategy {' or '.join(takers)}, not --strategy "
                              f"{strategy.name}; drop it or change the strategy")
    for name, f in mine.items():
        if not f.metadata.get("cli", True) or not hasattr(args, name):
            continue
        value = getattr(args, name)
        parse = f.metadata.get("parse")
        if parse is not None and not isinstance(value, bool):
            value = parse(value)
        out[name] = value
    return out


def request_from_args(args: argparse.Namespace, *, job: bool = True, env: Any = None) -> PlanRequest:
    """The :class:`PlanRequest` the parsed flags ask for: a whole declared job (``job``), or this
    process as launched."""
    strategy = get(args.strategy)
    options = strategy_options(strategy, args)
    from ..api import resolve_overhead  # measured on this machine's GPU where init() would measure it

    request = PlanRequest(strategy=args.strategy, options=options, framework=args.framework, memory=args.memory,
                          reserve=args.reserve,
                          overhead=resolve_overhead(args.overhead if args.overhead is not None else
                                                    settings.overhead(env), args.framework),
                          foreign=args.foreign or 0, fleet=args.gpus, env=env, fleet_what="--gpus",
                          estimate=args.estimate, from_report=getattr(args, "from_report", None),
                          from_margin=getattr(args, "from_margin", None))
    if job:
        fleet, what = request.resolved_fleet()
        gpus_here = 0
        if not fleet:
            from ..discover.gpus import inventory

            gpus_here = len(inventory(quiet=True).gpus)
        request.job = JobLayout.declare(ranks=_int(args.ranks, "--ranks"),
                                        ranks_per_host=_int(args.ranks_per_host, "--ranks-per-host"),
                                        hosts=args.hosts, mapping=args.map_by,
                                        visible=args.visible_devices, fleet=fleet, fleet_what=what,
                                        gpus_per_host=gpus_here if not fleet else _gpus_of_first_host(fleet, what))
    return request


def _gpus_of_first_host(fleet: str, what: str) -> int:
    from ..discover.gpus import fleet_hosts, parse_fleet

    hosts = list(fleet_hosts(fleet, what))
    first = hosts[0] if hosts and hosts[0] != "*" else None
    return len(parse_fleet(fleet, first, what))
