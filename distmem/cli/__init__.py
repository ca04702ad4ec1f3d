"""``distmem`` command line: plan | estimate | report | doctor (| launch-tf).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only registers them, so a missing optional dependency breaks one subcommand, not all.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

from ..console import forget_caught_interrupt, from_interrupt, say_back, show_progress
from ..errors import DistmemError
from .checks import did_you_mean, stop_children

__all__ = ["main", "SUBCOMMANDS", "stop_children"]

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


def _parser(argv: List[str]) -> Tuple[argparse.ArgumentParser, Dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="distmem", description="Planned, enforced and observed GPU memory for distributed training.",
        epilog="Also: distmem-exec [options] -- COMMAND runs COMMAND under distmem's native hard cap "
               "(distmem-exec --help). Python API: distmem.init(), distmem.report().")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"distmem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    subs: Dict[str, argparse.ArgumentParser] = {}
    for name, (module, helptext) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        subs[name] = p
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
    return parser, subs


def _unknown(sub: argparse.ArgumentParser, extras: List[str]) -> str:
    """The usage error for words ``sub`` does not take, with the closest option for each mistyped one."""
    known = [s for s, a in sub._option_string_actions.items()  # noqa: SLF001 - argparse has no public list
             if s.startswith("--") and a.help != argparse.SUPPRESS]
    hints = []
    for word in extras:
        if word.startswith("-"):
            hint = did_you_mean(word.split("=", 1)[0], known, n=2)
            if hint:
                hints.append(f"{word}{hint}")
    return "unrecognized arguments: " + " ".join(extras) + ("; " + "; ".join(hints) if hints else "")


def _say(line: str) -> None:
    """One line on stderr in one write (launchers that tag writes never split it)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        sys.stderr.write(line.rstrip("\n") + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


#: Modules whose Python warnings a command does not show: a framework's deprecations and notices
#: about its own internals are not the user's to act on (distmem's own warnings are still shown).
FRAMEWORK_MODULES = r"(tensorflow|tf_keras|keras|absl|h5py|google\.protobuf|jax|flatbuffers)(\.|$)"


def _quiet_frameworks() -> None:
    """No framework chatter in a command's output: TensorFlow's C++ start-up log (oneDNN, CPU
    features; its errors still show) and absl's are turned down before any framework is imported
    here - in this process and in the children it starts (the variables are inherited) - unless
    the user set them; TensorFlow's Python logger says errors only; its Python warnings are not shown."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("GLOG_minloglevel", "2")
    import logging
    import warnings

    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    logging.getLogger("absl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=FRAMEWORK_MODULES)
    if not any(isinstance(f, _QuietStart) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietStart("tensorflow"))


#: Lines a framework's C++ start-up writes to stderr before its logging honours
#: TF_CPP_MIN_LOG_LEVEL (TensorFlow 2.16+ logs through absl, whose messages before
#: ``absl::InitializeLog()`` all go to stderr): absl's notice, and INFO / WARNING lines in absl's
#: and in TensorFlow's own format. Errors (``E``, ``F``) and anything else pass.
_START_UP = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
                       r"|[IW]\d{4} [\d:.]+ +\d+ \S+:\d+\] "
                       r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] \S+:\d+\] "
                       r"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags)")


class _QuietStart:
    """A finder that lets ``name`` import as usual, with what its start-up writes on file
    descriptor 2 kept aside and written back without the lines :data:`_START_UP` matches; where
    TF_CPP_MIN_LOG_LEVEL asks for INFO lines (0), nothing is held back."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once, and the real finders answer
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip() in ("", "0"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: object) -> None:
            with _stderr_without(_START_UP):
                run(module)  # type: ignore[arg-type]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


class _stderr_without:
    """File descriptor 2 into a temporary file for the block; then its lines back, less ``pattern``'s."""

    def __init__(self, pattern: "re.Pattern[str]") -> None:
        self.pattern = pattern

    def __enter__(self) -> None:
        import tempfile

        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        self.saved = os.dup(2)
        # in memory, not a file in a folder others can write (docs/security.md); elsewhere an unnamed one
        memfd = getattr(os, "memfd_create", None)
        self.file = os.fdopen(memfd("distmem-stderr"), "w+b") if memfd else tempfile.TemporaryFile()
        os.dup2(self.file.fileno(), 2)

    def __exit__(self, *exc: object) -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        kept = [ln for ln in self.file.read().decode(errors="replace").splitlines(keepends=True)
                if not self.pattern.match(ln)]
        self.file.close()
        if kept:
            try:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass


_NEGATIVE = re.compile(r"^-[0-9.]")


def _negative_values(argv: List[str]) -> List[str]:
    """``--limit -2GiB`` as ``--limit=-2GiB``: argparse takes a word that starts with '-' for an option
    (unless it is a plain negative number), so a negative value would read as a missing one and the
    message would not name it. Words after ``--`` are left alone."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return out + argv[i:]
        if word.startswith("--") and "=" not in word and i + 1 < len(argv) and _NEGATIVE.match(argv[i + 1]):
            out.append(f"{word}={argv[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """The ``distmem`` command: every sub-command under one rule. An input distmem cannot use ends in
    one line ``distmem CMD: error: ...`` and status 1 (2 for a usage error, with the sub-command's
    usage); Ctrl-C (SIGINT) ends in one line ``distmem CMD: interrupted``, status 130, every child
    process it started stopped; a closed stdout (``| head``) ends quietly."""
    argv = _negative_values(list(sys.argv[1:] if argv is None else argv))
    command = argv[0] if argv and not argv[0].startswith("-") else None
    name = f"distmem {command}" if command in SUBCOMMANDS else "distmem"
    try:
        parser, subs = _parser(argv)
        if command is not None and command not in SUBCOMMANDS:
            parser.error(f"unknown command {command!r}{did_you_mean(command, SUBCOMMANDS)}; the commands are "
                         f"{', '.join(SUBCOMMANDS)} (distmem --help)")
        args, extras = parser.parse_known_args(argv)
        if extras:
            (subs.get(args.command) or parser).error(_unknown(subs.get(args.command) or parser, extras))
        if getattr(args, "_error", None):
            _say(f"distmem: {args._error}")
            return 2
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        _quiet_frameworks()
        show_progress(name)
        try:
            return int(args._run(args) or 0)
        finally:
            show_progress(None)
            say_back(name)  # sizes read in decimal units, said before the error line or after the result
    except DistmemError as exc:
        if from_interrupt(exc):  # an error that a Ctrl-C caused (a model's import it stopped)
            return _interrupted(name)
        _say(f"{name}: error: {exc}")  # the API's own words: every door says the same
        return 1
    except KeyboardInterrupt:
        return _interrupted(name)
    except BrokenPipeError:
        # `distmem report --json | head`: the reader left; say nothing more (and not again at exit).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:
        if from_interrupt(exc):
            return _interrupted(name)
        # A file the command was given and could not use, found only while working: one line, the path.
        what = f"{exc.strerror or exc}" + (f": {exc.filename!r}" if exc.filename else "")
        _say(f"{name}: error: {what}")
        return 1
    except Exception as exc:
        if from_interrupt(exc):  # Ctrl-C wrapped by what it stopped (Python 3.11: a class being made)
            return _interrupted(name)
        raise


def _interrupted(name: str) -> int:
    """Ctrl-C: every child process this one started stopped, one line, status 130."""
    stopped = stop_children()
    _say(f"{name}: interrupted" + (f"; stopped {len(stopped)} child process(es) it started" if stopped else ""))
    forget_caught_interrupt()
    return 130
