"""``tt.Module``: a transparent proxy that records, tunes and dispatches a wrapped ``nn.Module``.

The proxy forwards attribute access, ``isinstance``, indexing and iteration to the wrapped module,
and installs an interceptor as the module's instance ``forward``, so calls through the proxy, through
a parent module or through any other reference reach torch_tweak while the module's hooks keep
running once per call. States::

    INIT ──(called inside tt.tune)──▶ RECORDING ──tune()──▶ TUNED
                                         └──(tuning failed)──▶ PASSTHROUGH
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import ConfigError, SignatureMismatchError, TuningError, UnsupportedInputError
from torch_tweak.torch.config import config as _config
from torch_tweak.torch.integrations import activate_integrations
from torch_tweak.torch.module import forward as _forward
from torch_tweak.torch.module.compat import ReferenceMembers
from torch_tweak.torch.module.recording import graph_key
from torch_tweak.torch.module.serving import changes
from torch_tweak.torch.module.session import current_session
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.state import ModuleInternals, ModuleState, internals
from torch_tweak.torch.module.tree import flatten_sample, sample_leaf_paths

logger = logging.getLogger(__name__)

_REGISTRY: weakref.WeakValueDictionary[str, Module] = weakref.WeakValueDictionary()
_TUNED = ModuleState.TUNED
_Tensor = torch.Tensor
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")


class _Interceptor:
    """Installed as the wrapped module's ``forward``; hands every call to the proxy."""

    __slots__ = ("proxy",)

    def __init__(self, proxy: Module) -> None:
        self.proxy = proxy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.proxy._tt_dispatch(args, kwargs)


