"""The torch_tweak exception tree.

Every error the library raises on purpose derives from :class:`TorchTweakError` and from the builtin
exception that the documented contract names, so ``except RuntimeError`` keeps working::

    TorchTweakError
    ├── ConfigError (ValueError)              an argument or config value is invalid
    │   ├── UnsupportedDeviceError            a device string that is not cpu, xpu or xpu:N
    │   └── DatasetError                      a dataset that is empty or cannot be batched
    ├── UnsupportedInputError (TypeError)     a value of a type the library cannot handle
    ├── BackendStateError (RuntimeError)      a backend method called in the wrong state
    ├── BackendUnavailableError (RuntimeError) an optional dependency is missing
    ├── BuildError (RuntimeError)             a backend failed to build; the cause is chained
    │   └── ConversionError                   a model could not be exported or converted
    ├── FidelityError (ValueError)            a candidate's outputs differ from eager outputs
    ├── TuningError (RuntimeError)            no candidate passed, or nothing was recorded
    ├── SignatureMismatchError (RuntimeError) a tuned module was called with inputs no graph matches
    ├── ReleasedWeightError (RuntimeError)    the values of a weight released after tuning were needed
    ├── WorkerError (RuntimeError)            a worker process could not be started or given the work
    └── CheckpointError (ValueError)          a checkpoint is missing, tampered or incompatible

Third-party exceptions are wrapped at the backend boundary with ``raise ... from exc``.
"""

from __future__ import annotations


class TorchTweakError(Exception):
    """Base class of every error raised by torch_tweak."""


class ConfigError(TorchTweakError, ValueError):
    """An argument or configuration value is invalid."""


class UnsupportedDeviceError(ConfigError):
    """A device that torch_tweak does not support was requested."""


class DatasetError(ConfigError):
    """A dataset is empty or its items cannot be batched."""


class UnsupportedInputError(TorchTweakError, TypeError):
    """A value has a type that torch_tweak cannot handle."""


class BackendStateError(TorchTweakError, RuntimeError):
    """A backend method was called in a state that does not allow it."""


class BackendUnavailableError(TorchTweakError, RuntimeError):
    """A backend needs an optional dependency that is not installed."""


class BuildError(TorchTweakError, RuntimeError):
    """A backend failed to build. The original exception is chained as ``__cause__``."""

    def __init__(self, message: str, *, log_path: str | None = None) -> None:
        super().__init__(message)
        self.log_path = log_path


class ConversionError(BuildError):
    """A module could not be exported, traced or converted."""


class FidelityError(TorchTweakError, ValueError):
    """A candidate's outputs are not faithful to the eager outputs recorded during tuning."""


class TuningError(TorchTweakError, RuntimeError):
    """Tuning could not produce a backend (no candidate passed, or nothing was recorded)."""


class SignatureMismatchError(TorchTweakError, RuntimeError):
    """A tuned module was called with inputs that match none of its tuned graphs."""


class ReleasedWeightError(TorchTweakError, RuntimeError):
    """An operation needed the values of a weight that was released after tuning (no backend needed it)."""


class WorkerError(TorchTweakError, RuntimeError):
    """An executor could not start a worker or send it the work (the module does not pickle, say)."""


class CheckpointError(TorchTweakError, ValueError):
    """A checkpoint is missing, tampered with, truncated or incompatible."""


__all__ = [
    "BackendStateError",
    "BackendUnavailableError",
    "BuildError",
    "CheckpointError",
    "ConfigError",
    "ConversionError",
    "DatasetError",
    "FidelityError",
    "ReleasedWeightError",
    "SignatureMismatchError",
    "TorchTweakError",
    "TuningError",
    "UnsupportedDeviceError",
    "UnsupportedInputError",
    "WorkerError",
]
