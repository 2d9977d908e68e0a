"""Torch Inductor: ``torch.compile`` of the module's own forward, compiled while tuning.

The compile happens in :meth:`TorchInductorBackend.build` (and again in ``activate``/``deploy``): the
backend runs synthesized inputs at the graph's smallest and largest batch and each recorded sample of another
shape once, so the user's first call after tuning does not pay for compilation. ``tt.save`` stores an
AOTInductor package of the compiled graph (:mod:`._warm_package` says why this form): a backend restored in the
same environment, with native code trusted, serves from it and compiles nothing; otherwise it compiles again
at ``deploy`` and warms up every batch size and sequence bucket tuning saw.

The helpers it shares with the AOT and TorchAO backends (warm-up, build errors) live in :mod:`._compile_helpers`,
the checkpoint allowlist of Inductor options in :mod:`._inductor_options`; both are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import _warm_package
from torch_tweak.torch.backend._compile_helpers import (
    BUILD_LOG_NAME,
    build_failure,
    clone_sample,
    example_batch_sizes,
    mark_symbolic_axes,
    warm_up,
    watch_recompile_limit,
)
from torch_tweak.torch.backend._inductor_options import (
    INERT_INDUCTOR_OPTIONS,
    times_kernels,
    unsafe_inductor_options,
    validate_inductor_options,
)
from torch_tweak.torch.backend.backend import Backend, BackendConfig
from torch_tweak.torch.backend.torch_eager import (
    AUTOCAST_DTYPES,
    autocast_context,
    normalize_autocast,
    restore_dtypes,
)
from torch_tweak.torch.module.forward import original_forward, pristine
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample
from torch_tweak.utils.validate import check_bool

__all__ = [  # the shared helpers are re-exported for the modules that import them from here
    "BUILD_LOG_NAME", "INERT_INDUCTOR_OPTIONS", "TorchInductorBackend", "TorchInductorBackendConfig", "build_failure",
    "clone_sample", "example_batch_sizes", "mark_symbolic_axes", "unsafe_inductor_options",
    "validate_inductor_options", "warm_up", "watch_recompile_limit",
]


def _mode_names() -> list[str]:
    import torch._inductor

    return sorted(torch._inductor.list_mode_options())


@dataclass
class TorchInductorBackendConfig(BackendConfig):
    """Configuration of :class:`TorchInductorBackend` (the arguments of ``torch.compile``).

    Attributes:
        fullgraph: require one graph without breaks; a module with graph breaks then fails to build.
        dynamic: None lets Dynamo decide (the backend hints the graph's batch and dynamic axes, so one
            dynamic graph serves every batch >= 2 plus one for batch 1); True compiles dynamic shapes from the
            start; False compiles one graph per input shape (every new shape recompiles at inference).
        mode: an Inductor mode: ``"default"``, ``"max-autotune-no-cudagraphs"`` (autotunes GEMM templates,
            mostly with ``options={"freezing": True}``), ``"max-autotune"``, ``"reduce-overhead"`` (CUDA graphs,
            nothing extra on CPU) or ``"lite"``. Mutually exclusive with ``options``.
        options: Inductor config options, e.g. ``{"freezing": True}`` (the fastest setting on CPU in our
            measurements: weights are folded as constants).
        autocast_enabled: run under ``torch.autocast`` for the device type.
        autocast_dtype: ``"bfloat16"`` or ``"float16"`` (None: the device's autocast default).
    """

    fullgraph: bool = False
    dynamic: bool | None = None
    mode: str | None = None
    options: dict[str, Any] | None = None
    autocast_enabled: bool = False
    autocast_dtype: str | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        self.autocast_dtype = normalize_autocast(self.autocast_enabled, self.autocast_dtype, owner)
        check_bool(self.fullgraph, f"{owner}.fullgraph")
        check_bool(self.dynamic, f"{owner}.dynamic", allow_none=True)
        if self.mode is not None and self.options is not None:
            raise ConfigError(
                f"{owner}: mode={self.mode!r} and options={self.options!r} were both given, but torch.compile "
                "accepts only one of them; pass the mode's settings through options, or drop options."
            )
        if self.mode is not None and self.mode not in _mode_names():
            raise ConfigError(f"{owner}.mode={self.mode!r} is not an Inductor mode; valid modes: {_mode_names()}.")
        if self.options is not None:
            self.options = validate_inductor_options(self.options, owner)

    def unsafe_settings(self) -> list[str]:
        """Inductor options outside the inert allowlist (see :func:`unsafe_inductor_options`)."""
        return unsafe_inductor_options(self.options)


class TorchInductorBackend(_warm_package.WarmLoads, Backend):
    """Runs the module's own forward compiled with ``torch.compile`` (Inductor), optionally under autocast.

    The compiled callable belongs to this backend only: ``deactivate`` drops it and never resets Dynamo or
    Inductor state that other tuned modules rely on; ``activate`` compiles again and warms up on inputs
    synthesized from the graph spec. Checkpoints store only the config and the graph spec; the weights are
    the wrapped module's own (``requires_original_module``).
    """

    requires_original_module = True
    config_class = TorchInductorBackendConfig
    artifact_keys = (_warm_package.STATE_PACKAGE,)
    optional_native_keys = (_warm_package.STATE_PACKAGE,)
    _WARM_LIBRARIES = ("torch",)

    def __init__(self, config: TorchInductorBackendConfig | None = None) -> None:
        super().__init__()
        self._config = config or TorchInductorBackendConfig()
        self._module: nn.Module | None = None
        self._graph_spec: GraphSpec | None = None
        self._compiled: Callable[..., Any] | None = None
        self._cache_dir: Path | None = None
        self._warm: Path | None = None  # the warm-load package (written at save, or restored)
        self._warm_environment: dict[str, Any] | None = None

    def compiles_ahead(self) -> bool:
        return not times_kernels(self._config.mode, self._config.options)

    @property
    def executed_precision(self) -> str:
        """``fp32`` unless autocast runs the module in bf16 or fp16."""
        if not self._config.autocast_enabled:
            return "fp32"
        return AUTOCAST_DTYPES[self._config.autocast_dtype or "bfloat16"]

    def _context(self) -> Any:
        return autocast_context(self._device, self._config.autocast_enabled, self._config.autocast_dtype)

    def _compile(self, data: list[Sample]) -> None:
        """Compile the module's forward and run the warm-up inputs so every compile happens now."""
        if self._module is None or self._graph_spec is None:
            raise RuntimeError("Backend has not been properly initialized. Please call build() first.")
        config = self._config
        watch_recompile_limit()
        compiled = torch.compile(
            original_forward(self._module),
            fullgraph=config.fullgraph,
            dynamic=config.dynamic,
            mode=config.mode,
            options=dict(config.options) if config.options is not None else None,
        )
        try:
            warm_up(compiled, self._graph_spec, data, self._device, self._context, mark_dynamic=config.dynamic is None)
        except Exception as exc:
            hint = ""
            if config.fullgraph and isinstance(exc, torch._dynamo.exc.Unsupported):
                hint = (
                    "fullgraph=True requires a module without graph breaks, and this one has one (see the cause "
                    "above); use fullgraph=False, or remove the data-dependent Python code from the forward."
                )
            raise build_failure(f"torch.compile of graph {self._graph_spec.name!r} failed", exc, self._cache_dir,
                                hint) from exc
        self._compiled = compiled

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        self._module = module
        self._graph_spec = graph_spec
        self._cache_dir = cache_dir
        self._compile(data)
        return self

    def _activate(self) -> None:
        if self._compiled is None:
            self._compile([])

    def _deactivate(self) -> None:
        self._compiled = None

    def _deploy_cold(self) -> None:
        if self._module is not None and self._device is not None:
            self._module.to(self._device)
        self._compile([])

    def _warm_options(self) -> dict[str, Any] | None:
        if self._config.mode is not None:
            import torch._inductor

            return dict(torch._inductor.list_mode_options(self._config.mode))
        return dict(self._config.options) if self._config.options is not None else None

    def _warm_state(self) -> dict[str, Any]:
        """The warm-load package (built now on the first save of a backend built here) and its environment."""
        if self._warm is None and self._compiled is not None and self._cache_dir is not None:
            assert self._module is not None and self._graph_spec is not None
            with pristine(self._module):
                self._warm = _warm_package.build(
                    self._module, self._graph_spec, self._cache_dir, options=self._warm_options(),
                    context=self._context, reference=self._compiled, precision=self.executed_precision,
                    device=self._device)
            self._warm_environment = _warm_package.fingerprint(self._WARM_LIBRARIES)
        return _warm_package.state(self._warm, self._warm_environment)

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), self._context():
            outputs = self._compiled(*args, **kwargs)  # type: ignore[misc]
        if self._config.autocast_enabled and self._graph_spec is not None:
            outputs = restore_dtypes(outputs, self._graph_spec)
        return outputs

    def to_dict(self) -> dict[str, Any]:
        """Type, config, graph spec and device (JSON-able), and the warm-load package (a :class:`pathlib.Path`,
        native code) with the environment it was compiled in, when one could be built."""
        return {**self._common_state(), **self._warm_state()}

    @classmethod
    def from_dict(cls, module: nn.Module | None, state_dict: dict[str, Any]) -> TorchInductorBackend:
        """Recreate the backend around ``module``; ``deploy`` loads the warm package when there is a usable one,
        else compiles (with inputs synthesized from the spec)."""
        backend = cls._from_common_state(state_dict, TorchInductorBackendConfig, module, "Inductor compiles its forward")
        backend._module = module
        backend._warm, backend._warm_environment = _warm_package.restore(state_dict)
        return backend
