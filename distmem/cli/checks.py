"""Checks at the command line's edge, shared by every ``distmem`` sub-command, ``distmem-exec`` and the
examples: each turns an input distmem cannot use into one :class:`~distmem.errors.ConfigError` (or an
argparse usage error) naming the option, the value and what to do - before any work starts.

* :func:`at_least` - an argparse ``type=`` for whole numbers with a floor (``--top``, ``--steps``);
* :func:`positive_number` - an argparse ``type=`` for seconds and other positive numbers;
* :func:`input_file` - a file to read exists, is a file and is readable;
* :func:`output_file` - a file to write is not a folder and its folder exists or can be made and is
  writable (tried with a real temporary file, so ``/proc/x.json`` or a read-only mount is refused);
* :func:`did_you_mean` - the closest known words to a mistyped one (``difflib``);
* :func:`k8s_name`, :func:`k8s_quantity` - Kubernetes object names (RFC 1123) and quantities (``64Gi``).
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import signal
import sys
import tempfile
import time
from typing import Callable, Iterable, List, NoReturn, Optional, Sequence, Tuple

from ..console import forget_caught_interrupt, from_interrupt
from ..errors import ConfigError

__all__ = ["at_least", "positive_number", "input_file", "output_file", "did_you_mean", "k8s_name",
           "k8s_quantity", "where", "rank_step", "parse_example", "run_example",
           "stop_children"]


def at_least(minimum: int = 1) -> Callable[[str], int]:
    """An argparse ``type=``: a whole number ``>= minimum``; anything else is a usage error naming it."""
    def parse(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one, at least {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, at least {minimum}")
        return value

    parse.__name__ = f"whole number >= {minimum}"
    return parse


def positive_number(text: str) -> float:
    """An argparse ``type=``: a finite number above 0 (seconds, for instance)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a positive number, e.g. 30") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number, e.g. 30")
    return value


def where(path: str) -> str:
    """``path`` as a message shows it: an absolute path as given, a relative one with the folder it is
    read from."""
    return repr(path) if os.path.isabs(path) else f"{path!r} (relative to {os.getcwd()})"


def input_file(path: str, what: str) -> str:
    """``path`` when it is a readable file; ConfigError naming ``what`` and the path otherwise."""
    if not path:
        raise ConfigError(f"{what} '': give the path of a file")
    if not os.path.exists(path):
        raise ConfigError(f"{what} {where(path)}: no such file; check the path")
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a folder; give the file inside it (e.g. {os.path.join(path, 'report.json')})")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{what} {path!r}: this user (uid {os.geteuid()}) cannot read it; check its permissions")
    return path


def output_file(path: str, what: str) -> str:
    """``path`` when a file can be written there (its folder made as the writers make it); ConfigError
    naming ``what``, the path and the remedy otherwise. Tried with a real temporary file in the
    nearest folder that exists, so a read-only file system or ``/proc`` is refused before the work."""
    if not path or not str(path).strip():
        raise ConfigError(f"{what} '': give a file path, e.g. runs/last/report.json")
    full = os.path.abspath(path)
    if os.path.isdir(full) or str(path).endswith(os.sep):
        raise ConfigError(f"{what} {path!r} is a folder; give a file path inside it "
                          f"(e.g. {os.path.join(path, 'report.json')})")
    if os.path.exists(full) and not os.path.isfile(full):
        raise ConfigError(f"{what} {path!r} exists and is not a regular file; give another path")
    folder = os.path.dirname(full)
    probe = folder
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{what} {path!r}: {probe!r} is a file, not a folder; give a path in a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".distmem-check-", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"{what} {path!r}: cannot write in {probe!r} ({exc.strerror or exc}); choose a "
                          "folder this user can write") from None
    return path


def did_you_mean(word: str, known: Iterable[str], n: int = 3) -> str:
    """`` (did you mean X or Y?)`` for the closest known words to ``word``; ``""`` when none is close."""
    close: List[str] = difflib.get_close_matches(str(word), list(known), n=n, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


_RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")


def k8s_name(text: Optional[str], what: str) -> str:
    """A Kubernetes object name (RFC 1123 label: lower-case letters, digits and '-', at most 63)."""
    if text is None or not _RFC1123_LABEL.match(text) or len(text) > 63:
        fix = re.sub(r"[^a-z0-9-]+", "-", str(text or "").lower()).strip("-")[:63] or "distmem-train"
        raise ConfigError(f"{what} {text!r} is not a Kubernetes name (RFC 1123: lower-case letters, digits and '-', "
                          f"starting and ending with a letter or digit, at most 63 characters); e.g. {fix}")
    return text


def k8s_quantity(text: str, what: str) -> str:
    """A Kubernetes resource quantity (``64Gi``, ``500M``, ``1e9``)."""
    if not _QUANTITY.match(str(text).strip()):
        raise ConfigError(f"{what} {text!r} is not a Kubernetes quantity; write e.g. 64Gi, 512Mi or 100G")
    return str(text).strip()


def rank_step(text: str) -> Tuple[int, int]:
    """An argparse ``type=`` for ``RANK:N`` (the examples' ``--simulate-oom``): two whole numbers >= 0."""
    rank, sep, n = str(text).partition(":")
    try:
        out = (int(rank), int(n))
    except ValueError:
        out = (-1, -1)
    if not sep or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: write RANK:N, two whole numbers, e.g. 1:3")
    return out


def parse_example(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
                  outputs: Sequence[str] = ("report", "plot")) -> argparse.Namespace:
    """An example's arguments, with every output path among ``outputs`` checked before any work: a
    path that cannot be written is a usage error (status 2) naming the option and the path."""
    args = parser.parse_args(argv)
    for name in outputs:
        value = getattr(args, name, None)
        if value is not None:
            try:
                output_file(value, "--" + name.replace("_", "-"))
            except ConfigError as exc:
                parser.error(str(exc))
    return args


def run_example(main: Callable[[], Optional[int]], prog: Optional[str] = None) -> NoReturn:
    """``sys.exit(main())`` under the command line's rule: a :class:`~distmem.errors.DistmemError`
    ends in one line ``PROG: error: ...`` and status 1, Ctrl-C in one line ``PROG: interrupted``
    and status 130 (with the child processes it started stopped), never a traceback."""
    from ..errors import DistmemError

    name = prog or os.path.basename(sys.argv[0] or "example")
    try:
        code = main()
    except BaseException as exc:  # noqa: BLE001 - a Ctrl-C however wrapped, and distmem's own errors
        if from_interrupt(exc):
            stop_children()
            _line(f"{name}: interrupted")
            forget_caught_interrupt()
            code = 130
        elif isinstance(exc, DistmemError):
            _line(f"{name}: error: {exc}")
            code = 1
        else:
            raise
    sys.exit(code or 0)


def _line(text: str) -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _children() -> List[int]:
    """The ids of this process's live child processes (from /proc: Linux)."""
    me = os.getpid()
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(me):
            out.append(int(entry))
    return out


def stop_children(grace: float = 3.0) -> List[int]:
    """SIGTERM every child process this one started (each with what it started, when it leads its own
    process group), SIGKILL those still there after ``grace`` seconds; the ids stopped."""
    pids = _children()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            for kill in (lambda: os.killpg(pid, sig) if os.getpgid(pid) == pid else None, lambda: os.kill(pid, sig)):
                try:
                    kill()
                except OSError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        if not any(_alive(p) for p in pids):
            break
    return pids


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return False
    except OSError:
        return False
