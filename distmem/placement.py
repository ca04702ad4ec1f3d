"""Old import path of the model-parallel placement helper, kept for one release: import ``distmem.apply.placement`` instead."""
from .apply.placement import *  # noqa: F401,F403
from .apply.placement import __all__  # noqa: F401
