"""Members of ``tt.Module`` that code written for the reference Torch Tweak uses (``docs/migrating.md``).

They are thin views of torch_tweak's own state. Two names of the reference (``device`` and ``module``) are
also common attribute names of wrapped models (Hugging Face models have ``device``, ``DataParallel`` and
others have ``module``): when the wrapped module has its own, that one wins, so wrapping never changes what
an attribute of the model returns.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import CheckpointError, TuningError
from torch_tweak.torch.module.state import ModuleState, internals

logger = logging.getLogger(__name__)

_DICT_TYPE = "Module"


def _own(inner: nn.Module, name: str) -> bool:
    """Whether the wrapped module itself has an attribute ``name`` (child, instance attribute or class member)."""
    return name in inner._modules or name in inner.__dict__ or hasattr(type(inner), name)


class TuningView:
    """What a ``tt.Module`` chose, under the reference's ``module.module`` spelling."""

    __slots__ = ("_proxy",)

    def __init__(self, proxy: Any) -> None:
        self._proxy = proxy

    @property
    def name(self) -> str:
        """The module's name."""
        return internals(self._proxy).name

    @property
    def state(self) -> ModuleState:
        """The module's state."""
        return internals(self._proxy).status

    @property
    def backends(self) -> dict[str, Any]:
        """The chosen backend of each graph, by graph name."""
        return {g.spec.name: g.backend for g in internals(self._proxy).graphs}

    @property
    def graph_specs(self) -> list[Any]:
        """The module's graphs."""
        return self._proxy.graph_specs

    def __repr__(self) -> str:
        return f"TuningView(name={self.name!r}, state={self.state.name}, graphs={list(self.backends)})"


class ReferenceMembers:
    """Mixed into ``tt.Module``; see the module docstring."""

    @property
    def device(self) -> torch.device:
        """Where the module runs: the first chosen backend's device when tuned, else the wrapped module's
        (its own ``device`` attribute if it has one, else its first parameter's device, else ``cpu``)."""
        state = internals(self)
        if _own(state.module, "device"):
            return state.module.device
        for backend in state.backends():
            device = getattr(backend, "device", None)
            if device is not None:
                return torch.device(device)
        tensor = next(iter(state.module.parameters()), None)
        return tensor.device if tensor is not None else torch.device("cpu")

    @property
    def module(self) -> Any:
        """The reference's "inner implementation" of the proxy: a :class:`TuningView` with ``backends``,
        ``state``, ``name`` and ``graph_specs``. A wrapped module with its own ``module`` attribute keeps it.

        The view is not a module and has no ``module`` attribute, so helpers that unwrap ``x.module``
        repeatedly (as done for ``DataParallel``) stop there instead of looping on the proxy.
        """
        inner = internals(self).module
        return inner.module if _own(inner, "module") else TuningView(self)

    def enable_recording(self, force: bool = False) -> None:
        """Make the module record again in the next ``tt.tune`` (it records by itself when first tuned).

        A tuned module needs ``force=True``: its backends are released and it is tuned again from scratch.
        """
        state = internals(self)
        if state.status is ModuleState.TUNED and not force:
            raise TuningError(f"Module {state.name!r} is tuned; enable_recording(force=True) drops its backends so "
                              "the next tt.tune records and tunes it again.")
        if state.offloaded:
            raise TuningError(f"Module {state.name!r} cannot record: its weights were released after tuning "
                              "(tt.config.device_after_tuning). Reload the model to record it again.")
        for backend in state.backends():
            backend.release()
        state.clear_tuning()
        state.recorder, state.session_id = None, None
        state.status = ModuleState.INIT

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description of the tuned module: name, state, and per graph its spec and backend.

        The reference saved this dict with pickle; here it only describes, and ``tt.save`` writes the checkpoint.
        """
        state = internals(self)
        if state.status is not ModuleState.TUNED:
            raise TuningError(f"Module {state.name!r} is {state.status.name}, not TUNED; tune it before to_dict().")
        return {"type": _DICT_TYPE, "name": state.name, "state": state.status.value,
                "graphs": [{"name": g.spec.name, "graph_spec": g.spec.to_dict(), "backend": g.backend.describe()}
                           for g in state.graphs]}

    @staticmethod
    def from_dict(module: nn.Module, state_dict: dict[str, Any], device: Any = None) -> Any:
        """Not supported: a tuned module is restored only from a verified checkpoint, with ``tt.load``."""
        raise CheckpointError(
            "tt.Module.from_dict is not supported: a dict cannot carry backend artifacts safely, and torch_tweak "
            "never restores backends from unverified data. Save with tt.save(model, 'x.tt') and restore with "
            "tt.load(model, 'x.tt') (docs/migrating.md)."
        )

    @staticmethod
    def is_state_dict_valid(state_dict: Any) -> bool:
        """Whether ``state_dict`` has the shape of :meth:`to_dict`'s result."""
        return (isinstance(state_dict, dict) and state_dict.get("type") == _DICT_TYPE
                and isinstance(state_dict.get("name"), str) and isinstance(state_dict.get("graphs"), list))
