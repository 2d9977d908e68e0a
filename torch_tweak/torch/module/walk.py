"""Walking a model or pipeline object: the ``nn.Module`` objects reachable from it, and where each one is held.

``tt.inspect`` and ``tt.wrap`` find modules inside user objects and put ``tt.Module`` proxies where they
were; ``tt.save`` finds the proxies and ``tt.load`` follows the stored paths back and puts proxies in
place. They share this walk, its steps and its :class:`Slot`. A path is a list of steps from the walked
object (``[]`` is the object itself); a step is

* ``("child", name)``: a child of an ``nn.Module``, read from ``_modules`` (so a proxy held by a parent is
  found, and the proxy's module is entered through it);
* ``("attr", name)``: an entry of a plain object's ``__dict__`` (no property or other user code runs);
* ``("item", key)``: a dict entry;
* ``("index", i)``: a list or tuple position.

Checkpoints store paths as these steps (``checkpoint/manifest.py``), so a *storable* walk takes only steps
that can be stored and followed again: plain dicts with str or int keys, plain lists and tuples, and the
attributes of instances of user classes (not of Python modules, functions or builtins), up to
:data:`MAX_STORED_STEPS` steps deep. Without ``storable`` the walk also enters dict, list and tuple
subclasses and any object with a ``__dict__``, as ``tt.inspect`` does to find every module a pipeline may run.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module.wrapper import Module, proxy_of, unwrap

Step = tuple[str, Any]
#: Steps a storable walk goes down at most (modules deeper down are not found, so not stored).
MAX_STORED_STEPS = 32
# Values a walk never enters: leaves for any walk, and objects whose attributes a storable walk leaves alone.
_LEAVES = (str, bytes, int, float, bool, complex, type(None), type)
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, str, bytes)


@dataclass(frozen=True, eq=False)
class Slot:
    """Where a value is held: ``container`` and the ``step`` from it (both None for the walked object itself).

    ``value`` is what the slot held when it was found, which :meth:`undo` puts back.
    """

    container: Any
    step: Step | None
    value: Any

    def get(self) -> Any:
        """What the slot holds now."""
        if self.step is None:
            return self.value
        kind, key = self.step
        if kind == "child":
            return self.container._modules[key]
        if kind == "attr":
            return vars(self.container)[key]
        return self.container[key]

    @property
    def settable(self) -> bool:
        """False for the walked object itself (nothing holds it) and for a tuple's items (a tuple cannot change)."""
        return self.step is not None and not (self.step[0] in ("item", "index") and isinstance(self.container, tuple))

    def set(self, value: Any) -> None:
        """Put ``value`` in the slot."""
        if self.step is None:
            raise UnsupportedInputError("The walked object itself is held by nothing this walk can change; use the "
                                        "new value in its place instead.")
        kind, key = self.step
        if kind == "child":
            self.container._modules[key] = value
        elif kind == "attr":
            setattr(self.container, key, value)
        elif isinstance(self.container, tuple):
            raise UnsupportedInputError(f"Cannot replace item {key!r} of a {type(self.container).__name__}: a tuple "
                                        "cannot change. Hold the module in a list, a dict or an attribute instead.")
        else:
            self.container[key] = value

    def undo(self) -> None:
        """Put back the value the slot held when it was found."""
        self.set(self.value)


@dataclass
class Found:
    """A module reached by :func:`walk`.

    Attributes:
        path: the steps from the walked object (``[]``: the object itself).
        module: the module (for a proxy, the module it wraps).
        proxy: the ``tt.Module`` wrapping it, or None.
        depth: 0 for the walked object, +1 per module nesting level; a plain (non-module) walked object's
            attributes also count as a level (``pipe.unet`` is at depth 1), containers do not.
        parent: the path of the closest enclosing module, or None.
        slot: where the module is held.
    """

    path: list[Step]
    module: nn.Module
    proxy: Module | None
    depth: int
    parent: list[Step] | None
    slot: Slot

    @property
    def name(self) -> str:
        """The path as text (:func:`path_name`)."""
        return path_name(self.path)


