"""Old import path of the GPU inventory, kept for one release: import ``distmem.discover.gpus`` instead."""
from .discover.gpus import *  # noqa: F401,F403
from .discover.gpus import __all__  # noqa: F401
