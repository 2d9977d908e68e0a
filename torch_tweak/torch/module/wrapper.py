"""``tt.Module``: a transparent proxy that records, tunes and dispatches a wrapped ``nn.Module``.

The proxy forwards attribute access, ``isinstance``, indexing and iteration to the wrapped module,
and installs an interceptor as the module's instance ``forward``, so calls through the proxy, through
a parent module or through any other reference reach torch_tweak while the module's hooks keep
running once per call. States::

    INIT ──(called inside tt.tune)──▶ RECORDING ──tune()──▶ TUNED
                                         └──(tuning failed)──▶ PASSTHROUGH
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import weakref
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import ConfigError, SignatureMismatchError, TuningError, UnsupportedInputError
from torch_tweak.torch.config import config as _config
from torch_tweak.torch.integrations import activate_integrations
from torch_tweak.torch.module import _forward
from torch_tweak.torch.module.recording import Recorder, graph_key
from torch_tweak.torch.module.session import current_session
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import flatten_sample, sample_leaf_paths

logger = logging.getLogger(__name__)

_REGISTRY: weakref.WeakValueDictionary[str, Module] = weakref.WeakValueDictionary()
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")


class ModuleState(enum.Enum):
    """States of a ``tt.Module``."""

    INIT = "init"
    RECORDING = "recording"
    TUNED = "tuned"
    PASSTHROUGH = "passthrough"


class _Interceptor:
    """Installed as the wrapped module's ``forward``; hands every call to the proxy."""

    __slots__ = ("proxy",)

    def __init__(self, proxy: Module) -> None:
        self.proxy = proxy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.proxy._tt_dispatch(args, kwargs)


