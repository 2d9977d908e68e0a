"""Structure nodes that name a class, and the trust policy for the classes a file may name.

A spec read back comes from a file that whoever sent it fully controls, so each node here decides, when it
is read from JSON (:meth:`~torch_tweak.torch.module.nodes.Node.from_json`), which classes it accepts.
Resolution is static (:func:`~torch_tweak.torch.module.classes.resolve_type`: registered types, or a
``vars()`` walk of modules already in ``sys.modules``; nothing is imported, no module ``__getattr__`` runs)
and each class must be one the node rebuilds without running code the file chose:

* ``ntuple`` (:class:`NamedTupleNode`): a genuine namedtuple (tuple subclass, ``_fields`` a tuple of str,
  metaclass ``type``, no ``__del__``); rebuilt with ``tuple.__new__``. Its item count must match ``_fields``.
* ``dc`` (:class:`DataclassNode`): a plain dataclass (metaclass ``type``, ``__new__`` is ``object.__new__``,
  no ``__del__``, not a mapping, no field shadowed by a settable descriptor); rebuilt field by field without
  ``__init__``. The spec's names must be exactly its fields.
* ``map`` (:class:`MappingNode`): a transformers ``ModelOutput`` / diffusers ``BaseOutput`` dataclass (keys
  among its fields, rebuilt through its own constructor) or ``collections.OrderedDict``.
* ``seq`` (:class:`SequenceNode`, list/tuple subclasses) and ``u`` (:class:`ContainerNode`, tensor
  containers): registered only.
* ``o`` (:class:`OpaqueNode`, opaque object): resolved statically for identity only; never called.

Any other class must be registered with ``tt.register_type(cls)`` before ``tt.load``; registering says the
class may be called with values from the file (``seq``: ``cls(items)``, ``map``: ``cls(**items)``).
"""

from __future__ import annotations

import types
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from operator import itemgetter
from typing import Any, ClassVar, Self

import torch

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module.classes import (
    build_dataclass,
    build_mapping,
    build_namedtuple,
    dataclass_field_names,
    in_mro,
    is_container_type,
    is_output_class,
    is_registered_type,
    qualified_name,
    resolve_type,
    static_lookup,
)
from torch_tweak.torch.module.nodes import Branch, Items, Keyed, Node, Parse, json_key, json_list

_new = tuple.__new__
_UNSET = object()


class ClassNode(Branch):
    """A container node naming its class (``self[1]``), which leads its key; a file may name admitted classes only."""

    __slots__ = ()
    description: ClassVar[str]
    """What the class stands for, in refusal messages."""
    register_call: ClassVar[str] = "tt.register_type(cls)"
    """How a user admits a class the policy refuses."""

    cls = property(itemgetter(1), doc="The container class.")
    marker = cls  # type: ignore[assignment]

    @staticmethod
    def admit(klass: type) -> str | None:
        """Why a spec read from a file may not name ``klass`` for this node, or None if it may."""
        raise NotImplementedError


class ClassItems(ClassNode, Items):
    """Positional items of a container class: ``(tag, cls, children)``."""

    __slots__ = ()

    @classmethod
    def of(cls, klass: type, children: tuple[Node, ...]) -> Self:
        """The node of a ``klass`` instance whose items have the nodes ``children``."""
        return _new(cls, (cls.tag, klass, children))

    def to_json(self) -> list[Any]:
        return [self[0], qualified_name(self[1]), [child.to_json() for child in self[2]]]

    @classmethod
    def from_json(cls, data: list[Any], parse: Parse) -> Node | None:
        if len(data) != 3:
            return None
        klass = checked_type(cls, data[1])
        children = tuple(parse(s) for s in json_list(data[2]))
        cls.check_items(data[1], klass, len(children))
        return cls.of(klass, children)

    @classmethod
    def check_items(cls, name: str, klass: type, count: int) -> None:
        """Refuse an item count the class cannot hold (read from a file)."""


class ClassKeyed(ClassNode, Keyed):
    """Named items of a container class: ``(tag, cls, keys, children)``."""

    __slots__ = ()

    @classmethod
    def of(cls, klass: type, keys: tuple[Any, ...], children: tuple[Node, ...]) -> Self:
        """The node of a ``klass`` instance whose items ``keys`` have the nodes ``children``."""
        return _new(cls, (cls.tag, klass, keys, children))

    def to_json(self) -> list[Any]:
        return [self[0], qualified_name(self[1]), list(self[2]), [child.to_json() for child in self[3]]]

    @classmethod
    def from_json(cls, data: list[Any], parse: Parse) -> Node | None:
        if len(data) != 4 or len(json_list(data[2])) != len(json_list(data[3])):
            return None
        klass = checked_type(cls, data[1])
        keys = tuple(json_key(k) for k in data[2])
        cls.check_keys(data[1], klass, keys)
        return cls.of(klass, keys, tuple(parse(s) for s in data[3]))

    @classmethod
    def check_keys(cls, name: str, klass: type, keys: tuple[Any, ...]) -> None:
        """Refuse keys the class does not have (read from a file)."""


