"""Structure-aware flattening of call arguments and outputs.

A value is split into its tensor leaves and a hashable *spec* that records everything else: the
containers (tuple, list, dict, namedtuple, dataclass, dict subclasses such as Hugging Face
``ModelOutput``) and the non-tensor values (``None``, numbers, strings, dtypes). ``unflatten`` puts
new tensors back into the same structure with the original container types, so a backend that only
produces tensors can return what the eager module returned.

Specs are nested tuples, cheap to hash and compare, and convert to JSON with :func:`spec_to_json`.
Types named in a JSON spec are resolved only from :func:`register_type` or from modules that are
already imported; loading a spec never imports anything.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module.dtypes import dtype_from_name, dtype_name

__all__ = ["Sample", "Spec", "dtype_from_name", "dtype_name", "flatten", "signature", "unflatten"]

Sample = tuple[tuple[Any, ...], dict[str, Any]]
"""One recorded call: positional arguments and keyword arguments."""

Spec = tuple[Any, ...]

TENSOR: Spec = ("T",)
_CONST_TYPES = (type(None), bool, int, float, str, bytes, complex, torch.dtype, torch.device, torch.Size)
_RANK_KEYS = tuple(("T", rank) for rank in range(16))
_USER_TYPES: dict[str, type] = {}
_IGNORED_TYPES: set[type] = set()
_CONTAINERS: dict[type, Callable[[Any], dict[str, Any]]] = {}


def register_type(cls: type) -> type:
    """Allow ``cls`` (a namedtuple, dataclass or dict subclass) to be rebuilt from a saved spec.

    Types from modules that are already imported resolve without registration; registering is for
    types that must resolve before their module is imported. Returns ``cls`` so it works as a decorator.
    """
    _USER_TYPES[qualified_name(cls)] = cls
    return cls


def register_container(cls: type, fields: Callable[[Any], dict[str, Any]]) -> None:
    """Traverse objects of ``cls`` (and subclasses) through ``fields(obj)`` → ``{name: value}``.

    Their tensors then count for graph identity, shapes and fidelity (e.g. a static KV cache). Such
    objects are passed to backends as they are; they cannot be rebuilt from tensors alone.
    """
    _CONTAINERS[cls] = fields
    register_type(cls)


def is_container_type(cls: type) -> bool:
    """True if ``cls`` was registered with :func:`register_container`."""
    return cls in _CONTAINERS


def _container_fields(obj: Any) -> Callable[[Any], dict[str, Any]] | None:
    if not _CONTAINERS:
        return None
    for klass in type(obj).__mro__:
        if klass in _CONTAINERS:
            return _CONTAINERS[klass]
    return None


def ignore_type(cls: type) -> None:
    """Treat values of ``cls`` as opaque objects: not traversed, not part of graph identity by value."""
    _IGNORED_TYPES.add(cls)


def qualified_name(cls: type) -> str:
    """Return ``"module:QualName"`` for a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_type(name: str) -> type:
    """Find the class named ``"module:QualName"`` among registered types and imported modules only."""
    if name in _USER_TYPES:
        return _USER_TYPES[name]
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        raise UnsupportedInputError(
            f"Type {name!r} is not available: module {module_name!r} is not imported. torch_tweak never imports "
            f"modules named in a file; import {module_name!r} before loading, or register the type with "
            "torch_tweak.torch.register_type()."
        )
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            break
    if not isinstance(obj, type):
        raise UnsupportedInputError(f"Type {name!r} does not exist in the imported module {module_name!r}.")
    return obj


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    """Split ``obj`` into its tensor leaves (depth first) and a hashable structure spec."""
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: list[torch.Tensor]) -> Spec:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return TENSOR
    cls = type(obj)
    if cls is tuple:
        return ("tuple", tuple(_flatten(item, leaves) for item in obj))
    if cls is list:
        return ("list", tuple(_flatten(item, leaves) for item in obj))
    if cls is dict:
        keys = tuple(obj)
        return ("dict", keys, tuple(_flatten(obj[k], leaves) for k in keys))
    if isinstance(obj, _CONST_TYPES) or cls in _IGNORED_TYPES:
        return ("c", obj) if cls not in _IGNORED_TYPES else ("o", cls)
    if _is_namedtuple(obj):
        return ("ntuple", cls, tuple(_flatten(item, leaves) for item in obj))
    if isinstance(obj, Mapping):
        keys = tuple(obj.keys())
        return ("map", cls, keys, tuple(_flatten(obj[k], leaves) for k in keys))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        return ("dc", cls, names, tuple(_flatten(getattr(obj, n), leaves) for n in names))
    if isinstance(obj, (list, tuple)):
        return ("seq", cls, tuple(_flatten(item, leaves) for item in obj))
    fields = _container_fields(obj)
    if fields is not None:
        values = fields(obj)
        names = tuple(values)
        return ("u", cls, names, tuple(_flatten(values[n], leaves) for n in names))
    return ("o", cls)


