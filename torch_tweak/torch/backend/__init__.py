"""Backends: ways to run a module's graph. Heavy ones import their dependency only when used."""

from __future__ import annotations

import importlib
from typing import Any

from torch_tweak.torch.backend.backend import Backend, BackendConfig, BackendState
from torch_tweak.torch.backend.torch_eager import TorchEagerBackend, TorchEagerBackendConfig

_LAZY = {
    "OpenVINOBackend": "torch_tweak.torch.backend.openvino",
    "OpenVINOBackendConfig": "torch_tweak.torch.backend.openvino",
    "TorchInductorBackend": "torch_tweak.torch.backend.torch_inductor",
    "TorchInductorBackendConfig": "torch_tweak.torch.backend.torch_inductor",
    "TorchInductorAOTBackend": "torch_tweak.torch.backend.torch_inductor_aot",
    "TorchInductorAOTBackendConfig": "torch_tweak.torch.backend.torch_inductor_aot",
    "TorchAOBackend": "torch_tweak.torch.backend.torchao",
    "TorchAOBackendConfig": "torch_tweak.torch.backend.torchao",
}

__all__ = sorted(["Backend", "BackendConfig", "BackendState", "TorchEagerBackend", "TorchEagerBackendConfig", *_LAZY])


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.startswith("torch_tweak"):
            raise AttributeError(f"{name} is not available yet in this version of torch_tweak") from exc
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
