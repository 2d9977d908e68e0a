"""Access to a wrapped module's own forward, bypassing torch_tweak's interception and the module's hooks.

``tt.Module`` intercepts calls by installing an instance attribute ``forward`` on the wrapped module.
Backends that run the PyTorch module must call :func:`original_forward` (not ``module(...)``), and
builds that export or compile the module run inside :func:`pristine`, which removes the interception
and the module's own hooks until the block ends.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

_ORIGINAL: weakref.WeakKeyDictionary[nn.Module, Callable[..., Any] | None] = weakref.WeakKeyDictionary()
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


def _global_hook_dicts() -> tuple[Any, ...] | None:
    """torch's process-wide module hook registries (``register_module_forward_hook`` and friends), or None when this
    torch keeps them elsewhere: then no call skips ``nn.Module.__call__``."""
    names = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
             "_global_backward_hooks")
    found = tuple(getattr(_nn_module, name, None) for name in names)
    return found if all(isinstance(d, dict) for d in found) else None


_GLOBAL_HOOKS = _global_hook_dicts()
_TRACING = getattr(torch._C, "_get_tracing_state", None)


def calls_straight_through(module: nn.Module, interceptor: Callable[..., Any]) -> bool:
    """True when ``module(...)`` would do nothing but call ``interceptor``: it is still the module's forward, the module
    has no hooks of its own, no process-wide module hooks are registered, it was not compiled in place
    (``module.compile()``) and no TorchScript trace is running. The holder of ``interceptor`` may then call it
    directly and skip ``nn.Module.__call__`` (about 1 µs of a call); any of these conditions sends the call through
    ``module(...)`` as usual, so hooks run and tracing sees the module."""
    hooks, tracing = _GLOBAL_HOOKS, _TRACING
    if hooks is None or tracing is None or module.__dict__.get("forward") is not interceptor:
        return False
    if (module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks
            or hooks[0] or hooks[1] or hooks[2] or hooks[3]):
        return False
    return getattr(module, "_compiled_call_impl", None) is None and not tracing()


def install(module: nn.Module, interceptor: Callable[..., Any]) -> None:
    """Route ``module``'s forward through ``interceptor``; remember the forward it replaces."""
    if module in _ORIGINAL:
        raise RuntimeError("module is already intercepted")
    _ORIGINAL[module] = module.__dict__.get("forward")
    object.__setattr__(module, "forward", interceptor)


def uninstall(module: nn.Module) -> None:
    """Undo :func:`install`."""
    previous = _ORIGINAL.pop(module, None)
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        object.__setattr__(module, "forward", previous)


def is_intercepted(module: nn.Module) -> bool:
    """True while ``module`` is wrapped by a ``tt.Module``."""
    return module in _ORIGINAL


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The module's own forward (without hooks and without torch_tweak's interception)."""
    if module in _ORIGINAL:
        previous = _ORIGINAL[module]
        if previous is not None:
            return previous
        return type(module).forward.__get__(module)
    return module.forward


@contextlib.contextmanager
def pristine(module: nn.Module) -> Iterator[nn.Module]:
    """Temporarily give ``module`` back its own forward and no hooks, e.g. to export or compile it."""
    intercepted = module in _ORIGINAL
    saved_forward = module.__dict__.get("forward")
    saved_hooks = {name: getattr(module, name) for name in _HOOK_DICTS if hasattr(module, name)}
    if intercepted:
        previous = _ORIGINAL[module]
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            object.__setattr__(module, "forward", previous)
    for name in saved_hooks:
        object.__setattr__(module, name, OrderedDict())
    try:
        yield module
    finally:
        for name, hooks in saved_hooks.items():
            object.__setattr__(module, name, hooks)
        if intercepted:
            if saved_forward is None:
                module.__dict__.pop("forward", None)
            else:
                object.__setattr__(module, "forward", saved_forward)
