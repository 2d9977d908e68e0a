"""TorchAO: a quantized copy of the module (``torchao.quantization.quantize_``), compiled with Inductor.

``torchao`` is imported only when a backend is built or a config object is converted, never when this
module is imported. The copy is quantized once per build (or deploy); ``activate`` recompiles it but never
quantizes again. Inductor settings that ``quantize_`` changes globally (torchao's recommended settings) are
restored right after it runs and passed to this backend's own ``torch.compile`` instead, so other tuned
modules keep their compiler settings.

Checkpoints store the config (a preset name or ``config_to_dict`` JSON, restored only through an
allowlist of torchao types), the graph spec and an AOTInductor package of the quantized graph, written at
``tt.save`` (:mod:`._warm_package`): restored in the same environment with native code trusted, the backend
serves from the package and neither quantizes nor compiles; otherwise the deploy step quantizes the wrapped
module again and compiles it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import BackendUnavailableError, BuildError, ConfigError, UnsupportedInputError
from torch_tweak.torch.backend import _warm_package
from torch_tweak.torch.backend._compile_helpers import build_failure, warm_up, watch_recompile_limit
from torch_tweak.torch.backend._inductor_options import times_kernels
from torch_tweak.torch.backend._isolated_settings import isolated_inductor_config
from torch_tweak.torch.backend.backend import Backend, BackendConfig
from torch_tweak.torch.module.forward import pristine
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, dtype_from_name

logger = logging.getLogger(__name__)

PRESETS = {
    "int8dq": "Int8DynamicActivationInt8WeightConfig",
    "int8wo": "Int8WeightOnlyConfig",
    "fp8wo": "Float8WeightOnlyConfig",
    "fp8dq": "Float8DynamicActivationFloat8WeightConfig",
}
DEFAULT_PRESET = "int8dq"
_CONFIG_TYPES = {
    *PRESETS.values(), "Int4WeightOnlyConfig", "IntxWeightOnlyConfig", "Int8DynamicActivationIntxWeightConfig",
    "FqnToConfig", "ModuleFqnToConfig",
}
_VALUE_TYPES = {
    "PerRow", "PerTensor", "PerAxis", "PerGroup", "PerToken", "PerBlock", "MappingType", "ZeroPointDomain",
    "Float8MMConfig", "Float8PackingFormat", "KernelPreference", "Int4PackingFormat", "IntxPackingFormat",
}
_MAX_DEPTH = 16


@contextlib.contextmanager
def _quiet_torchao() -> Any:
    """Silence the one-time warnings torchao's modules cause on import (Enum registration, see G4)."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    pytree_logger = logging.getLogger("torch.utils._pytree")
    level = pytree_logger.level
    pytree_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pytree_logger.setLevel(level)


def import_torchao() -> Any:
    """Import ``torchao.quantization`` quietly (no CUDA extension loading) or raise BackendUnavailableError."""
    try:
        with _quiet_torchao():
            import torchao.quantization
    except ImportError as exc:
        raise BackendUnavailableError(
            "TorchAOBackend needs the 'torchao' package, which is not installed. "
            "Install it with: pip install torch-tweak[torchao]"
        ) from exc
    return torchao.quantization


def _check_payload(node: Any, depth: int = 0, top: bool = True) -> None:
    """Refuse a ``config_to_dict`` payload that names a type outside the allowlist (before anything resolves)."""
    if depth > _MAX_DEPTH:
        raise ConfigError("The torchao config payload is nested too deeply.")
    if top and not (isinstance(node, dict) and "_type" in node):
        raise ConfigError(f"A torchao config payload must be a dict with '_type', got {str(node)[:80]!r}.")
    if isinstance(node, list):
        for item in node:
            _check_payload(item, depth + 1, top=False)
    elif isinstance(node, dict) and "_type" in node:
        kind, data = node.get("_type"), node.get("_data")
        if kind == "torch.dtype":
            try:
                dtype_from_name(str(data))
            except UnsupportedInputError as exc:
                raise ConfigError(f"The torchao config payload names an unknown dtype {data!r}.") from exc
            return
        allowed = _CONFIG_TYPES if top else _CONFIG_TYPES | _VALUE_TYPES
        if kind not in allowed:
            raise ConfigError(
                f"The torchao config type {kind!r} is not supported by TorchAOBackend; supported configs: "
                f"{sorted(_CONFIG_TYPES)}."
            )
        _check_payload(data, depth + 1, top=False)
    elif isinstance(node, dict):
        for value in node.values():
            _check_payload(value, depth + 1, top=False)


def config_from_payload(payload: dict[str, Any]) -> Any:
    """Rebuild a torchao config from ``config_to_dict`` JSON, accepting only allowlisted types."""
    _check_payload(payload)
    import_torchao()
    from torchao.core.config import AOBaseConfig, config_from_dict

    try:
        with _quiet_torchao():
            config = config_from_dict(payload)
    except Exception as exc:
        raise ConfigError(f"Could not rebuild the torchao config {payload.get('_type')!r}: {exc}") from exc
    if not isinstance(config, AOBaseConfig):
        raise ConfigError(f"The torchao config payload rebuilt a {type(config).__name__}, not an AOBaseConfig.")
    return config


