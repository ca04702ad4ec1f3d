"""``distmem`` command line: plan | estimate | report | doctor (| launch-tf).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only registers them, so a missing optional dependency breaks one subcommand, not all.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from typing import List, Optional

from ..errors import DistmemError

__all__ = ["main", "SUBCOMMANDS"]

SUBCOMMANDS = {
    "plan": ("distmem.cli.plan", "compute a plan (dry run, no GPU needed)"),
    "estimate": ("distmem.estimate.cli", "per-layer memory estimate of a model"),
    "fit": ("distmem.cli.fit", "which layouts of a model fit every rank of a fleet, best first"),
    "report": ("distmem.cli.report", "render a saved report (table, plot)"),
    "doctor": ("distmem.cli.doctor", "what distmem sees: launcher, GPUs, NVML, frameworks"),
    "launch-tf": ("distmem.cli.launch_tf", "start N local tf.distribute workers with TF_CONFIG"),
    "postmortem": ("distmem.cli.postmortem", "after an out-of-memory error: which rank, by how much, why, what to change"),
    "top": ("distmem.cli.top", "a live view of every rank of a running job (planned / current / peak)"),
}


def _parser(argv: List[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distmem", description="Planned, enforced and observed GPU memory for distributed training.",
        epilog="Also: distmem-exec [options] -- COMMAND runs COMMAND under distmem's native hard cap "
               "(distmem-exec --help). Python API: distmem.init(), distmem.report().")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"distmem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, (module, helptext) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        if wanted == name:  # import only the module that runs: keeps `distmem plan` fast
            try:
                mod = importlib.import_module(module)
            except ImportError as exc:
                p.set_defaults(_error=f"'distmem {name}' is not available: {exc}")
                continue
            if len(inspect.signature(mod.add_arguments).parameters) > 1:
                mod.add_arguments(p, argv[1:])  # its options depend on the words given (distmem plan --strategy X)
            else:
                mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "_error", None):
        print(f"distmem: {args._error}", file=sys.stderr)
        return 2
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except DistmemError as exc:
        print(f"distmem {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `distmem report --json | head`: the reader left; say nothing more (and not again at exit).
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0

