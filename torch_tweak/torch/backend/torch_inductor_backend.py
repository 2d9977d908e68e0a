"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.torch_inductor`."""

from torch_tweak.torch.backend.torch_inductor import TorchInductorBackend, TorchInductorBackendConfig

__all__ = ["TorchInductorBackend", "TorchInductorBackendConfig"]
