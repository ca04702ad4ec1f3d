"""Old import path of report outputs: table, JSON, PNG, TensorBoard, Prometheus, kept for one release: import ``distmem.report.sinks`` instead."""
from .report.sinks import *  # noqa: F401,F403
from .report.sinks import __all__  # noqa: F401