def unflatten(spec: Spec, leaves: list[Any] | Iterator[Any]) -> Any:
    """Rebuild a value with the structure of ``spec`` from tensors given in flatten order."""
    return _unflatten(spec, iter(leaves))


def _unflatten(spec: Spec, it: Iterator[Any]) -> Any:
    kind = spec[0]
    if kind == "T":
        return next(it)
    if kind == "c":
        return spec[1]
    if kind == "tuple":
        return tuple(_unflatten(s, it) for s in spec[1])
    if kind == "list":
        return [_unflatten(s, it) for s in spec[1]]
    if kind == "dict":
        return {k: _unflatten(s, it) for k, s in zip(spec[1], spec[2])}
    if kind == "ntuple":
        return spec[1](*(_unflatten(s, it) for s in spec[2]))
    if kind == "map":
        values = {k: _unflatten(s, it) for k, s in zip(spec[2], spec[3])}
        return _build_mapping(spec[1], values)
    if kind == "dc":
        return _build_dataclass(spec[1], dict(zip(spec[2], (_unflatten(s, it) for s in spec[3]))))
    if kind == "seq":
        return spec[1](_unflatten(s, it) for s in spec[2])
    raise UnsupportedInputError(
        f"Cannot rebuild an object of type {qualified_name(spec[1])}: it is not a tensor, a container or a "
        "plain value. Return tensors, tuples, lists, dicts, namedtuples or dataclasses from the tuned module."
    )


def _build_mapping(cls: type, values: dict[Any, Any]) -> Any:
    if all(isinstance(k, str) for k in values):
        try:
            return cls(**values)
        except TypeError:
            pass
    return cls(values)


def _build_dataclass(cls: type, values: dict[str, Any]) -> Any:
    init_fields = {f.name for f in dataclasses.fields(cls) if f.init}
    obj = cls(**{k: v for k, v in values.items() if k in init_fields})
    for name, value in values.items():
        if name not in init_fields:
            object.__setattr__(obj, name, value)
    return obj


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Return ``obj`` with ``fn`` applied to every tensor leaf, keeping the structure.

    Objects that are not containers (e.g. a KV cache object) are kept as they are, by reference.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    cls = type(obj)
    if cls is tuple or cls is list:
        return cls(map_tensors(item, fn) for item in obj)
    if cls is dict:
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, _CONST_TYPES) or cls in _IGNORED_TYPES:
        return obj
    if _is_namedtuple(obj):
        return cls(*(map_tensors(item, fn) for item in obj))
    if isinstance(obj, Mapping):
        return _build_mapping(cls, {k: map_tensors(obj[k], fn) for k in obj.keys()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _build_dataclass(cls, {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)})
    if isinstance(obj, (list, tuple)):
        return cls(map_tensors(item, fn) for item in obj)
    return obj


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], strict: bool) -> tuple[Any, ...]:
    """Return the graph identity of a call: structure, tensor ranks and (when strict) non-tensor values.

    Keyword arguments are taken in sorted order, so ``f(a=x, b=y)`` and ``f(b=y, a=x)`` match.
    """
    key_args = tuple(_sig(a, strict) for a in args)
    if not kwargs:
        return (key_args,)
    names = tuple(sorted(kwargs))
    return (key_args, names, tuple(_sig(kwargs[n], strict) for n in names))