class NamedTupleNode(ClassItems):
    """A namedtuple: ``("ntuple", cls, children)``, rebuilt through the tuple protocol."""

    __slots__ = ()
    tag = "ntuple"
    description = "namedtuple"

    def rebuild(self, values: list[Any]) -> Any:
        return build_namedtuple(self[1], tuple(values))

    @staticmethod
    def admit(klass: type) -> str | None:
        fields = static_lookup(klass, "_fields")
        if not in_mro(klass, tuple) or not isinstance(fields, tuple) or not all(type(f) is str for f in fields):
            return "it is not a namedtuple class (a tuple subclass whose _fields is a tuple of names)"
        return None if is_registered_type(klass) else _plain_class_problem(klass)

    @classmethod
    def check_items(cls, name: str, klass: type, count: int) -> None:
        fields = static_lookup(klass, "_fields")
        if isinstance(fields, tuple) and len(fields) != count:
            raise UnsupportedInputError(
                f"Malformed structure spec: the namedtuple {name!r} has {len(fields)} fields but the spec gives "
                f"{count} items. The checkpoint was saved for another version of the class, or it is corrupt or "
                "crafted."
            )


class SequenceNode(ClassItems):
    """A list or tuple subclass: ``("seq", cls, children)``, rebuilt as ``cls(items)``."""

    __slots__ = ()
    tag = "seq"
    description = "list or tuple subclass"

    def rebuild(self, values: list[Any]) -> Any:
        return self[1](value for value in values)

    @staticmethod
    def admit(klass: type) -> str | None:
        if not (in_mro(klass, list) or in_mro(klass, tuple)):
            return "it is not a list or tuple subclass"
        return None if is_registered_type(klass) else "it is not registered, and rebuilding it calls the class"


class MappingNode(ClassKeyed):
    """A mapping other than ``dict``: ``("map", cls, keys, children)``, rebuilt through its protocol."""

    __slots__ = ()
    tag = "map"
    description = "mapping"

    def rebuild(self, values: list[Any]) -> Any:
        return build_mapping(self[1], dict(zip(self[2], values)))

    @staticmethod
    def admit(klass: type) -> str | None:
        if klass is OrderedDict:
            return None
        if is_output_class(klass):
            if static_lookup(klass, "__dataclass_fields__") is None:
                return "it is a ModelOutput/BaseOutput base that is not a dataclass, so it has no fields to rebuild"
            return None
        if is_registered_type(klass):
            return None if issubclass(klass, Mapping) else "it is not a Mapping"
        return "it is neither OrderedDict nor a ModelOutput/BaseOutput subclass, and it is not registered"

    @classmethod
    def check_keys(cls, name: str, klass: type, keys: tuple[Any, ...]) -> None:
        if klass is OrderedDict or not is_output_class(klass):
            return
        fields = set(dataclass_field_names(klass))
        unknown = [k for k in keys if not isinstance(k, str) or k not in fields]
        if unknown or len(set(keys)) != len(keys):
            raise UnsupportedInputError(
                f"Malformed structure spec: {name!r} has the fields {sorted(fields)} but the spec sets "
                f"{list(keys)!r:.200}. The checkpoint was saved for another version of the class, or it is corrupt "
                "or crafted."
            )


class DataclassNode(ClassKeyed):
    """A dataclass: ``("dc", cls, names, children)``, rebuilt field by field without ``__init__``."""

    __slots__ = ()
    tag = "dc"
    description = "dataclass"
    attribute_paths = True

    def items_of(self, obj: Any) -> Iterable[Any]:
        return [getattr(obj, name) for name in self[2]]

    def rebuild(self, values: list[Any]) -> Any:
        return build_dataclass(self[1], dict(zip(self[2], values)))

    @staticmethod
    def admit(klass: type) -> str | None:
        if not isinstance(static_lookup(klass, "__dataclass_fields__"), dict):
            return "it is not a dataclass"
        if is_registered_type(klass):
            return None
        problem = _plain_class_problem(klass)
        if problem is not None:
            return problem
        if static_lookup(klass, "__new__") is not object.__dict__["__new__"]:
            return "it defines or inherits a __new__ other than object.__new__"
        if issubclass(klass, Mapping):
            return "it is a Mapping (ModelOutput/BaseOutput are stored as mappings)"
        for name in dataclass_field_names(klass):
            attr = static_lookup(klass, name, _UNSET)
            if attr is not _UNSET and type(attr) is not types.MemberDescriptorType and _is_data_descriptor(attr):
                return f"its field {name!r} is shadowed by a descriptor whose setter would run"
        return None

    @classmethod
    def check_keys(cls, name: str, klass: type, keys: tuple[Any, ...]) -> None:
        fields = dataclass_field_names(klass)
        if len(keys) != len(fields) or set(keys) != set(fields):
            raise UnsupportedInputError(
                f"Malformed structure spec: the dataclass {name!r} has the fields {list(fields)} but the spec sets "
                f"{list(keys)!r:.200}. The checkpoint was saved for another version of the class, or it is corrupt "
                "or crafted."
            )


