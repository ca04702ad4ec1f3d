"""The one way distmem talks to people outside a report: whole lines on stderr, silenced by
``DISTMEM_QUIET=1``; and the one plain-text table renderer every table (report, plan, fit,
estimate, tenants) is written with. Each message is written with a single ``write`` so that launchers that tag
lines per rank (horovodrun's ``[1,0]<stderr>:``) never splice two ranks into one line."""
from __future__ import annotations

import logging
import sys
import warnings
from typing import IO, Any, List, Optional, Sequence

from . import settings
from .units import said_back

__all__ = ["say", "say_back", "progress", "show_progress", "echo", "text_table", "format_warning", "from_interrupt",
           "forget_caught_interrupt"]

_progress: Optional[str] = None  # the command whose stages are said (None: a library call, silent)


def say(msg: str, *, always: bool = False, file: Optional[IO[str]] = None,
        logger: Optional[logging.Logger] = None) -> None:
    """Write ``msg`` as whole lines on stderr (``file``) unless ``DISTMEM_QUIET=1`` (``always`` ignores it).

    ``logger``: hand the line to that logger (level WARNING) instead, for messages raised inside a
    training step that users route through their own logging set-up (the OOM guard's)."""
    if not always and settings.quiet():
        return
    if logger is not None:
        logger.warning("%s", msg)
        return
    out = sys.stderr if file is None else file
    text = msg if msg.endswith("\n") else msg + "\n"
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):  # a closed pipe must not break training
        pass


def say_back(prefix: Optional[str] = None) -> None:
    """Say every decimal size read since the last call (:func:`distmem.units.said_back`), one line
    each after ``prefix`` (default: the running command's name, else ``distmem``):
    ``distmem plan: --gpus '2x16G': 16G = 16.0e9 B = 14.9 GiB ...``. Each door calls it once it has
    read its inputs, before its result, so a size means the same, said the same way, wherever it
    was given."""
    head = prefix or _progress or "distmem"
    for line in said_back():
        say(f"{head}{' ' if head.endswith(']') else ': '}{line}")


def show_progress(prefix: Optional[str]) -> None:
    """Say the stages of long work (:func:`progress`) after ``prefix`` from now on (``None``: stop).
    The command line turns it on for the command it runs; a library call stays silent."""
    global _progress
    _progress = prefix


def progress(msg: str) -> None:
    """One line on stderr as a stage of long work begins (``distmem fit: estimating torchvision:resnet50
    in float32 (1 of 2)``), where a command turned it on (:func:`show_progress`); stdout stays the
    result's alone, so ``--json`` output is still clean. ``DISTMEM_QUIET=1`` silences it."""
    if _progress is not None:
        say_back(_progress)  # what was read is said before the work it sizes
        say(f"{_progress}: {msg}")


def echo(text: str = "", *, file: Optional[IO[str]] = None) -> None:
    """``print(text, flush=True)`` in one write: the text and its newline together, so a launcher that
    tags every write (horovodrun's ``[1,0]<stdout>:``) never splits the line."""
    out = sys.stdout if file is None else file
    out.write(text if text.endswith("\n") else text + "\n")
    out.flush()


def text_table(head: Sequence[str], rows: Sequence[Sequence[object]], right: Optional[Sequence[bool]] = None, *,
               rule: bool = False) -> List[str]:
    """Aligned plain-text lines: the header, an optional dashed rule, then one line per row.

    ``right[i]``: column ``i`` is right-aligned (numbers); columns are two spaces apart and lines
    carry no trailing blanks, so the table reads the same in a terminal, a job log and a test."""
    cells = [[str(c) for c in head]] + [[str(c) for c in r] for r in rows]
    n = len(cells[0])
    align = list(right) if right is not None else [False] * n
    widths = [max(len(r[k]) for r in cells) for k in range(n)]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a else c.ljust(w) for c, w, a in zip(r, widths, align)).rstrip()

    out = [line(cells[0])]
    if rule:
        out.append(line(["-" * w for w in widths]))
    return out + [line(r) for r in cells[1:]]


_python_format = warnings.formatwarning


def format_warning(message: Any, category: Any, filename: str, lineno: int, line: Optional[str] = None) -> str:
    """:func:`warnings.formatwarning` for distmem's own warnings (their text starts with ``distmem``,
    as every one distmem raises does): one line, ``warning: distmem.estimate: not measured (...)``,
    without the file, line and source line Python adds, which name distmem's code, not the
    user's. Any other warning is formatted as before (the formatter in place when distmem was
    imported)."""
    text = str(message)
    if text.startswith("distmem"):
        return "warning: " + " ".join(text.split()) + "\n"
    return _python_format(message, category, filename, lineno, line)


def from_interrupt(exc: BaseException) -> bool:
    """True for a Ctrl-C however it reached here: a ``KeyboardInterrupt``, or an error raised because
    of one (``__cause__`` / ``__context__``: Python 3.11 turns a KeyboardInterrupt raised while a class
    is being made into ``RuntimeError: Error calling __set_name__``, and an import it stopped may end
    in an ``ImportError``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def forget_caught_interrupt() -> None:
    """Let a process that handled Ctrl-C end with the status it returns (130), not by SIGINT.

    CPython marks a KeyboardInterrupt as unhandled whenever one leaves code run by ``PyRun_String``
    (what a C extension's embedded Python does: pybind11's ``exec``, which ``import torch`` reaches),
    even when Python code catches it later; ``python -m`` then ends the process by SIGINT after it
    finalises (status -2, not 130). Every such run clears the mark first, so an empty one clears it.
    Nothing happens where ``ctypes`` or the C API is not there."""
    try:
        import ctypes
        ctypes.pythonapi.PyRun_SimpleString(b"")
    except Exception:  # noqa: BLE001 - another interpreter: no such mark to clear
        pass


if getattr(warnings.formatwarning, "__module__", None) != __name__:
    warnings.formatwarning = format_warning
