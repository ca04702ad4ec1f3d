"""distmem: GPU memory in distributed training, planned per rank, enforced, and reported from all ranks.

    import distmem
    plan = distmem.init(strategy="data")   # first, before any GPU op
    ...
    distmem.report()                       # collective; rank 0 prints the table
"""
__version__ = "0.1.0"

from . import guard
from .api import check_plan, current_plan, init, plan_from_env, report, reset, snapshot
from .errors import ConfigError, DistmemError, DoesNotFitError, GatherTimeoutError, TooLateError
from .guard import find_batch_size
from .plan import Allocation, DeviceSlot, Plan
from .stats import Report, Snapshot
from .timeline import ReportEvery

__all__ = ["init", "report", "snapshot", "guard", "find_batch_size", "plan_from_env", "current_plan", "check_plan", "reset",
           "Plan", "Allocation", "DeviceSlot", "Snapshot", "Report",
           "ReportEvery", "DistmemError", "ConfigError", "DoesNotFitError", "TooLateError", "GatherTimeoutError", "__version__"]


def __getattr__(name):
    # distmem.keras.MemoryReport after a plain `import distmem`, without importing TensorFlow up front.
    if name in ("keras", "timeline", "render", "summary", "native", "placement", "estimate", "comm_tf"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'distmem' has no attribute {name!r}")
