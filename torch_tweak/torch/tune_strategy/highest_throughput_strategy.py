"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.measuring`."""

from torch_tweak.torch.tune_strategy.measuring import HighestThroughputStrategy

__all__ = ["HighestThroughputStrategy"]
