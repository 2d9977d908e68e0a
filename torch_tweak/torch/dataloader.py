"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`torch_tweak.torch.dataset`."""

from torch_tweak.torch.dataset import DataLoaderFactory

__all__ = ["DataLoaderFactory"]