class ContainerNode(ClassKeyed):
    """A registered tensor container (``register_container``): ``("u", cls, names, children)``.

    Its tensors take part in the key and the leaves, but it cannot be rebuilt from them: a live value is
    passed on as it is.
    """

    __slots__ = ()
    tag = "u"
    description = "registered container"
    register_call = "torch_tweak.torch.module.tree.register_container(cls, fields)"
    attribute_paths = True

    def unflatten(self, leaves: Iterator[Any]) -> Any:
        raise _cannot_rebuild(self[1])

    def map(self, obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
        return obj

    @staticmethod
    def admit(klass: type) -> str | None:
        return None if is_container_type(klass) else "it is not registered with register_container"


class OpaqueNode(Node):
    """An object that is not traversed: ``("o", cls)``. Only its class counts; it cannot be rebuilt."""

    __slots__ = ()
    tag = "o"

    @classmethod
    def of(cls, klass: type) -> OpaqueNode:
        """The node of an opaque ``klass`` instance."""
        return _new(cls, ("o", klass))

    cls = property(itemgetter(1), doc="The object's class.")

    def unflatten(self, leaves: Iterator[Any]) -> Any:
        raise _cannot_rebuild(self[1])

    def key(self, ranks: Iterator[int], strict: bool) -> Any:
        return ("o", self[1])

    def to_json(self) -> list[Any]:
        return ["o", qualified_name(self[1])]

    @classmethod
    def from_json(cls, data: list[Any], parse: Parse) -> Node | None:
        return cls.of(resolve_type(data[1])) if len(data) == 2 and isinstance(data[1], str) else None


def checked_type(node: type[ClassNode], name: Any) -> type:
    """Resolve ``name`` statically and admit it only if ``node`` can rebuild it without running chosen code."""
    if not isinstance(name, str):
        raise UnsupportedInputError(f"Malformed type name in structure spec: {name!r:.80}")
    klass = resolve_type(name)
    problem = node.admit(klass)
    if problem is not None:
        raise UnsupportedInputError(
            f"Type {name!r} cannot stand for a {node.description} in a structure spec: {problem}. A checkpoint may "
            "only name containers torch_tweak rebuilds without running their code (namedtuples, plain dataclasses, "
            "OrderedDict, transformers ModelOutput, diffusers BaseOutput) or classes you registered; this one would "
            f"be called with values from the file. If you trust {name.rpartition(':')[2]!r} to be rebuilt from a "
            f"file, call {node.register_call} (import torch_tweak.torch as tt) before tt.load; otherwise the "
            "checkpoint is corrupt or crafted."
        )
    return klass


def _plain_class_problem(klass: type) -> str | None:
    """Why ``klass`` could run code when rebuilt or destroyed, or ``None`` (metaclass hooks, ``__del__``)."""
    if type(klass) is not type:
        return f"it has the custom metaclass {qualified_name(type(klass))}"
    if static_lookup(klass, "__del__") is not None:
        return "it defines __del__"
    return None


def _is_data_descriptor(attr: Any) -> bool:
    kind = type(attr)
    return static_lookup(kind, "__set__") is not None or static_lookup(kind, "__delete__") is not None


def _cannot_rebuild(klass: type) -> UnsupportedInputError:
    return UnsupportedInputError(
        f"Cannot rebuild an object of type {qualified_name(klass)}: it is not a tensor, a container or a "
        "plain value, so a backend that runs an exported graph cannot produce it. Return tensors, tuples, lists, "
        "dicts, namedtuples or dataclasses from the tuned module, or use a backend that runs the PyTorch module "
        "(TorchEagerBackend, TorchInductorBackend, TorchAOBackend). A transformers DynamicCache is such an "
        "object: generate(..., use_cache=False) or a static cache avoids it."
    )
