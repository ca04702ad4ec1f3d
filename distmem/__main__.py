"""``python -m distmem``: the ``distmem`` command (the same as ``python -m distmem.cli``)."""
import sys

from .cli import main

sys.exit(main())