class Module(ReferenceMembers):
    """Wrap ``module`` so ``tt.tune`` can record, tune and then accelerate it.

    Members named as in the reference Torch Tweak (``device``, ``module``, ``enable_recording``, ``to_dict``...)
    come from :class:`~torch_tweak.torch.module.compat.ReferenceMembers`.

    Args:
        module: the ``nn.Module`` to wrap.
        name: unique name (cache folders, reports, checkpoints); defaults to the class path, made
            unique with a numeric suffix. An explicit name already used by another live module is refused.
        strategy: the strategy for every graph of this module.
        strategies: one strategy per graph, as a list (graph creation order) or a dict keyed by graph name.
    """

    def __init__(self, module: nn.Module, name: str | None = None, strategy: Any = None, strategies: Any = None) -> None:
        if isinstance(module, Module):
            raise ConfigError(f"{module.name!r} is already a tt.Module; wrap each module once.")
        if not isinstance(module, nn.Module):
            raise UnsupportedInputError(f"tt.Module wraps torch.nn.Module objects, got {type(module).__name__}.")
        if _forward.is_intercepted(module):
            raise ConfigError(f"This {type(module).__name__} is already wrapped by another tt.Module.")
        if strategy is not None and strategies is not None:
            raise ConfigError("Only one of strategy or strategies should be provided")
        _check_strategies(strategy, strategies)
        activate_integrations()
        state = ModuleInternals(module, _register(self, module, name), strategy, strategies,
                                _forward.original_forward(module))
        object.__setattr__(self, "_tt", state)
        state.interceptor = _Interceptor(self)
        _forward.install(module, state.interceptor)

    # transparency -------------------------------------------------------------------------------

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._tt.module)

    def __getattr__(self, name: str) -> Any:
        if name == "_tt":
            raise AttributeError(name)
        return getattr(self._tt.module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_tt":
            raise AttributeError("the state of a tt.Module cannot be replaced")
        setattr(self._tt.module, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._tt.module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self._tt
        if _forward.calls_straight_through(state.module, state.interceptor):  # the same call, without nn.Module's
            return self._tt_dispatch(args, kwargs)
        return state.module(*args, **kwargs)

    def __getitem__(self, index: Any) -> Any:
        return self._tt.module[index]

    def __len__(self) -> int:
        return len(self._tt.module)

    def __iter__(self) -> Any:
        return iter(self._tt.module)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._tt.module)) | {"name", "state", "graph_specs", "backends", "tune", "wrapped"})

    def __repr__(self) -> str:
        return f"tt.Module(name={self._tt.name!r}, state={self._tt.status.name})[{self._tt.module!r}]"

    # public API ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The module's unique name."""
        return self._tt.name

    @property
    def state(self) -> ModuleState:
        """INIT, RECORDING, TUNED or PASSTHROUGH."""
        return self._tt.status

    @property
    def wrapped(self) -> nn.Module:
        """The wrapped ``nn.Module``."""
        return self._tt.module

    @property
    def graph_specs(self) -> list[GraphSpec]:
        """The graphs recorded (or loaded) for this module."""
        state = self._tt
        if state.graphs:
            return [g.spec for g in state.graphs]
        if state.recorder is None or not state.recorder.graphs:
            raise TuningError(f"Module {state.name!r} has recorded no call yet; run tt.tune first.")
        return state.recorder.graph_specs()

    @property
    def backends(self) -> dict[str, Any]:
        """The chosen backend of each graph, by graph name (empty unless TUNED)."""
        return {g.spec.name: g.backend for g in self._tt.graphs}

    def tune(self, device: str | torch.device | None = None, strategy: Any = None, dry_run: bool = False,
             report: Any = None) -> Any:
        """Tune every recorded graph; see :mod:`torch_tweak.torch.tuning`. Returns the module's report."""
        if _TUNER is None:
            raise TuningError("tt.Module.tune needs torch_tweak.torch.tuning; import torch_tweak.torch first.")
        return _TUNER(self, device, strategy, dry_run, report)

    def activate(self) -> None:
        """Make the chosen backends ready for inference (after :meth:`deactivate`)."""
        for backend in self._tt.backends():
            backend.ensure_active()

    def deactivate(self) -> None:
        """Release the chosen backends' resources (only for backends built in this process)."""
        for backend in self._tt.backends():
            backend.release()

    def enable_passthrough(self, force: bool = False) -> None:
        """Run the original module from now on (drops tuned backends).

        ``force`` is accepted for the reference's spelling; a tuned module switches without it.
        """
        state = self._tt
        if state.offloaded:
            raise TuningError(
                f"Module {state.name!r} cannot run its original code: its weights were offloaded to "
                f"{_config.device_after_tuning!r} after tuning. Reload the model to get them back."
            )
        self.deactivate()
        state.mark_passthrough("passthrough enabled")

    # dispatch -----------------------------------------------------------------------------------

    def _tt_dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = self._tt
        tls = state.tls
        if getattr(tls, "busy", False):
            return state.original(*args, **kwargs)
        tls.busy = True
        try:
            if state.status is _TUNED:
                if state.serving_count != changes.count:
                    state.refresh_serving()
                # a call of one plain tensor has the dispatch key of its rank (tree.signature): a lookup by rank
                # skips computing the key (about 1 µs of a call of a small model)
                sole = not kwargs and len(args) == 1 and type(args[0]) is _Tensor
                serve = state.serving_by_rank.get(args[0].dim()) if sole else None
                if serve is None:
                    serve = state.serving.get(graph_key(args, kwargs, state.strict_key, state.phases))
                    if serve is None:
                        return self._tt_unknown(args, kwargs)
                    if sole:
                        state.serving_by_rank[args[0].dim()] = serve
                try:
                    return serve(*args, **kwargs)
                except UnsupportedInputError as exc:
                    key = graph_key(args, kwargs, state.strict_key, state.phases)
                    return self._tt_unservable(state.routes[key], exc, args, kwargs)
            session = current_session()
            if session is None:
                return state.original(*args, **kwargs)
            return self._tt_record(session, args, kwargs)
        finally:
            tls.busy = False

    def _tt_record(self, session: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = self._tt
        recorder = state.recorder
        if state.session_id != session.id or recorder is None:
            recorder = state.start_recording(session.id, _config.strict_mode, _config.max_num_samples_stored,
                                             _config.llm_phase_detection and _config.enable_hf_integrations,
                                             session.stores_for(self), session.known_for(self))
        session.note(self)
        # a call may go unrun only when nothing but tt.tune sees its outputs (no forward hook of the module or global)
        lazy = session.lazy_for(self) and _forward.calls_straight_through(state.module, state.interceptor)
        return recorder.record_call(state.original, args, kwargs, session.batch_size, lazy)

    def _tt_unservable(self, backend: Any, exc: UnsupportedInputError, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        """A call the chosen backend cannot serve (e.g. a shape its runtime refuses) runs the original module when
        its weights are still here; the first such call of each backend is logged."""
        state = self._tt
        if state.offloaded:
            raise exc
        if id(backend) not in state.unservable_logged:
            state.unservable_logged.add(id(backend))
            logger.warning("Module %s: %s cannot serve a call (%s); such calls run the original module.", state.name,
                           backend.describe(), exc)
        return state.original(*args, **kwargs)

    def _tt_unknown(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = self._tt
        if _config.on_unknown_signature == "passthrough" and not state.offloaded:
            logger.debug("Module %s: no tuned graph matches; running the original module", state.name)
            return state.original(*args, **kwargs)
        specs = [g.spec for g in state.graphs]
        raise SignatureMismatchError(
            f"Module {state.name!r} was called with inputs that match none of its {len(specs)} tuned "
            f"graph(s).\n  got:      {describe_call(args, kwargs)}\n  expected: "
            + "\n            ".join(describe_graph_inputs(g) for g in specs)
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


def _is_strategy(value: Any) -> bool:
    """A tuning strategy as tuning uses it (a ``TuneStrategy``: ``tune(task)`` and ``describe()``); checked by
    behaviour because strategies live in a layer above this one."""
    return callable(getattr(value, "tune", None)) and callable(getattr(value, "describe", None))


def _check_strategies(strategy: Any, strategies: Any) -> None:
    if strategy is not None and not _is_strategy(strategy):
        raise ConfigError(f"strategy must be a TuneStrategy, got {type(strategy).__name__}.")
    if strategies is None:
        return
    values = strategies.values() if isinstance(strategies, dict) else strategies
    if not isinstance(strategies, (list, tuple, dict)) or not all(_is_strategy(s) for s in values):
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


def hand_over_name(name: str) -> Callable[[], None]:
    """Free ``name`` for a new ``tt.Module`` (``tt.load`` into a fresh model while the tuned one is alive).

    The live module keeps its name and keeps working; only the registry answers the new one from then on.
    Returns a function that gives the name back (used to roll back a failed load).
    """
    old = _REGISTRY.get(name)
    if old is None:
        return lambda: None
    del _REGISTRY[name]
    logger.info("The name %r moves to the module being loaded; the live module of that name keeps working", name)

    def undo() -> None:
        if name not in _REGISTRY:
            _REGISTRY[name] = old

    return undo


def registered_modules() -> dict[str, Module]:
    """Live ``tt.Module`` objects by name."""
    return dict(_REGISTRY)


def unwrap(module: Any) -> Any:
    """The wrapped module of a ``tt.Module``, or ``module`` itself."""
    return internals(module).module if type(module) is Module else module


_TUNER: Callable[..., Any] | None = None


def set_tuner(tune_module: Callable[..., Any]) -> None:
    """Install the function behind :meth:`Module.tune` (``tuning.tune_module``; tuning sits above this layer)."""
    global _TUNER
    _TUNER = tune_module


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
    state = internals(proxy)
    _forward.uninstall(state.module)
    name = state.name
    if _REGISTRY.get(name) is proxy:
        del _REGISTRY[name]
