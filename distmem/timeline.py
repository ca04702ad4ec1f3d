"""Old import path of periodic reports: ReportEvery, collect, point, kept for one release: import ``distmem.report.periodic`` instead."""
from .report.periodic import *  # noqa: F401,F403
from .report.periodic import __all__  # noqa: F401
