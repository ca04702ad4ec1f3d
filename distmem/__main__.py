"""``python -m distmem``: the ``distmem`` command (the same as ``python -m distmem.cli``)."""
import sys

__all__ = []  # type: ignore[var-annotated]

from .cli import main  # noqa: E402

sys.exit(main())
