"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.inspect`."""

from torch_tweak.torch.inspecting.inspect import inspect

__all__ = ["inspect"]
