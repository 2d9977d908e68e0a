"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.torchao` (torchao itself
is imported only when a TorchAO backend builds)."""

from torch_tweak.torch.backend.torchao import TorchAOBackend, TorchAOBackendConfig

__all__ = ["TorchAOBackend", "TorchAOBackendConfig"]
