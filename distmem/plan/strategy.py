"""The strategy protocol and its registry: every strategy is one module with a name, an options
dataclass and ``plan(context, options) -> Plan``. Pure.

The options dataclass is the strategy's whole interface: its fields are the keyword arguments
``init()`` and ``plan_from_env()`` accept for it, the flags ``distmem plan`` and ``distmem doctor``
offer (:func:`option` carries each flag's help and how its text is read), and the list an unknown
argument is checked against. Adding a strategy is one module under ``distmem/plan/strategies/``
that defines ``STRATEGY`` and one line in :data:`BUILTIN`, or :func:`register` from outside.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import ConfigError

if TYPE_CHECKING:
    from .request import Context
    from .types import Plan

__all__ = ["Strategy", "option", "register", "get", "names", "option_fields", "make_options", "BUILTIN"]


def option(default: Any = None, *, help: str, parse: Optional[Callable[[str], Any]] = None,
           metavar: Optional[str] = None, choices: Optional[Sequence[str]] = None, flag: bool = False,
           cli: bool = True) -> Any:
    """A strategy option: a dataclass field whose metadata says how the command line offers it.

    ``help``: the flag's help. ``parse``: text -> value (default: the text as given). ``flag``: a
    switch without a value (``--recompute``). ``cli=False``: Python only (a model object).
    """
    return field(default=default, metadata={"help": help, "parse": parse, "metavar": metavar, "choices": choices,
                                            "flag": flag, "cli": cli})


@dataclass(frozen=True)
class Strategy:
    """One strategy: ``name``, a one-line ``summary`` (the CLI's help), its ``options`` dataclass and
    ``plan(context, options) -> Plan``. ``derives_limits``: its limits follow a demand (they take
    ``headroom``, and the framework's default headroom applies)."""

    name: str
    summary: str
    options: type
    plan: Callable[["Context", Any], "Plan"]
    derives_limits: bool = False

    def fields(self) -> List[dataclasses.Field]:
        return option_fields(self.options)


def option_fields(options: type) -> List[dataclasses.Field]:
    """The fields of an options dataclass, in declaration order."""
    return list(dataclasses.fields(options))


#: name -> module that defines ``STRATEGY`` (imported on first use: ``distmem plan`` stays fast).
BUILTIN: Dict[str, str] = {
    "data": "distmem.plan.strategies.data",
    "pipeline": "distmem.plan.strategies.pipeline",
    "model": "distmem.plan.strategies.model",
    "tenants": "distmem.plan.strategies.tenants",
    "auto": "distmem.plan.strategies.auto",
    "sharded": "distmem.plan.strategies.sharded",
}
_REGISTRY: Dict[str, Callable[[], Strategy]] = {}
_LOADED: Dict[str, Strategy] = {}


def register(name: str, loader: Callable[[], Strategy]) -> None:
    """Add (or replace) a strategy: ``loader()`` returns its :class:`Strategy`."""
    _REGISTRY[name] = loader
    _LOADED.pop(name, None)


def names() -> List[str]:
    """Every registered strategy, built-in ones first."""
    return list(BUILTIN) + [n for n in _REGISTRY if n not in BUILTIN]


def get(name: str) -> Strategy:
    """The strategy called ``name``; ConfigError naming the known ones (and the closest) otherwise."""
    if name in _LOADED:
        return _LOADED[name]
    if name in _REGISTRY:
        found = _REGISTRY[name]()
    elif name in BUILTIN:
        try:
            found = importlib.import_module(BUILTIN[name]).STRATEGY
        except ImportError as exc:
            raise ConfigError(f"strategy {name!r} is not available in this build ({exc})") from exc
    else:
        close = difflib.get_close_matches(str(name), names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown strategy {name!r}{hint}; choose one of {', '.join(names())}")
    _LOADED[name] = found
    return found


def make_options(strategy: Strategy, given: Mapping[str, Any], known_elsewhere: Sequence[str] = ()) -> Any:
    """The strategy's options dataclass from keyword arguments; an unknown one is a ConfigError
    naming it, the closest known argument and what the strategy takes (``known_elsewhere``: the
    request's own arguments, named in the message)."""
    valid = [f.name for f in strategy.fields()]
    unknown = [k for k in given if k not in valid]
    if unknown:
        name = unknown[0]
        others = [s for s in names() if s != strategy.name and name in _field_names(s)]
        if others:
            raise ConfigError(f"{name}= applies to strategy={' or '.join(repr(s) for s in others)}, not "
                              f"strategy={strategy.name!r}; drop it or change the strategy")
        close = difflib.get_close_matches(name, sorted(set(valid) | set(known_elsewhere)), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown argument {name!r}{hint} for strategy={strategy.name!r}; it takes "
                          f"{', '.join(valid) or 'no options of its own'} besides {', '.join(known_elsewhere)}")
    return strategy.options(**dict(given))


def _field_names(name: str) -> Tuple[str, ...]:
    try:
        return tuple(f.name for f in get(name).fields())
    except ConfigError:
        return ()
