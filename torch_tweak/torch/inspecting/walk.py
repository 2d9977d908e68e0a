"""Finding the ``nn.Module`` objects reachable from a pipeline object, and where each one sits."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from torch_tweak.torch.module.wrapper import Module, unwrap

_SKIP_TYPES = (str, bytes, int, float, bool, complex, type(None))


@dataclass
class Slot:
    """Where a module is held: ``container[key]`` (``kind`` = item) or ``container.key`` (attribute)."""

    container: Any
    key: Any
    kind: str  # "attr" or "item"

    def get(self) -> Any:
        """The object currently in the slot."""
        return getattr(self.container, self.key) if self.kind == "attr" else self.container[self.key]

    def put(self, value: Any) -> None:
        """Replace the object in the slot."""
        if self.kind == "attr":
            setattr(self.container, self.key, value)
        elif isinstance(self.container, tuple):
            raise TypeError("cannot replace an item of a tuple")
        else:
            self.container[self.key] = value


@dataclass
class Found:
    """A module found by :func:`walk_modules`."""

    path: str
    module: nn.Module
    depth: int
    slot: Slot | None
    parent_path: str | None


def _join(prefix: str, key: Any, kind: str) -> str:
    if kind == "attr":
        return f"{prefix}.{key}" if prefix else str(key)
    return f"{prefix}[{key!r}]" if prefix else f"[{key!r}]"


def walk_modules(obj: Any, max_depth: int = 5) -> Iterator[Found]:
    """Yield every module reachable from ``obj`` (root at depth 0), each once, parents before children.

    Modules are entered through their child modules; other objects through their attributes, dict
    values, and list/tuple items. Depth counts modules only: containers do not add a level.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, str, int, Slot | None, str | None]] = [(obj, "", 0, None, None)]
    while stack:
        current, path, depth, slot, parent = stack.pop()
        target = unwrap(current)
        if id(target) in seen or isinstance(target, _SKIP_TYPES) or isinstance(target, type):
            continue
        seen.add(id(target))
        children: list[tuple[Any, str, int, Slot, str | None]] = []
        if isinstance(target, nn.Module):
            yield Found(path, target, depth, slot, parent)
            if depth >= max_depth:
                continue
            for name, child in target._modules.items():
                if child is not None:
                    children.append((child, _join(path, name, "attr"), depth + 1, Slot(target, name, "attr"), path))
        elif isinstance(target, dict):
            for key, value in target.items():
                children.append((value, _join(path, key, "item"), depth, Slot(target, key, "item"), parent))
        elif isinstance(target, (list, tuple)):
            for index, value in enumerate(target):
                children.append((value, _join(path, index, "item"), depth, Slot(target, index, "item"), parent))
        elif hasattr(target, "__dict__") and not isinstance(current, Module):
            for name, value in vars(target).items():
                if not name.startswith("__"):
                    children.append((value, _join(path, name, "attr"), depth + 1 if depth == 0 and path == "" else depth,
                                     Slot(target, name, "attr"), parent))
        stack.extend(reversed(children))
