"""Eager PyTorch: the module as it is, optionally under autocast. The baseline every candidate must beat."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend.backend import Backend, BackendConfig
from torch_tweak.torch.module.forward import original_forward
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, dtype_name, flatten, unflatten
from torch_tweak.utils.validate import check_bool

AUTOCAST_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


def normalize_autocast(enabled: bool, dtype: Any, owner: str) -> str | None:
    """Validate an ``autocast_enabled``/``autocast_dtype`` pair; return the dtype name or None."""
    check_bool(enabled, f"{owner}.autocast_enabled")
    if dtype is None:
        return None
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in AUTOCAST_DTYPES:
        raise ConfigError(f"{owner}.autocast_dtype must be one of {sorted(AUTOCAST_DTYPES)}, got {dtype!r}.")
    if not enabled:
        raise ConfigError(f"{owner}.autocast_dtype={name} has no effect while autocast_enabled is False; set both.")
    return name


def autocast_context(device: torch.device | None, enabled: bool, dtype: str | None) -> Any:
    """An autocast context for ``device``'s type (a null context when disabled)."""
    if not enabled:
        return contextlib.nullcontext()
    device_type = device.type if device is not None else "cpu"
    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
    return torch.autocast(device_type=device_type, **kwargs)


def restore_dtypes(outputs: Any, graph_spec: GraphSpec) -> Any:
    """Cast floating output tensors back to the dtypes recorded in eager (undoes autocast)."""
    leaves, spec = flatten(outputs)
    if len(leaves) != len(graph_spec.outputs):
        return outputs
    fixed = [
        t.to(s.torch_dtype) if t.is_floating_point() and dtype_name(t.dtype) != s.dtype else t
        for t, s in zip(leaves, graph_spec.outputs)
    ]
    return unflatten(spec, fixed)


@dataclass
class TorchEagerBackendConfig(BackendConfig):
    """Configuration of :class:`TorchEagerBackend`.

    Attributes:
        autocast_enabled: run under ``torch.autocast`` for the device type.
        autocast_dtype: ``"bfloat16"`` or ``"float16"`` (a ``torch.dtype`` is accepted); None uses the
            device's autocast default (bfloat16 on CPU).
    """

    autocast_enabled: bool = False
    autocast_dtype: str | None = None

    def __post_init__(self) -> None:
        self.autocast_dtype = normalize_autocast(self.autocast_enabled, self.autocast_dtype, type(self).__name__)


class TorchEagerBackend(Backend):
    """Runs the original module in eager PyTorch (under ``no_grad``, optionally autocast)."""

    requires_original_module = True
    config_class = TorchEagerBackendConfig
    rebuilds_from_files = True  # nothing is compiled: a build only keeps the module

    def __init__(self, config: TorchEagerBackendConfig | None = None) -> None:
        super().__init__()
        self._config = config or TorchEagerBackendConfig()
        self._module: nn.Module | None = None
        self._forward: Any = None
        self._graph_spec: GraphSpec | None = None

    @property
    def executed_precision(self) -> str:
        """``fp32`` unless autocast runs the module in bf16 or fp16."""
        if not self._config.autocast_enabled:
            return "fp32"
        return AUTOCAST_DTYPES[self._config.autocast_dtype or "bfloat16"]

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        self._module = module
        self._graph_spec = graph_spec
        self._forward = original_forward(module)
        return self

    def _activate(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass

    def _deploy(self) -> None:
        if self._module is not None and self._device is not None:
            self._module.to(self._device)

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        if not self._config.autocast_enabled:
            if not torch.is_grad_enabled():
                return self._forward(*args, **kwargs)
            with torch.no_grad():
                return self._forward(*args, **kwargs)
        with torch.no_grad(), autocast_context(self._device, True, self._config.autocast_dtype):
            outputs = self._forward(*args, **kwargs)
        return restore_dtypes(outputs, self._graph_spec) if self._graph_spec is not None else outputs

    def to_dict(self) -> dict[str, Any]:
        """Type, config, graph spec and device; the weights are the wrapped module's own."""
        return self._common_state()

    @classmethod
    def from_dict(cls, module: nn.Module | None, state_dict: dict[str, Any]) -> TorchEagerBackend:
        """Recreate the backend around ``module`` (required: eager runs the module's own weights)."""
        backend = cls._from_common_state(state_dict, TorchEagerBackendConfig, module, "eager runs its weights")
        backend._module = module
        backend._forward = original_forward(module)
        return backend
