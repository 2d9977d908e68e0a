"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.spec`."""

from torch_tweak.torch.module.spec import TensorSpec

__all__ = ["TensorSpec"]
