"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.base`."""

from torch_tweak.torch.tune_strategy.base import TuneStrategy

__all__ = ["TuneStrategy"]
