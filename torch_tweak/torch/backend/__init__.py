"""Backends: ways to run a module's graph. Heavy ones import their dependency only when used."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from torch_tweak.torch.backend.backend import Backend, BackendConfig, BackendState
from torch_tweak.torch.backend.torch_eager import TorchEagerBackend, TorchEagerBackendConfig

_LAZY = {
    "BatchRouterBackend": "torch_tweak.torch.backend.batch_router",
    "OpenVINOBackend": "torch_tweak.torch.backend.openvino",
    "OpenVINOBackendConfig": "torch_tweak.torch.backend.openvino",
    "TorchInductorBackend": "torch_tweak.torch.backend.torch_inductor",
    "TorchInductorBackendConfig": "torch_tweak.torch.backend.torch_inductor",
    "TorchInductorAOTBackend": "torch_tweak.torch.backend.torch_inductor_aot",
    "TorchInductorAOTBackendConfig": "torch_tweak.torch.backend.torch_inductor_aot",
    "TorchAOBackend": "torch_tweak.torch.backend.torchao",
    "TorchAOBackendConfig": "torch_tweak.torch.backend.torchao",
}

__all__ = [
    "Backend",
    "BackendConfig",
    "BatchRouterBackend",
    "BackendState",
    "OpenVINOBackend",
    "OpenVINOBackendConfig",
    "TorchAOBackend",
    "TorchAOBackendConfig",
    "TorchEagerBackend",
    "TorchEagerBackendConfig",
    "TorchInductorAOTBackend",
    "TorchInductorAOTBackendConfig",
    "TorchInductorBackend",
    "TorchInductorBackendConfig",
]


def available(name: str) -> bool:
    """True if the backend class ``name`` can be used here (its module exists and its dependency is installed)."""
    dependency = {"OpenVINOBackend": "openvino", "TorchAOBackend": "torchao"}.get(name)
    if dependency is not None and importlib.util.find_spec(dependency) is None:
        return False
    module_name = _LAZY.get(name)
    return module_name is None or importlib.util.find_spec(module_name) is not None


def default_backends() -> list[Backend]:
    """The candidates tried when a strategy is given none, fastest first, eager last."""
    templates: list[Backend] = []
    for name in ("OpenVINOBackend", "TorchInductorBackend"):
        if available(name):
            templates.append(__getattr__(name)())
    templates.append(TorchEagerBackend())
    return templates


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