def preset_config(name: str) -> Any:
    """A fresh torchao config object for a preset name."""
    quantization = import_torchao()
    if name == "fp8dq":
        return quantization.Float8DynamicActivationFloat8WeightConfig(granularity=quantization.PerRow())
    return getattr(quantization, PRESETS[name])()


@dataclass
class TorchAOBackendConfig(BackendConfig):
    """Configuration of :class:`TorchAOBackend`: a preset name or a torchao config object, not both.

    Presets: ``int8dq`` (int8 dynamic activations and int8 weights), ``int8wo`` (int8 weights only),
    ``fp8wo`` and ``fp8dq`` (float8; ``fp8dq`` needs a recent CUDA GPU or an Intel XPU, and fails with a
    clear error on a CPU). The default is ``int8dq``: on CPU, int8 dynamic quantization compiled with
    Inductor is the torchao variant that beats fp32 eager on linear-heavy models (about 0.35x the latency of
    eager at batch 32 and 0.85x at batch 1 on an MLP, in our measurements), while weight-only int8 and
    float8 gain nothing or are slower than fp32 here. Quantization only affects ``nn.Linear`` layers.

    Attributes:
        quantization: a preset name (see :data:`PRESETS`); None with no ``quantization_config`` means the default.
        quantization_config: a ``torchao`` ``AOBaseConfig`` (or its ``config_to_dict`` form) of a supported type.
    """

    quantization: str | None = None
    quantization_config: Any = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.quantization is not None and self.quantization_config is not None:
            raise ConfigError(
                f"{owner}: quantization={self.quantization!r} and quantization_config were both given; pass "
                "exactly one (a preset name or a torchao config object)."
            )
        if self.quantization_config is None:
            self.quantization = DEFAULT_PRESET if self.quantization is None else self.quantization
            if self.quantization not in PRESETS:
                raise ConfigError(
                    f"{owner}: unknown quantization preset {self.quantization!r}; valid presets: {sorted(PRESETS)}."
                )
            return
        if isinstance(self.quantization_config, dict):
            self.quantization_config = config_from_payload(self.quantization_config)
            return
        import_torchao()
        from torchao.core.config import AOBaseConfig, config_to_dict

        if not isinstance(self.quantization_config, AOBaseConfig):
            raise ConfigError(
                f"{owner}.quantization_config must be a torchao AOBaseConfig, got "
                f"{type(self.quantization_config).__name__}."
            )
        _check_payload(config_to_dict(self.quantization_config))

    def torchao_config(self) -> Any:
        """The torchao config object to quantize with (a fresh one for presets)."""
        return self.quantization_config if self.quantization_config is not None else preset_config(self.quantization)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: the preset name, or the config object as torchao's ``config_to_dict`` JSON."""
        payload = None
        if self.quantization_config is not None:
            from torchao.core.config import config_to_dict

            payload = config_to_dict(self.quantization_config)
        return {"quantization": self.quantization, "quantization_config": payload}

    def describe(self) -> str:
        """``quantization=<preset>`` when not the default, or the config object's repr."""
        if self.quantization_config is not None:
            return f"quantization_config={self.quantization_config!r}"
        return "" if self.quantization == DEFAULT_PRESET else f"quantization={self.quantization}"


def _layer_types(module: nn.Module) -> dict[str, type]:
    types = {f"module:{name}": type(m) for name, m in module.named_modules()}
    types.update({f"param:{name}": type(p) for name, p in module.named_parameters()})
    return types


