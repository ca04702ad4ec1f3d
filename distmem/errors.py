"""The few exceptions distmem raises. Every message carries the values involved and the remedy."""

__all__ = ["DistmemError", "ConfigError", "DoesNotFitError", "TooLateError", "GatherTimeoutError"]


class DistmemError(Exception):
    """Base class of every error distmem raises on purpose."""


class ConfigError(DistmemError, ValueError):
    """Bad input: unknown strategy, malformed size or CUDA_VISIBLE_DEVICES, fraction out of range."""


class DoesNotFitError(DistmemError, ValueError):
    """A plan cannot be satisfied by the devices it was given (a stage, a tenant, a limit too large)."""


class TooLateError(DistmemError, RuntimeError):
    """The framework initialised its GPUs before distmem could configure them, differently."""


class GatherTimeoutError(DistmemError, TimeoutError):
    """A collective did not complete within its timeout; ``missing`` lists the ranks that never arrived."""

    def __init__(self, message: str, missing=()):
        super().__init__(message)
        self.missing = list(missing)
