"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.wrapper`.

The reference's ``DEFAULT_STRATEGY`` (a shared ``FirstWinsStrategy()``) has no equivalent: a module without a
strategy is tuned with a fresh ``HighestThroughputStrategy()`` over every available backend.
"""

from typing import Any

from torch_tweak.errors import ConfigError
from torch_tweak.torch.module.wrapper import Module, ModuleState

__all__ = ["Module", "ModuleState"]


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_STRATEGY":
        raise ConfigError(
            "torch_tweak has no DEFAULT_STRATEGY: a module without a strategy is tuned with HighestThroughputStrategy() "
            "over every available backend (the reference Torch Tweak used FirstWinsStrategy([OpenVINO, Inductor])). "
            "For the reference's behaviour pass strategy=tt.FirstWinsStrategy([OpenVINOBackend(), "
            "TorchInductorBackend()]) to tt.Module or tt.wrap."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
