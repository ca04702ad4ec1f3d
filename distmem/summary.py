"""Old import path of the summary reduction, kept for one release: import ``distmem.report.summary`` instead."""
from .report.summary import *  # noqa: F401,F403
from .report.summary import __all__  # noqa: F401
