"""The one way distmem talks to people outside a report: whole lines on stderr, silenced by
``DISTMEM_QUIET=1``; and the one plain-text table renderer every table (report, plan, fit,
estimate, tenants) is written with. Each message is written with a single ``write`` so that launchers that tag
lines per rank (horovodrun's ``[1,0]<stderr>:``) never splice two ranks into one line."""
from __future__ import annotations

import logging
import sys
from typing import IO, List, Optional, Sequence

from . import settings

__all__ = ["say", "echo", "text_table"]


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
