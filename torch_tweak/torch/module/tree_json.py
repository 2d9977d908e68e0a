"""The JSON form of structure specs (see :mod:`torch_tweak.torch.module.tree`).

Types are written as ``module:QualName`` and resolved on the way back only through
:func:`~torch_tweak.torch.module.tree.resolve_type` (registered types or already-imported modules).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module.dtypes import dtype_from_name
from torch_tweak.torch.module.tree import TENSOR, Spec, is_container_type, qualified_name, resolve_type


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
    """Inverse of :func:`spec_to_json`; validates the shape of the data and resolves types safely."""
    if not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise UnsupportedInputError(f"Malformed structure spec: {data!r:.200}")
    kind = data[0]
    try:
        if kind == "T" and len(data) == 1:
            return TENSOR
        if kind == "c" and len(data) == 2:
            return ("c", _const_from_json(data[1]))
        if kind in ("tuple", "list") and len(data) == 2:
            return (kind, tuple(spec_from_json(s) for s in data[1]))
        if kind == "dict" and len(data) == 3 and len(data[1]) == len(data[2]):
            return (kind, tuple(_key(k) for k in data[1]), tuple(spec_from_json(s) for s in data[2]))
        if kind in ("ntuple", "seq") and len(data) == 3:
            return (kind, _checked_type(kind, data[1]), tuple(spec_from_json(s) for s in data[2]))
        if kind in ("map", "dc", "u") and len(data) == 4 and len(data[2]) == len(data[3]):
            return (kind, _checked_type(kind, data[1]), tuple(_key(k) for k in data[2]),
                    tuple(spec_from_json(s) for s in data[3]))
        if kind == "o" and len(data) == 2 and isinstance(data[1], str):
            return ("o", resolve_type(data[1]))
    except UnsupportedInputError:
        raise
    except TypeError as exc:
        raise UnsupportedInputError(f"Malformed structure spec node {data!r:.200}") from exc
    raise UnsupportedInputError(f"Malformed structure spec node {data!r:.200}")


def _checked_type(kind: str, name: Any) -> type:
    """Resolve ``name`` and check it is the kind of class the node rebuilds (never an arbitrary callable)."""
    if not isinstance(name, str):
        raise UnsupportedInputError(f"Malformed type name in structure spec: {name!r:.80}")
    cls = resolve_type(name)
    fits = {
        "ntuple": issubclass(cls, tuple) and hasattr(cls, "_fields"),
        "seq": issubclass(cls, (list, tuple)),
        "map": issubclass(cls, Mapping),
        "dc": dataclasses.is_dataclass(cls),
        "u": is_container_type(cls),
    }[kind]
    if not fits:
        raise UnsupportedInputError(
            f"Type {name!r} cannot stand for a {_KIND_NAMES[kind]} in a structure spec; the spec is corrupt or crafted."
        )
    return cls


_KIND_NAMES = {"ntuple": "namedtuple", "seq": "list or tuple subclass", "map": "mapping", "dc": "dataclass",
               "u": "registered container"}


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


