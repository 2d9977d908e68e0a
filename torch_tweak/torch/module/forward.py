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

from torch import nn

_ORIGINAL: weakref.WeakKeyDictionary[nn.Module, Callable[..., Any] | None] = weakref.WeakKeyDictionary()
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


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
