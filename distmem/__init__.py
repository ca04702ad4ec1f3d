"""distmem: GPU memory in distributed training, planned per rank, enforced, and reported from all ranks.

    import distmem
    plan = distmem.init(strategy="data")   # first, before any GPU op
    ...
    distmem.report()                       # collective; rank 0 prints the table

The package is laid out by stage - discover -> plan -> apply -> observe -> report - with the
transports (comm), the OOM guard (guard), the estimator (estimate) and the command line (cli)
beside them; :mod:`distmem.api` wires the stages together. README "Layout" shows the tree.
"""
__version__ = "0.1.0"

from . import guard
from .api import check_plan, current_plan, init, plan_from_env, reset, snapshot, use_strategy
from .errors import ConfigError, DistmemError, DoesNotFitError, GatherTimeoutError, TooLateError
from .guard import find_batch_size
from .observe.snapshot import Snapshot
from .plan import Allocation, DeviceSlot, Plan
from .plan.fit import fit
from .report.aggregate import Report
from .report.periodic import ReportEvery
from .api import report  # after the report package is imported: the name is the function, not the package

# ``distmem.report`` is both the public function and the report stage's package. The function wins
# the attribute; naming it after the package lets ``import distmem.report.sinks as s`` still resolve
# (Python falls back to sys.modules under the attribute's ``__name__``).
report.__name__ = "distmem.report"

__all__ = ["init", "report", "snapshot", "guard", "find_batch_size", "fit", "plan_from_env", "current_plan", "check_plan", "reset", "use_strategy",
           "Plan", "Allocation", "DeviceSlot", "Snapshot", "Report",
           "ReportEvery", "DistmemError", "ConfigError", "DoesNotFitError", "TooLateError", "GatherTimeoutError", "__version__"]

#: Public submodules loaded on first access: ``distmem.keras.MemoryReport`` (the Keras callbacks) and
#: ``distmem.estimate`` (the per-layer estimator) after a plain ``import distmem``, without importing
#: TensorFlow or torch up front.
LAZY_MODULES = ("keras", "estimate")


def __getattr__(name):
    if name in LAZY_MODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'distmem' has no attribute {name!r}")