def path_name(path: Sequence[Step]) -> str:
    """A path as text: ``[("attr", "unet"), ("child", "0")]`` → ``unet.0``, ``[("item", "k"), ("index", 0)]`` →
    ``['k'][0]``, the walked object itself → ``""``."""
    return "".join(f".{key}" if kind in ("child", "attr") else f"[{key!r}]" for kind, key in path).removeprefix(".")


def steps_below(value: Any, storable: bool) -> list[tuple[Step, Any]]:
    """The steps one level below ``value`` and what each reaches (a proxy counts as its module), in order."""
    value = unwrap(value)
    if isinstance(value, nn.Module):
        return [(("child", k), v) for k, v in value._modules.items() if v is not None]
    if type(value) is dict or (not storable and isinstance(value, dict)):
        return [(("item", k), v) for k, v in value.items()
                if not storable or (isinstance(k, (str, int)) and not isinstance(k, bool))]
    if type(value) in (list, tuple) or (not storable and isinstance(value, (list, tuple))):
        return [(("index", i), v) for i, v in enumerate(value)]
    if isinstance(value, _OPAQUE if storable else _LEAVES) or (storable and type(value).__module__ == "builtins"):
        return []
    if not hasattr(value, "__dict__"):
        return []
    try:
        attributes = vars(value)
    except TypeError:
        return []
    return [(("attr", k), v) for k, v in attributes.items() if isinstance(k, str) and not k.startswith("__")]


def walk(obj: Any, *, storable: bool = False, max_depth: int | None = None) -> Iterator[Found]:
    """Yield every module reachable from ``obj`` (``obj`` first if it is one), each once, parents before children.

    Depth-first in the order of :func:`steps_below`; a module reachable along several paths (or a cycle) is
    reported at the first. A proxy and the module it wraps are the same module. ``max_depth`` stops the walk
    below modules at that :attr:`Found.depth`; ``storable`` keeps to the steps a checkpoint can store.
    """
    seen: set[int] = set()
    stack: list[tuple[list[Step], Any, int, list[Step] | None, Slot]] = [([], obj, 0, None, Slot(None, None, obj))]
    while stack:
        path, value, depth, parent, slot = stack.pop()
        if storable and len(path) > MAX_STORED_STEPS:
            continue
        target = unwrap(value)
        if id(target) in seen:
            continue
        seen.add(id(target))
        inner_parent = parent
        if isinstance(target, nn.Module):
            yield Found(path, target, proxy_of(value), depth, parent, slot)
            if max_depth is not None and depth >= max_depth:
                continue
            inner_parent = path
        children = []
        for step, child in steps_below(target, storable):
            level = depth + 1 if step[0] == "child" or (step[0] == "attr" and not path) else depth
            children.append((path + [step], child, level, inner_parent, Slot(target, step, child)))
        stack.extend(reversed(children))


def find_wrapped(obj: Any) -> list[Found]:
    """Every ``tt.Module`` reachable from ``obj`` along storable steps, each once, at the first path found."""
    return [found for found in walk(obj, storable=True) if found.proxy is not None]


def nested_prefixes(path: list[Step], others: list[list[Step]]) -> list[str]:
    """State-dict prefixes of the modules at ``others`` that sit inside the module at ``path`` (children only)."""
    depth = len(path)
    return [".".join(str(key) for _, key in other[depth:]) for other in others
            if len(other) > depth and other[:depth] == path and all(kind == "child" for kind, _ in other[depth:])]


def place(slot: Slot, value: Any) -> Slot | None:
    """Put ``value`` where ``slot.value`` was; return the slot to :meth:`Slot.undo` it, or None if nothing changed.

    Nothing changes for the walked object itself, when the slot already holds ``value``, or in a tuple (a
    module held there keeps reaching its proxy through the interception).
    """
    if slot.value is value or not slot.settable:
        return None
    slot.set(value)
    return slot
