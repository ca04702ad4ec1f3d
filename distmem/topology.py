"""Old import path of who this rank is, kept for one release: import ``distmem.discover.identity`` instead."""
from .discover.identity import *  # noqa: F401,F403
from .discover.identity import __all__  # noqa: F401
