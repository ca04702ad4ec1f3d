"""The built-in strategies, one module each (data, pipeline, model, tenants, auto); each defines
``STRATEGY`` (:class:`distmem.plan.strategy.Strategy`) and is listed in
:data:`distmem.plan.strategy.BUILTIN`."""
__all__ = []  # type: ignore[var-annotated]
