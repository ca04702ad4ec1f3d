"""Old import path of the native cap's binding, kept for one release: import ``distmem.apply.native`` instead."""
from .apply.native import *  # noqa: F401,F403
from .apply.native import __all__  # noqa: F401
