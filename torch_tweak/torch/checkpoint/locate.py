"""Where tuned modules live in a model or pipeline, as paths of steps that a checkpoint can store.

A step is ``("child", name)`` for an ``nn.Module`` child, ``("attr", name)`` for an attribute of a plain
object (a pipeline), ``("item", key)`` for a dict entry and ``("index", i)`` for a list or tuple entry.
The search goes through ``nn.Module`` children (``_modules``, so a ``tt.Module`` held by a parent is found),
plain objects' attributes, dicts, lists and tuples, and never calls properties or user code.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from torch import nn

from torch_tweak.errors import CheckpointError
from torch_tweak.torch.checkpoint.manifest import path_text
from torch_tweak.torch.module.wrapper import Module, proxy_of

Step = tuple[str, "str | int"]
MAX_DEPTH = 32
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, str, bytes)


@dataclass
class Found:
    """A wrapped module found in an object."""

    path: list[Step]
    proxy: Module


def _children(value: Any) -> list[tuple[Step, Any]]:
    """The steps below ``value`` (a proxy counts as its wrapped module)."""
    if type(value) is Module:
        value = value.wrapped
    if isinstance(value, nn.Module):
        return [(("child", k), v) for k, v in value._modules.items() if v is not None]
    if type(value) is dict:
        return [(("item", k), v) for k, v in value.items() if isinstance(k, (str, int)) and not isinstance(k, bool)]
    if type(value) in (list, tuple):
        return [(("index", i), v) for i, v in enumerate(value)]
    if isinstance(value, _OPAQUE) or not hasattr(value, "__dict__") or type(value).__module__ == "builtins":
        return []
    try:
        attributes = vars(value)
    except TypeError:
        return []
    return [(("attr", k), v) for k, v in attributes.items() if isinstance(k, str) and not k.startswith("__")]


def find_wrapped(obj: Any) -> list[Found]:
    """Every ``tt.Module`` reachable from ``obj``, each once, at the first path found (depth-first)."""
    found: list[Found] = []
    seen: set[int] = set()
    stack: list[tuple[list[Step], Any]] = [([], obj)]
    while stack:
        path, value = stack.pop()
        proxy = proxy_of(value) if isinstance(value, nn.Module) else None
        key = id(proxy.wrapped) if proxy is not None else id(value)
        if key in seen or len(path) > MAX_DEPTH:
            continue
        seen.add(key)
        if proxy is not None:
            found.append(Found(path, proxy))
        for step, child in reversed(_children(value)):
            stack.append((path + [step], child))
    return found


def nested_prefixes(path: list[Step], others: list[list[Step]]) -> list[str]:
    """State-dict prefixes of the modules at ``others`` that sit inside the module at ``path`` (children only)."""
    depth = len(path)
    return [".".join(str(key) for _, key in other[depth:]) for other in others
            if len(other) > depth and other[:depth] == path and all(kind == "child" for kind, _ in other[depth:])]


@dataclass
class Slot:
    """Where a module sits: its container and the step that reaches it (no container for the root)."""

    container: Any
    step: Step | None
    value: Any


def _keys(container: Any) -> list[str]:
    return [str(step[1]) for step, _ in _children(container)][:20]


def resolve(obj: Any, path: list[Step], name: str) -> Slot:
    """Follow ``path`` from ``obj`` without changing anything; raise CheckpointError naming the failing step."""
    container, value = None, obj
    for depth, (kind, key) in enumerate(path):
        base = value.wrapped if type(value) is Module else value
        here = path_text(path[:depth]) if depth else "the object"
        missing = f"The checkpoint has module {name!r} at {path_text(path)}, but {here} has no"
        if kind == "child":
            if not isinstance(base, nn.Module) or base._modules.get(key) is None:
                raise CheckpointError(f"{missing} child module {key!r} (it has {_keys(base)}). Load into the same "
                                      "model or pipeline class that was saved.")
            child = base._modules[key]
        elif kind == "attr":
            attributes = getattr(base, "__dict__", None)
            if isinstance(base, nn.Module) or not isinstance(attributes, dict) or key not in attributes:
                raise CheckpointError(f"{missing} attribute {key!r} (it has {_keys(base)}). Load into the same "
                                      "pipeline class that was saved.")
            child = attributes[key]
        elif kind == "item":
            if type(base) is not dict or key not in base:
                raise CheckpointError(f"{missing} dict entry {key!r}. Load into the same pipeline that was saved.")
            child = base[key]
        else:
            if type(base) not in (list, tuple) or not isinstance(key, int) or not 0 <= key < len(base):
                raise CheckpointError(f"{missing} list entry {key!r}. Load into the same pipeline that was saved.")
            child = base[key]
        container, value = base, child
    if not isinstance(value, nn.Module):
        raise CheckpointError(f"The checkpoint has module {name!r} at {path_text(path)}, but the object there is a "
                              f"{type(value).__name__}, not a torch module.")
    return Slot(container, path[-1] if path else None, value)


def place(slot: Slot, proxy: Module) -> Any:
    """Put ``proxy`` where the module was; return what to pass to :func:`put_back` to undo it (None: nothing done)."""
    if slot.step is None or slot.value is proxy:
        return None
    kind, key = slot.step
    container = slot.container
    if kind == "child":
        container._modules[key] = proxy
    elif kind == "attr":
        setattr(container, key, proxy)  # type: ignore[arg-type]
    elif type(container) is tuple:
        return None  # a tuple cannot change; the interception still routes calls to the proxy
    else:
        container[key] = proxy
    return slot


def put_back(slot: Slot) -> None:
    """Undo :func:`place`."""
    kind, key = slot.step  # type: ignore[misc]
    if kind == "child":
        slot.container._modules[key] = slot.value
    elif kind == "attr":
        setattr(slot.container, key, slot.value)  # type: ignore[arg-type]
    else:
        slot.container[key] = slot.value
