"""The one way distmem talks to people outside a report: whole lines on stderr, silenced by
``DISTMEM_QUIET=1``. Each message is written with a single ``write`` so that launchers that tag
lines per rank (horovodrun's ``[1,0]<stderr>:``) never splice two ranks into one line."""
from __future__ import annotations

import logging
import sys
from typing import IO, Optional

from . import settings

__all__ = ["say"]


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