class TorchAOBackend(_warm_package.WarmLoads, Backend):
    """Quantizes a copy of the module with torchao, compiles it with Inductor and warms it up at build."""

    requires_original_module = True
    config_class = TorchAOBackendConfig
    artifact_keys = (_warm_package.STATE_PACKAGE,)
    optional_native_keys = (_warm_package.STATE_PACKAGE,)
    _WARM_LIBRARIES = ("torch", "torchao")

    def __init__(self, config: TorchAOBackendConfig | None = None) -> None:
        super().__init__()
        self._config = config or TorchAOBackendConfig()
        self._module: nn.Module | None = None
        self._graph_spec: GraphSpec | None = None
        self._quantized: nn.Module | None = None
        self._compiled: Any = None
        self._compile_options: dict[str, Any] = {}
        self._cache_dir: Path | None = None
        self._warm: Path | None = None  # the warm-load package (written at save, or restored)
        self._warm_environment: dict[str, Any] | None = None

    def compiles_ahead(self) -> bool:
        return not times_kernels(None, None)  # its compile settings are torchao's, unless the process-wide config

    @property
    def executed_precision(self) -> str:
        """``int8`` for int8 configs, ``fp8`` for float8 ones, ``int4`` for int4 ones."""
        name = PRESETS[self._config.quantization] if self._config.quantization_config is None else type(
            self._config.quantization_config).__name__
        if name.startswith("Float8"):
            return "fp8"
        return "int4" if name.startswith("Int4") else "int8"

    def int8_layer_calls(self, layer: nn.Linear, activation: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """``layer`` and a copy of it quantized with this backend's config as its build quantizes the module, both
        uncompiled, called on ``activation``: what the strategy's stand-in rule times against each other
        (``tune_strategy/stand_ins.py``). Global settings ``quantize_`` changes are restored."""
        import_torchao()
        from torchao.quantization import quantize_

        quantized = copy.deepcopy(layer)
        with isolated_inductor_config({}), _quiet_torchao():
            quantize_(quantized, self._config.torchao_config())
        return (lambda: layer(activation)), (lambda: quantized(activation))

    def _quantize(self) -> None:
        """Quantize a copy of the module (once); raise BuildError when the config changes no layer."""
        assert self._module is not None and self._graph_spec is not None
        import_torchao()
        from torchao.quantization import quantize_

        ao_config = self._config.torchao_config()
        with pristine(self._module):
            quantized = copy.deepcopy(self._module)
        if self._device is not None:
            quantized.to(self._device)
        before = _layer_types(quantized)
        options: dict[str, Any] = {}
        try:
            with isolated_inductor_config(options):
                quantize_(quantized, ao_config, device=self._device)
        except Exception as exc:
            hint = ""
            if self.executed_precision == "fp8":
                hint = (f"float8 quantization needs hardware this {self._device} does not have (a CUDA GPU with "
                        "compute capability >= 8.9, an MI300 or an Intel XPU); use quantization='int8dq' on a CPU.")
            raise build_failure(f"torchao quantization ({self._config.describe() or DEFAULT_PRESET}) failed", exc,
                                self._cache_dir, hint) from exc
        if _layer_types(quantized) == before:
            raise BuildError(
                f"The torchao config {type(ao_config).__name__} applied to no layer of {type(self._module).__name__} "
                f"(graph {self._graph_spec.name!r}): torchao quantizes nn.Linear layers (those the config's filter "
                "selects) and this module has none it could quantize. Use another backend for this module."
            )
        import torch._inductor

        known = set(torch._inductor.list_options())
        self._compile_options = {k: v for k, v in options.items() if k in known}
        self._quantized = quantized

    def _compile(self, data: list[Sample]) -> None:
        assert self._quantized is not None and self._graph_spec is not None
        watch_recompile_limit()
        compiled = torch.compile(self._quantized.forward, options=dict(self._compile_options) or None)
        try:
            with warnings.catch_warnings():  # torchao tensors have no stable cache hash (G4); harmless
                warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
                warm_up(compiled, self._graph_spec, data, self._device, contextlib.nullcontext, mark_dynamic=True)
        except Exception as exc:
            raise build_failure(f"torch.compile of the quantized graph {self._graph_spec.name!r} failed", exc,
                                self._cache_dir) from exc
        self._compiled = compiled

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        self._module = module
        self._graph_spec = graph_spec
        self._cache_dir = cache_dir
        self._quantize()
        self._compile(data)
        return self

    def _activate(self) -> None:
        if self._quantized is None:
            self._quantize()
        if self._compiled is None:
            self._compile([])

    def _deactivate(self) -> None:
        self._compiled = None

    def _deploy_cold(self) -> None:
        self._quantize()
        self._compile([])

    def _warm_state(self) -> dict[str, Any]:
        """The warm-load package (built now on the first save of a backend built here) and its environment."""
        if self._warm is None and self._compiled is not None and self._quantized is not None \
                and self._cache_dir is not None:
            assert self._graph_spec is not None
            with _quiet_torchao():
                self._warm = _warm_package.build(
                    self._quantized, self._graph_spec, self._cache_dir, options=dict(self._compile_options),
                    context=contextlib.nullcontext, reference=self._compiled, precision=self.executed_precision,
                    device=self._device)
            self._warm_environment = _warm_package.fingerprint(self._WARM_LIBRARIES)
        return _warm_package.state(self._warm, self._warm_environment)

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self._compiled(*args, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Type, JSON-able config, graph spec and device, and the warm-load package of the quantized graph (a
        :class:`pathlib.Path`, native code) with its environment; weights come from the wrapped module otherwise."""
        return {**self._common_state(), **self._warm_state()}

    @classmethod
    def from_dict(cls, module: nn.Module | None, state_dict: dict[str, Any]) -> TorchAOBackend:
        """Recreate the backend around ``module``; ``deploy`` quantizes and compiles it once."""
        backend = cls._from_common_state(state_dict, TorchAOBackendConfig, module, "its weights are quantized at deploy")
        backend._module = module
        backend._warm, backend._warm_environment = _warm_package.restore(state_dict)
        return backend
