"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.storage`."""

from torch_tweak.torch.checkpoint.storage import LocalTorchStorage

__all__ = ["LocalTorchStorage"]
