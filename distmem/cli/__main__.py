"""``python -m distmem.cli``: the ``distmem`` command."""
import sys

from . import main

sys.exit(main())
