"""The JSON form of structure specs (see :mod:`torch_tweak.torch.module.tree`), and the trust policy for them.

Types are written as ``module:QualName``. A spec read back comes from a file that whoever sent it fully
controls, so :func:`spec_from_json` is the single owner of the rule for which classes it may name:
resolution is static (:func:`~torch_tweak.torch.module.tree.resolve_type`: registered types, or a
``vars()`` walk of modules already in ``sys.modules``; nothing is imported, no module ``__getattr__`` runs)
and each class must be one that :func:`~torch_tweak.torch.module.tree.unflatten` rebuilds without running
code the file chose:

* ``ntuple``: a genuine namedtuple (tuple subclass, ``_fields`` a tuple of str, metaclass ``type``, no
  ``__del__``); rebuilt with ``tuple.__new__``. Its item count must match ``_fields``.
* ``dc``: a plain dataclass (metaclass ``type``, ``__new__`` is ``object.__new__``, no ``__del__``, not a
  mapping, no field shadowed by a settable descriptor); rebuilt field by field without ``__init__``. The
  spec's names must be exactly its fields.
* ``map``: a transformers ``ModelOutput`` / diffusers ``BaseOutput`` dataclass (keys among its fields,
  rebuilt through its own constructor) or ``collections.OrderedDict``.
* ``seq`` (list/tuple subclasses) and ``u`` (tensor containers): registered only.
* ``o`` (opaque object): resolved statically for identity only; never called.

Any other class must be registered with ``tt.register_type(cls)`` before ``tt.load``; registering says the
class may be called with values from the file (``seq``: ``cls(items)``, ``map``: ``cls(**items)``).
"""

from __future__ import annotations

import types
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module.dtypes import dtype_from_name
from torch_tweak.torch.module.tree import (
    TENSOR,
    Spec,
    dataclass_field_names,
    in_mro,
    is_container_type,
    is_output_class,
    is_registered_type,
    qualified_name,
    resolve_type,
    static_lookup,
)


def spec_to_json(spec: Spec) -> Any:
    """Convert a spec into JSON-able lists; raises for values that cannot be stored safely."""
    kind = spec[0]
    if kind == "T":
        return ["T"]
    if kind == "c":
        return ["c", _const_to_json(spec[1])]
    if kind in ("tuple", "list"):
        return [kind, [spec_to_json(s) for s in spec[1]]]
    if kind == "dict":
        return [kind, list(spec[1]), [spec_to_json(s) for s in spec[2]]]
    if kind in ("ntuple", "seq"):
        return [kind, qualified_name(spec[1]), [spec_to_json(s) for s in spec[2]]]
    if kind in ("map", "dc", "u"):
        return [kind, qualified_name(spec[1]), list(spec[2]), [spec_to_json(s) for s in spec[3]]]
    if kind == "o":
        return ["o", qualified_name(spec[1])]
    raise UnsupportedInputError(f"Unknown spec node {kind!r}.")


def spec_from_json(data: Any) -> Spec:
    """Inverse of :func:`spec_to_json` for untrusted data: validates the shape and admits only safe classes.

    Raises :class:`UnsupportedInputError` for malformed data and for classes outside the policy in the
    module docstring; nothing named in ``data`` is imported or called here.
    """
    if not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise UnsupportedInputError(f"Malformed structure spec: {data!r:.200}")
    kind = data[0]
    try:
        if kind == "T" and len(data) == 1:
            return TENSOR
        if kind == "c" and len(data) == 2:
            return ("c", _const_from_json(data[1]))
        if kind in ("tuple", "list") and len(data) == 2:
            return (kind, tuple(spec_from_json(s) for s in _items(data[1])))
        if kind == "dict" and len(data) == 3 and len(_items(data[1])) == len(_items(data[2])):
            return (kind, tuple(_key(k) for k in data[1]), tuple(spec_from_json(s) for s in data[2]))
        if kind in ("ntuple", "seq") and len(data) == 3:
            cls = _checked_type(kind, data[1])
            children = tuple(spec_from_json(s) for s in _items(data[2]))
            if kind == "ntuple":
                _check_arity(data[1], cls, len(children))
            return (kind, cls, children)
        if kind in ("map", "dc", "u") and len(data) == 4 and len(_items(data[2])) == len(_items(data[3])):
            cls = _checked_type(kind, data[1])
            keys = tuple(_key(k) for k in data[2])
            _check_keys(kind, data[1], cls, keys)
            return (kind, cls, keys, tuple(spec_from_json(s) for s in data[3]))
        if kind == "o" and len(data) == 2 and isinstance(data[1], str):
            return ("o", resolve_type(data[1]))
    except UnsupportedInputError:
        raise
    except TypeError as exc:
        raise UnsupportedInputError(f"Malformed structure spec node {data!r:.200}") from exc
    raise UnsupportedInputError(f"Malformed structure spec node {data!r:.200}")


