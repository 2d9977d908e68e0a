"""Typed nodes of a structure spec: each kind of value knows, in one place, everything a spec is used for.

:func:`~torch_tweak.torch.module.tree.flatten` turns a value into tensor leaves and a tree of these nodes.
Every node class owns, for its kind of value: rebuilding it from leaves (:meth:`Node.unflatten`), its part
of the dispatch key (:meth:`Node.key`), the locators of its tensor leaves (:meth:`Node.paths`), applying a
function to the tensors of a live value of that structure (:meth:`Node.map`) and its JSON form
(:meth:`Node.to_json`, :meth:`Node.from_json`). This module holds the nodes of tensors, plain values and
built-in containers; :mod:`~torch_tweak.torch.module.class_nodes` holds the nodes that name a class, with the
trust policy for classes read from a file.

Nodes are tuples laid out as their JSON form, with the class itself in place of its name: ``("T",)``,
``("c", value)``, ``("tuple", children)``, ``("dict", keys, children)``... They are immutable, hash and
compare like those tuples (a spec equals the plain tuple it was before nodes were typed), and they are built
with the ``of`` class methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from operator import itemgetter
from typing import Any, ClassVar

import torch

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module.dtypes import dtype_from_name

Parse = Callable[[Any], "Node"]
"""Reads a child node from JSON (``tree_json.spec_from_json``), passed to :meth:`Node.from_json`."""

_new = tuple.__new__
_RANK_KEYS = tuple(("T", rank) for rank in range(16))


class Node(tuple[Any, ...]):
    """Base of the structure nodes; ``self[0]`` is the node's JSON tag."""

    __slots__ = ()
    tag: ClassVar[str]

    def unflatten(self, leaves: Iterator[Any]) -> Any:
        """Rebuild the value, taking its tensors from ``leaves`` in flatten order."""
        raise NotImplementedError

    def key(self, ranks: Iterator[int], strict: bool) -> Any:
        """This node's part of the dispatch key; ``ranks`` gives the tensor ranks in flatten order."""
        raise NotImplementedError

    def paths(self, prefix: str, out: list[str]) -> None:
        """Append the locators of this node's tensor leaves (``prefix`` locates the node itself)."""

    def map(self, obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
        """``obj`` (a live value with this structure) with ``fn`` applied to every tensor; others kept."""
        return obj

    def to_json(self) -> list[Any]:
        """The JSON form (lists, strings, numbers); classes are written as ``module:QualName``."""
        raise NotImplementedError

    @classmethod
    def from_json(cls, data: list[Any], parse: Parse) -> Node | None:
        """Read a node of this kind from untrusted JSON ``data`` (tagged ``cls.tag``); None if malformed."""
        raise NotImplementedError


class TensorNode(Node):
    """A tensor leaf: ``("T",)``. Its dispatch key is its rank."""

    __slots__ = ()
    tag = "T"

    @classmethod
    def of(cls) -> TensorNode:
        """The tensor node (:data:`TENSOR`)."""
        return TENSOR

    def unflatten(self, leaves: Iterator[Any]) -> Any:
        return next(leaves)

    def key(self, ranks: Iterator[int], strict: bool) -> Any:
        rank = next(ranks)
        return _RANK_KEYS[rank] if rank < 16 else ("T", rank)

    def paths(self, prefix: str, out: list[str]) -> None:
        out.append(prefix)

    def map(self, obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
        return fn(obj)

    def to_json(self) -> list[Any]:
        return ["T"]

    @classmethod
    def from_json(cls, data: list[Any], parse: Parse) -> Node | None:
        return TENSOR if len(data) == 1 else None

    def __reduce__(self) -> str:
        return "TENSOR"  # copies and pickles stay the one tensor node


TENSOR = _new(TensorNode, ("T",))


class ConstNode(Node):
    """A plain value stored in the spec: ``("c", value)``. It is part of the key by value when strict."""

    __slots__ = ()
    tag = "c"

    @classmethod
    def of(cls, value: Any) -> ConstNode:
        """The node of ``value`` (``None``, a number, a string, a dtype, a device or a size)."""
        return _new(cls, ("c", value))

    value = property(itemgetter(1), doc="The stored value.")

    def unflatten(self, leaves: Iterator[Any]) -> Any:
        return self[1]

    def key(self, ranks: Iterator[int], strict: bool) -> Any:
        return ("c", self[1]) if strict else ("c", type(self[1]))

    def to_json(self) -> list[Any]:
        return ["c", _const_to_json(self[1])]

    @classmethod
    def from_json(cls, data: list[Any], parse: Parse) -> Node | None:
        return cls.of(_const_from_json(data[1])) if len(data) == 2 else None


class Branch(Node):
    """A container node: its children are last; ``rebuild`` makes the container from their values."""

    __slots__ = ()

    children = property(itemgetter(-1), doc="The nodes of the items, in flatten order.")

    marker: ClassVar[Any]
    """What the dispatch key puts in front of the children's keys (the container kind)."""

    def items_of(self, obj: Any) -> Iterable[Any]:
        """The items of a live value with this structure, in children order."""
        raise NotImplementedError

    def rebuild(self, values: list[Any]) -> Any:
        """The container holding ``values`` (one per child)."""
        raise NotImplementedError

    def unflatten(self, leaves: Iterator[Any]) -> Any:
        return self.rebuild([child.unflatten(leaves) for child in self[-1]])

    def map(self, obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
        return self.rebuild([child.map(item, fn) for child, item in zip(self[-1], self.items_of(obj))])


class Items(Branch):
    """A container of positional items (``[i]`` locators); its key is ``(marker, item keys)``."""

    __slots__ = ()

    def items_of(self, obj: Any) -> Iterable[Any]:
        return obj

    def key(self, ranks: Iterator[int], strict: bool) -> Any:
        return (self.marker, tuple([child.key(ranks, strict) for child in self[-1]]))

    def paths(self, prefix: str, out: list[str]) -> None:
        for i, child in enumerate(self[-1]):
            child.paths(f"{prefix}[{i}]", out)

    def to_json(self) -> list[Any]:
        return [self[0], [child.to_json() for child in self[1]]]

    @classmethod
    def from_json(cls, data: list[Any], parse: Parse) -> Node | None:
        return cls.of(tuple(parse(s) for s in json_list(data[1]))) if len(data) == 2 else None  # type: ignore[attr-defined]


class Keyed(Branch):
    """A container of named items, keys before the children; its key is ``(marker, ((key, key part), ...))``."""

    __slots__ = ()
    attribute_paths: ClassVar[bool] = False
    """Locate items as attributes (``.name``) rather than by subscript (``['name']``)."""

    keys = property(itemgetter(-2), doc="The keys (or field names) of the items, in children order.")

    def items_of(self, obj: Any) -> Iterable[Any]:
        return [obj[k] for k in self[-2]]

    def key(self, ranks: Iterator[int], strict: bool) -> Any:
        return (self.marker, tuple([(k, child.key(ranks, strict)) for k, child in zip(self[-2], self[-1])]))

    def paths(self, prefix: str, out: list[str]) -> None:
        for k, child in zip(self[-2], self[-1]):
            child.paths(f"{prefix}.{k}" if self.attribute_paths else f"{prefix}[{k!r}]", out)


class TupleNode(Items):
    """A plain tuple: ``("tuple", children)``."""

    __slots__ = ()
    tag = "tuple"

    @classmethod
    def of(cls, children: tuple[Node, ...]) -> TupleNode:
        """The node of a tuple whose items have the nodes ``children``."""
        return _new(cls, ("tuple", children))

    marker = True

    def rebuild(self, values: list[Any]) -> Any:
        return tuple(values)


class ListNode(Items):
    """A plain list: ``("list", children)``."""

    __slots__ = ()
    tag = "list"

    @classmethod
    def of(cls, children: tuple[Node, ...]) -> ListNode:
        """The node of a list whose items have the nodes ``children``."""
        return _new(cls, ("list", children))

    marker = False

    def rebuild(self, values: list[Any]) -> Any:
        return values


class DictNode(Keyed):
    """A plain dict: ``("dict", keys, children)``."""

    __slots__ = ()
    tag = "dict"

    @classmethod
    def of(cls, keys: tuple[Any, ...], children: tuple[Node, ...]) -> DictNode:
        """The node of a dict with ``keys`` (in order) whose values have the nodes ``children``."""
        return _new(cls, ("dict", keys, children))

    marker = "dict"

    def rebuild(self, values: list[Any]) -> Any:
        return dict(zip(self[1], values))

    def to_json(self) -> list[Any]:
        return ["dict", list(self[1]), [child.to_json() for child in self[2]]]

    @classmethod
    def from_json(cls, data: list[Any], parse: Parse) -> Node | None:
        if len(data) != 3 or len(json_list(data[1])) != len(json_list(data[2])):
            return None
        return cls.of(tuple(json_key(k) for k in data[1]), tuple(parse(s) for s in data[2]))


def json_list(value: Any) -> list[Any]:
    """``value`` if it is a JSON list; raises for anything else."""
    if not isinstance(value, list):
        raise UnsupportedInputError(f"Malformed structure spec: expected a list, got {value!r:.80}")
    return value


def json_key(k: Any) -> Any:
    """A container key read from JSON: a string or an integer."""
    if isinstance(k, (str, int)) and not isinstance(k, bool):
        return k
    raise UnsupportedInputError(f"Container keys must be strings or integers, got {k!r:.80}.")


def _const_to_json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    raise UnsupportedInputError(
        f"The value {value!r:.80} of type {type(value).__name__} cannot be stored in a checkpoint; "
        "only None, bool, int, float, str, dtypes, devices and sizes can."
    )


def _const_from_json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (tag, payload), = value.items()
        if tag == "float" and isinstance(payload, str):
            return float(payload)
        if tag == "dtype" and isinstance(payload, str):
            return dtype_from_name(payload)
        if tag == "device" and isinstance(payload, str):
            return torch.device(payload)
        if tag == "size" and isinstance(payload, list) and all(isinstance(v, int) for v in payload):
            return torch.Size(payload)
    raise UnsupportedInputError(f"Malformed constant in structure spec: {value!r:.80}")
