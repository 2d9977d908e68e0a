"""Backends: ways to run a module's graph. Heavy ones import their dependency only when used.

Which backends exist is written once, in :mod:`torch_tweak.torch.backend.registry`; the class names below
resolve lazily from it, so ``import torch_tweak.torch.backend`` imports neither openvino nor torchao.

Writing a backend: subclass :class:`Backend` (the contract: ``_build/_activate/_deactivate/_deploy/_infer``,
``to_dict/from_dict``; class attributes ``runtime``, ``requires_original_module``, ``native_code``,
``artifact_keys``, ``config_class``) with a :class:`BackendConfig` dataclass. What a backend needs from the
rest of torch_tweak is exported here too:

* :func:`original_forward` — run the wrapped module without torch_tweak's interception or its hooks;
  backends that execute the PyTorch module call this, never ``module(...)``.
* :func:`pristine` — a context in which the module is neither intercepted nor hooked (for tracing and export).
* :class:`GraphSpec`, :class:`TensorSpec`, ``Sample`` — the graph being built and its recorded calls.
* :func:`flatten_sample` / :func:`unflatten_sample` — a call's tensors in graph order, and back.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch_tweak.torch.backend.backend import Backend, BackendConfig, BackendState
from torch_tweak.torch.backend.registry import available, default_candidates, lazy_names
from torch_tweak.torch.backend.torch_eager import TorchEagerBackend, TorchEagerBackendConfig
from torch_tweak.torch.module.forward import original_forward, pristine
from torch_tweak.torch.module.spec import GraphSpec, TensorSpec
from torch_tweak.torch.module.tree import Sample, flatten_sample, unflatten_sample

_LAZY = lazy_names()

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendState",
    "BatchRouterBackend",
    "GraphSpec",
    "NonFiniteGuardBackend",
    "ONNXRuntimeBackend",
    "ONNXRuntimeBackendConfig",
    "OpenVINOBackend",
    "OpenVINOBackendConfig",
    "Sample",
    "TensorSpec",
    "TorchAOBackend",
    "TorchAOBackendConfig",
    "TorchEagerBackend",
    "TorchEagerBackendConfig",
    "TorchInductorAOTBackend",
    "TorchInductorAOTBackendConfig",
    "TorchInductorBackend",
    "TorchInductorBackendConfig",
    "available",
    "default_candidates",
    "flatten_sample",
    "original_forward",
    "pristine",
    "unflatten_sample",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
