"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.simple`."""

from torch_tweak.torch.tune_strategy.simple import OneBackendStrategy

__all__ = ["OneBackendStrategy"]