def _items(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise UnsupportedInputError(f"Malformed structure spec: expected a list, got {value!r:.80}")
    return value


def _checked_type(kind: str, name: Any) -> type:
    """Resolve ``name`` statically and admit it only if the node can rebuild it without running chosen code."""
    if not isinstance(name, str):
        raise UnsupportedInputError(f"Malformed type name in structure spec: {name!r:.80}")
    cls = resolve_type(name)
    problem = _RULES[kind](cls)
    if problem is not None:
        raise _refused(kind, name, problem)
    return cls


def _refused(kind: str, name: str, problem: str) -> UnsupportedInputError:
    register = ("torch_tweak.torch.module.tree.register_container(cls, fields)" if kind == "u"
                else "tt.register_type(cls)")
    return UnsupportedInputError(
        f"Type {name!r} cannot stand for a {_KIND_NAMES[kind]} in a structure spec: {problem}. A checkpoint may only "
        "name containers torch_tweak rebuilds without running their code (namedtuples, plain dataclasses, "
        "OrderedDict, transformers ModelOutput, diffusers BaseOutput) or classes you registered; this one would be "
        f"called with values from the file. If you trust {name.rpartition(':')[2]!r} to be rebuilt from a file, call "
        f"{register} (import torch_tweak.torch as tt) before tt.load; otherwise the checkpoint is corrupt or crafted."
    )


def _plain_class_problem(cls: type) -> str | None:
    """Why ``cls`` could run code when rebuilt or destroyed, or ``None`` (metaclass hooks, ``__del__``)."""
    if type(cls) is not type:
        return f"it has the custom metaclass {qualified_name(type(cls))}"
    if static_lookup(cls, "__del__") is not None:
        return "it defines __del__"
    return None


def _namedtuple_rule(cls: type) -> str | None:
    fields = static_lookup(cls, "_fields")
    if not in_mro(cls, tuple) or not isinstance(fields, tuple) or not all(type(f) is str for f in fields):
        return "it is not a namedtuple class (a tuple subclass whose _fields is a tuple of names)"
    return None if is_registered_type(cls) else _plain_class_problem(cls)


def _seq_rule(cls: type) -> str | None:
    if not (in_mro(cls, list) or in_mro(cls, tuple)):
        return "it is not a list or tuple subclass"
    return None if is_registered_type(cls) else "it is not registered, and rebuilding it calls the class"


def _mapping_rule(cls: type) -> str | None:
    if cls is OrderedDict:
        return None
    if is_output_class(cls):
        if static_lookup(cls, "__dataclass_fields__") is None:
            return "it is a ModelOutput/BaseOutput base that is not a dataclass, so it has no fields to rebuild"
        return None
    if is_registered_type(cls):
        return None if issubclass(cls, Mapping) else "it is not a Mapping"
    return "it is neither OrderedDict nor a ModelOutput/BaseOutput subclass, and it is not registered"


def _dataclass_rule(cls: type) -> str | None:
    if not isinstance(static_lookup(cls, "__dataclass_fields__"), dict):
        return "it is not a dataclass"
    if is_registered_type(cls):
        return None
    problem = _plain_class_problem(cls)
    if problem is not None:
        return problem
    if static_lookup(cls, "__new__") is not object.__dict__["__new__"]:
        return "it defines or inherits a __new__ other than object.__new__"
    if issubclass(cls, Mapping):
        return "it is a Mapping (ModelOutput/BaseOutput are stored as mappings)"
    for name in dataclass_field_names(cls):
        attr = static_lookup(cls, name, _UNSET)
        if attr is not _UNSET and type(attr) is not types.MemberDescriptorType and _is_data_descriptor(attr):
            return f"its field {name!r} is shadowed by a descriptor whose setter would run"
    return None


def _container_rule(cls: type) -> str | None:
    return None if is_container_type(cls) else "it is not registered with register_container"


_UNSET = object()
_RULES: dict[str, Callable[[type], str | None]] = {
    "ntuple": _namedtuple_rule,
    "seq": _seq_rule,
    "map": _mapping_rule,
    "dc": _dataclass_rule,
    "u": _container_rule,
}
_KIND_NAMES = {"ntuple": "namedtuple", "seq": "list or tuple subclass", "map": "mapping", "dc": "dataclass",
               "u": "registered container"}


def _is_data_descriptor(attr: Any) -> bool:
    kind = type(attr)
    return static_lookup(kind, "__set__") is not None or static_lookup(kind, "__delete__") is not None


def _check_arity(name: str, cls: type, count: int) -> None:
    fields = static_lookup(cls, "_fields")
    if isinstance(fields, tuple) and len(fields) != count:
        raise UnsupportedInputError(
            f"Malformed structure spec: the namedtuple {name!r} has {len(fields)} fields but the spec gives {count} "
            "items. The checkpoint was saved for another version of the class, or it is corrupt or crafted."
        )


def _check_keys(kind: str, name: str, cls: type, keys: tuple[Any, ...]) -> None:
    """The names a dataclass or output node sets must be the class's own fields (exactly, for a dataclass)."""
    if kind == "dc":
        fields = dataclass_field_names(cls)
        if len(keys) != len(fields) or set(keys) != set(fields):
            raise UnsupportedInputError(
                f"Malformed structure spec: the dataclass {name!r} has the fields {list(fields)} but the spec sets "
                f"{list(keys)!r:.200}. The checkpoint was saved for another version of the class, or it is corrupt "
                "or crafted."
            )
    elif kind == "map" and cls is not OrderedDict and is_output_class(cls):
        fields = set(dataclass_field_names(cls))
        unknown = [k for k in keys if not isinstance(k, str) or k not in fields]
        if unknown or len(set(keys)) != len(keys):
            raise UnsupportedInputError(
                f"Malformed structure spec: {name!r} has the fields {sorted(fields)} but the spec sets "
                f"{list(keys)!r:.200}. The checkpoint was saved for another version of the class, or it is corrupt "
                "or crafted."
            )


def _key(k: Any) -> Any:
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