def _sig(obj: Any, strict: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        rank = obj.dim()
        return _RANK_KEYS[rank] if rank < 16 else ("T", rank)
    cls = type(obj)
    if cls is tuple or cls is list:
        return (cls is tuple, tuple(_sig(item, strict) for item in obj))
    if cls is dict:
        return ("dict", tuple((k, _sig(v, strict)) for k, v in obj.items()))
    if isinstance(obj, _CONST_TYPES):
        return ("c", obj) if strict else ("c", cls)
    if cls in _IGNORED_TYPES:
        return ("o", cls)
    if _is_namedtuple(obj) or (isinstance(obj, (list, tuple)) and not isinstance(obj, str)):
        return (cls, tuple(_sig(item, strict) for item in obj))
    if isinstance(obj, Mapping):
        return (cls, tuple((k, _sig(v, strict)) for k, v in obj.items()))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (cls, tuple((f.name, _sig(getattr(obj, f.name), strict)) for f in dataclasses.fields(obj)))
    fields = _container_fields(obj)
    if fields is not None:
        return (cls, tuple((name, _sig(value, strict)) for name, value in fields(obj).items()))
    return ("o", cls)


def structure_signature(structure: Spec, ranks: list[int], strict: bool) -> tuple[Any, ...]:
    """The :func:`signature` of a call, computed from its :func:`flatten_sample` structure and tensor ranks.

    Lets a graph loaded from a checkpoint be matched without rebuilding any input.
    """
    it = iter(ranks)
    _, (args_spec, kwargs_spec) = structure
    key_args = tuple(_sig_from_spec(s, it, strict) for s in args_spec[1])
    if not kwargs_spec[1]:
        return (key_args,)
    return (key_args, tuple(kwargs_spec[1]), tuple(_sig_from_spec(s, it, strict) for s in kwargs_spec[2]))


def _sig_from_spec(spec: Spec, ranks: Iterator[int], strict: bool) -> Any:
    kind = spec[0]
    if kind == "T":
        rank = next(ranks)
        return _RANK_KEYS[rank] if rank < 16 else ("T", rank)
    if kind == "c":
        return ("c", spec[1]) if strict else ("c", type(spec[1]))
    if kind in ("tuple", "list"):
        return (kind == "tuple", tuple(_sig_from_spec(s, ranks, strict) for s in spec[1]))
    if kind == "dict":
        return ("dict", tuple((k, _sig_from_spec(s, ranks, strict)) for k, s in zip(spec[1], spec[2])))
    if kind in ("ntuple", "seq"):
        return (spec[1], tuple(_sig_from_spec(s, ranks, strict) for s in spec[2]))
    if kind in ("map", "dc", "u"):
        return (spec[1], tuple((k, _sig_from_spec(s, ranks, strict)) for k, s in zip(spec[2], spec[3])))
    return ("o", spec[1])


def flatten_sample(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], Spec]:
    """Flatten a call's inputs in the order used by :class:`GraphSpec` (args, then sorted kwargs)."""
    return flatten((tuple(args), {k: kwargs[k] for k in sorted(kwargs)}))


def unflatten_sample(spec: Spec, leaves: list[Any]) -> Sample:
    """Inverse of :func:`flatten_sample`."""
    args, kwargs = unflatten(spec, leaves)
    return tuple(args), dict(kwargs)


def leaf_paths(spec: Spec, root: str) -> list[str]:
    """Human-readable locators of the tensor leaves of ``spec`` (``args[0]``, ``kwargs['mask']``...)."""
    paths: list[str] = []
    _paths(spec, root, paths)
    return paths


def sample_leaf_paths(spec: Spec) -> list[str]:
    """Locators of the tensor leaves of a spec made by :func:`flatten_sample`."""
    _, (args_spec, kwargs_spec) = spec
    paths: list[str] = []
    for i, child in enumerate(args_spec[1]):
        _paths(child, f"args[{i}]", paths)
    for key, child in zip(kwargs_spec[1], kwargs_spec[2]):
        _paths(child, f"kwargs[{key!r}]", paths)
    return paths


def _paths(spec: Spec, prefix: str, out: list[str]) -> None:
    kind = spec[0]
    if kind == "T":
        out.append(prefix)
    elif kind in ("tuple", "list"):
        for i, child in enumerate(spec[1]):
            _paths(child, f"{prefix}[{i}]", out)
    elif kind in ("ntuple", "seq"):
        for i, child in enumerate(spec[2]):
            _paths(child, f"{prefix}[{i}]", out)
    elif kind == "dict":
        for key, child in zip(spec[1], spec[2]):
            _paths(child, f"{prefix}[{key!r}]", out)
    elif kind == "map":
        for key, child in zip(spec[2], spec[3]):
            _paths(child, f"{prefix}[{key!r}]", out)
    elif kind in ("dc", "u"):
        for name, child in zip(spec[2], spec[3]):
            _paths(child, f"{prefix}.{name}", out)


_UNSAFE = re.compile(r"[^A-Za-z0-9]+")


def tensor_names(paths: list[str]) -> list[str]:
    """Turn locators into unique identifier-like names (``kwargs['input_ids']`` → ``kwargs_input_ids``)."""
    names: list[str] = []
    seen: set[str] = set()
    for path in paths:
        base = _UNSAFE.sub("_", path).strip("_") or "tensor"
        name, n = base, 1
        while name in seen:
            name, n = f"{base}_{n}", n + 1
        seen.add(name)
        names.append(name)
    return names


def __getattr__(name: str) -> Any:
    # spec_to_json / spec_from_json moved to tree_json; keep the old import path working.
    if name in ("spec_to_json", "spec_from_json"):
        from torch_tweak.torch.module import tree_json

        return getattr(tree_json, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