class Module:
    """Wrap ``module`` so ``tt.tune`` can record, tune and then accelerate it.

    Args:
        module: the ``nn.Module`` to wrap.
        name: unique name (cache folders, reports, checkpoints); defaults to the class path, made
            unique with a numeric suffix. An explicit name already used by another live module is refused.
        strategy: the strategy for every graph of this module.
        strategies: one strategy per graph, as a list (graph creation order) or a dict keyed by graph name.
    """

    def __init__(self, module: nn.Module, name: str | None = None, strategy: Any = None, strategies: Any = None) -> None:
        if isinstance(module, Module):
            raise ConfigError(f"{module._tt_name!r} is already a tt.Module; wrap each module once.")
        if not isinstance(module, nn.Module):
            raise UnsupportedInputError(f"tt.Module wraps torch.nn.Module objects, got {type(module).__name__}.")
        if _forward.is_intercepted(module):
            raise ConfigError(f"This {type(module).__name__} is already wrapped by another tt.Module.")
        if strategy is not None and strategies is not None:
            raise ConfigError("Only one of strategy or strategies should be provided")
        _check_strategies(strategy, strategies)
        activate_integrations()
        object.__setattr__(self, "_tt_module", module)
        object.__setattr__(self, "_tt_name", _register(self, module, name))
        object.__setattr__(self, "_tt_strategy", strategy)
        object.__setattr__(self, "_tt_strategies", strategies)
        object.__setattr__(self, "_tt_state", ModuleState.INIT)
        object.__setattr__(self, "_tt_recorder", None)
        object.__setattr__(self, "_tt_session_id", None)
        object.__setattr__(self, "_tt_routes", {})
        object.__setattr__(self, "_tt_graphs", [])
        object.__setattr__(self, "_tt_offloaded", False)
        object.__setattr__(self, "_tt_phases", False)
        object.__setattr__(self, "_tt_strict_key", True)
        object.__setattr__(self, "_tt_tls", threading.local())
        object.__setattr__(self, "_tt_original", _forward.original_forward(module))
        _forward.install(module, _Interceptor(self))

    # transparency -------------------------------------------------------------------------------

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._tt_module)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_tt_"):
            raise AttributeError(name)
        return getattr(self._tt_module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_tt_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._tt_module, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._tt_module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tt_module(*args, **kwargs)

    def __getitem__(self, index: Any) -> Any:
        return self._tt_module[index]

    def __len__(self) -> int:
        return len(self._tt_module)

    def __iter__(self) -> Any:
        return iter(self._tt_module)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._tt_module)) | {"name", "state", "graph_specs", "backends", "tune", "wrapped"})

    def __repr__(self) -> str:
        return f"tt.Module(name={self._tt_name!r}, state={self._tt_state.name})[{self._tt_module!r}]"

    # public API ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The module's unique name."""
        return self._tt_name

    @property
    def state(self) -> ModuleState:
        """INIT, RECORDING, TUNED or PASSTHROUGH."""
        return self._tt_state

    @property
    def wrapped(self) -> nn.Module:
        """The wrapped ``nn.Module``."""
        return self._tt_module

    @property
    def graph_specs(self) -> list[GraphSpec]:
        """The graphs recorded (or loaded) for this module."""
        if self._tt_graphs:
            return list(self._tt_graphs)
        if self._tt_recorder is None or not self._tt_recorder.graphs:
            raise TuningError(f"Module {self._tt_name!r} has recorded no call yet; run tt.tune first.")
        return self._tt_recorder.graph_specs()

    @property
    def backends(self) -> dict[str, Any]:
        """The chosen backend of each graph, by graph name (empty unless TUNED)."""
        return {spec.name: backend for spec, backend in zip(self._tt_graphs, self._tt_routes.values())}

    def tune(self, device: str | torch.device | None = None, strategy: Any = None, dry_run: bool = False,
             report: Any = None) -> Any:
        """Tune every recorded graph; see :mod:`torch_tweak.torch.tuning`. Returns the module's report."""
        from torch_tweak.torch.tuning import tune_module

        return tune_module(self, device, strategy, dry_run, report)

    def activate(self) -> None:
        """Make the chosen backends ready for inference (after :meth:`deactivate`)."""
        for backend in self._tt_routes.values():
            if backend.state.name in ("INACTIVE", "CHECKPOINT_LOADED"):
                backend.activate()

    def deactivate(self) -> None:
        """Release the chosen backends' resources (only for backends built in this process)."""
        for backend in self._tt_routes.values():
            if backend.state.name == "ACTIVE":
                backend.deactivate()

    def enable_passthrough(self) -> None:
        """Run the original module from now on (drops tuned backends)."""
        if self._tt_offloaded:
            raise TuningError(
                f"Module {self._tt_name!r} cannot run its original code: its weights were offloaded to "
                f"{_config.device_after_tuning!r} after tuning. Reload the model to get them back."
            )
        self.deactivate()
        self._tt_routes.clear()
        self._tt_state = ModuleState.PASSTHROUGH

    def _tt_set_tuned(self, graphs: list[GraphSpec], routes: dict[tuple[Any, ...], Any]) -> None:
        """Enter TUNED: ``routes`` maps each graph's key to its backend (same order as ``graphs``)."""
        self._tt_routes = dict(routes)
        self._tt_graphs = list(graphs)
        self._tt_phases = any(g.phase is not None for g in graphs)
        self._tt_strict_key = graphs[0].strict if graphs else _config.strict_mode
        self._tt_recorder = None
        self._tt_state = ModuleState.TUNED

    # dispatch -----------------------------------------------------------------------------------

    def _tt_dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tls = self._tt_tls
        if getattr(tls, "busy", False):
            return self._tt_original(*args, **kwargs)
        tls.busy = True
        try:
            if self._tt_state is ModuleState.TUNED:
                routes = self._tt_routes
                backend = routes.get(graph_key(args, kwargs, self._tt_strict_key, self._tt_phases))
                if backend is None:
                    return self._tt_unknown(args, kwargs)
                return backend.infer(*args, **kwargs)
            session = current_session()
            if session is None:
                return self._tt_original(*args, **kwargs)
            return self._tt_record(session, args, kwargs)
        finally:
            tls.busy = False

    def _tt_record(self, session: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._tt_session_id != session.id or self._tt_recorder is None:
            config = _config
            self._tt_recorder = Recorder(config.strict_mode, config.max_num_samples_stored, config.llm_phase_detection)
            self._tt_session_id = session.id
            self._tt_state = ModuleState.RECORDING
        session.note(self)
        return self._tt_recorder.record_call(self._tt_original, args, kwargs, session.batch_size)

    def _tt_unknown(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _config.on_unknown_signature == "passthrough" and not self._tt_offloaded:
            logger.debug("Module %s: no tuned graph matches; running the original module", self._tt_name)
            return self._tt_original(*args, **kwargs)
        raise SignatureMismatchError(
            f"Module {self._tt_name!r} was called with inputs that match none of its {len(self._tt_graphs)} tuned "
            f"graph(s).\n  got:      {describe_call(args, kwargs)}\n  expected: "
            + "\n            ".join(describe_graph_inputs(g) for g in self._tt_graphs)
            + "\nAdd such inputs to the tuning dataset and re-tune, or set tt.config.on_unknown_signature = "
            "'passthrough' (needs tt.config.device_after_tuning = None so the original weights stay in memory)."
        )


def describe_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``args[0]: float32[2, 3], kwargs['mask']: None`` style summary of a call."""
    leaves, structure = flatten_sample(args, kwargs)
    parts = [f"{p}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for p, t in zip(sample_leaf_paths(structure), leaves)]
    extra = [f"{k}={v!r:.40}" for k, v in kwargs.items() if not isinstance(v, torch.Tensor)]
    return ", ".join(parts + extra) or "no tensors"


def describe_graph_inputs(graph: GraphSpec) -> str:
    """``graph 0: args[0]: float32[batch0, 3]`` style summary of a graph's inputs."""
    parts = [f"{t.locator}: {t.dtype}[{', '.join(str(s) for s in t.shape)}]" for t in graph.inputs]
    return f"graph {graph.name}: " + (", ".join(parts) or "no tensors")


def _check_strategies(strategy: Any, strategies: Any) -> None:
    from torch_tweak.torch.tune_strategy.base import TuneStrategy

    if strategy is not None and not isinstance(strategy, TuneStrategy):
        raise ConfigError(f"strategy must be a TuneStrategy, got {type(strategy).__name__}.")
    if strategies is None:
        return
    values = strategies.values() if isinstance(strategies, dict) else strategies
    if not isinstance(strategies, (list, tuple, dict)) or not all(isinstance(s, TuneStrategy) for s in values):
        raise ConfigError("strategies must be a list of TuneStrategy (one per graph) or a dict {graph name: TuneStrategy}.")


def _register(proxy: Module, module: nn.Module, name: str | None) -> str:
    if name is not None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"A tt.Module name must be a non-empty string, got {name!r}.")
        clean = _NAME_RE.sub("_", name.strip())
        if clean in _REGISTRY:
            raise ConfigError(
                f"A tt.Module named {clean!r} already exists; two modules may not share a name (it keys cache "
                "folders and checkpoints). Pass a different name."
            )
    else:
        base = _NAME_RE.sub("_", f"{type(module).__module__}.{type(module).__qualname__}")
        clean, n = base, 1
        while clean in _REGISTRY:
            clean, n = f"{base}_{n}", n + 1
        if n > 1:
            logger.info("Named the wrapped %s %r (the name %r is taken)", type(module).__name__, clean, base)
    _REGISTRY[clean] = proxy
    return clean


def registered_modules() -> dict[str, Module]:
    """Live ``tt.Module`` objects by name."""
    return dict(_REGISTRY)


def unwrap(module: Any) -> Any:
    """The wrapped module of a ``tt.Module``, or ``module`` itself."""
    return object.__getattribute__(module, "_tt_module") if type(module) is Module else module


def proxy_of(module: Any) -> Module | None:
    """The ``tt.Module`` wrapping ``module`` (``module`` itself if it is one), or None if it is not wrapped."""
    if type(module) is Module:
        return module
    forward = module.__dict__.get("forward") if isinstance(module, nn.Module) else None
    return forward.proxy if isinstance(forward, _Interceptor) else None


def release(proxy: Module) -> None:
    """Undo the wrapping of ``proxy``: its module gets its own forward back and the name is freed.

    Used to roll back a ``tt.load`` that created the proxy and then failed; the proxy must not be used again.
    """
    _forward.uninstall(object.__getattribute__(proxy, "_tt_module"))
    name = object.__getattribute__(proxy, "_tt_name")
    if _REGISTRY.get(name) is proxy:
        del _REGISTRY[name]
