"""Structure-aware flattening of call arguments and outputs: the entry points for structure specs.

A value is split into its tensor leaves and a hashable *spec*: a tree of typed nodes
(:mod:`~torch_tweak.torch.module.nodes`, :mod:`~torch_tweak.torch.module.class_nodes`) that records the
containers (tuple, list, dict, namedtuple, dataclass, dict subclasses such as Hugging Face ``ModelOutput``)
and the non-tensor values (``None``, numbers, strings, dtypes). :func:`flatten` dispatches on each value's
type once to pick its node; everything else a spec is used for belongs to the nodes and is reached from
here: :func:`unflatten` puts new tensors back into the same structure with the original container types (so
a backend that only produces tensors can return what the eager module returned), :func:`dispatch_key` gives
the graph identity of a call, :func:`leaf_paths` names the leaves, :func:`map_tensors` transforms the
tensors of a live value, and :func:`spec_to_json` / :func:`spec_from_json` store specs in checkpoints.

Types named in a JSON spec are resolved only from :func:`register_type` or by a static lookup in modules
that are already imported; loading a spec never imports anything and never runs a module ``__getattr__``
(:mod:`~torch_tweak.torch.module.classes`, :mod:`~torch_tweak.torch.module.class_nodes`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain
from typing import Any

import torch

from torch_tweak.torch.module.class_nodes import (
    ContainerNode,
    DataclassNode,
    MappingNode,
    NamedTupleNode,
    OpaqueNode,
    SequenceNode,
)
from torch_tweak.torch.module.classes import (
    build_dataclass,
    build_mapping,
    build_namedtuple,
    container_fields,
    dataclass_field_names,
    ignore_type,
    in_mro,
    is_container_type,
    is_ignored_type,
    is_output_class,
    is_registered_type,
    qualified_name,
    register_container,
    register_type,
    resolve_type,
    static_lookup,
)
from torch_tweak.torch.module.dtypes import dtype_from_name, dtype_name
from torch_tweak.torch.module.nodes import TENSOR, ConstNode, DictNode, ListNode, Node, TupleNode
from torch_tweak.torch.module.tree_json import spec_from_json, spec_to_json

__all__ = [
    "TENSOR", "Sample", "Spec", "build_dataclass", "build_mapping", "build_namedtuple", "dataclass_field_names",
    "dispatch_key", "dtype_from_name", "dtype_name", "flatten", "flatten_sample", "ignore_type", "in_mro",
    "is_container_type", "is_output_class", "is_registered_type", "leaf_paths", "map_tensors", "qualified_name",
    "register_container", "register_type", "resolve_type", "sample_leaf_paths", "signature", "spec_from_json",
    "spec_to_json", "static_lookup", "tensor_names", "unflatten", "unflatten_sample",
]

Sample = tuple[tuple[Any, ...], dict[str, Any]]
"""One recorded call: positional arguments and keyword arguments."""

Spec = Node
"""A structure spec: the root node of a flattened value."""

_CONST_TYPES = (type(None), bool, int, float, str, bytes, complex, torch.dtype, torch.device, torch.Size)


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    """Split ``obj`` into its tensor leaves (depth first) and a hashable structure spec."""
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: list[torch.Tensor]) -> Node:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return TENSOR
    cls = type(obj)
    if cls is tuple:
        return TupleNode.of(tuple([_flatten(item, leaves) for item in obj]))
    if cls is list:
        return ListNode.of(tuple([_flatten(item, leaves) for item in obj]))
    if cls is dict:
        keys = tuple(obj)
        return DictNode.of(keys, tuple([_flatten(obj[k], leaves) for k in keys]))
    if is_ignored_type(cls):
        return OpaqueNode.of(cls)
    if isinstance(obj, _CONST_TYPES):
        return ConstNode.of(obj)
    if isinstance(obj, tuple) and hasattr(cls, "_fields"):
        return NamedTupleNode.of(cls, tuple([_flatten(item, leaves) for item in obj]))
    if isinstance(obj, Mapping):
        keys = tuple(obj.keys())
        return MappingNode.of(cls, keys, tuple([_flatten(obj[k], leaves) for k in keys]))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = dataclass_field_names(cls)
        return DataclassNode.of(cls, names, tuple([_flatten(getattr(obj, n), leaves) for n in names]))
    if isinstance(obj, (list, tuple)):
        return SequenceNode.of(cls, tuple([_flatten(item, leaves) for item in obj]))
    fields = container_fields(obj)
    if fields is not None:
        values = fields(obj)
        names = tuple(values)
        return ContainerNode.of(cls, names, tuple([_flatten(values[n], leaves) for n in names]))
    return OpaqueNode.of(cls)


def unflatten(spec: Spec, leaves: list[Any] | Iterator[Any]) -> Any:
    """Rebuild a value with the structure of ``spec`` from tensors given in flatten order."""
    return spec.unflatten(iter(leaves))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Return ``obj`` with ``fn`` applied to every tensor leaf, keeping the structure.

    Objects that are not containers (e.g. a KV cache object) are kept as they are, by reference.
    """
    return _flatten(obj, []).map(obj, fn)


def flatten_sample(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], Spec]:
    """Flatten a call's inputs in the order used by :class:`GraphSpec` (args, then sorted kwargs).

    The spec is the one of ``(tuple(args), {name: kwargs[name] for name in sorted(kwargs)})``.
    """
    leaves: list[torch.Tensor] = []
    names = tuple(sorted(kwargs))
    positional = tuple([_flatten(arg, leaves) for arg in args])
    return leaves, _sample_spec(positional, names, tuple([_flatten(kwargs[name], leaves) for name in names]))


def _sample_spec(positional: tuple[Node, ...], names: tuple[str, ...], keywords: tuple[Node, ...]) -> Spec:
    """The spec of a call: ``("tuple", (("tuple", positional), ("dict", names, keywords)))``."""
    return TupleNode.of((TupleNode.of(positional), DictNode.of(names, keywords)))


def unflatten_sample(spec: Spec, leaves: list[Any]) -> Sample:
    """Inverse of :func:`flatten_sample`."""
    args, kwargs = unflatten(spec, leaves)
    return tuple(args), dict(kwargs)


def dispatch_key(structure: Spec, ranks: Iterable[int], strict: bool, phase: str | None = None) -> tuple[Any, ...]:
    """The graph identity of a call: its structure, tensor ranks and (when strict) non-tensor values.

    ``structure`` comes from :func:`flatten_sample` and ``ranks`` are its leaves' ranks: the same function
    keys a live call (``recording.graph_key``) and a stored graph (``GraphSpec.key``), so a graph loaded
    from a checkpoint is matched without rebuilding any input. Keyword arguments are in sorted order, so
    ``f(a=x, b=y)`` and ``f(b=y, a=x)`` match; ``phase`` (the LLM phase) is appended when given.
    """
    it = iter(ranks)
    positional, keywords = structure.children  # type: ignore[attr-defined]
    key: tuple[Any, ...] = (tuple([child.key(it, strict) for child in positional.children]),)
    names = keywords.keys
    if names:
        key = (key[0], names, tuple([child.key(it, strict) for child in keywords.children]))
    return key if phase is None else key + (("phase", phase),)


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], strict: bool, phase: str | None = None) -> tuple[Any, ...]:
    """The :func:`dispatch_key` of a live call (computed on every call of a tuned module).

    Keys of calls made of plain tensors and plain values are memoized (see :func:`_memo_key`), so the
    common call is a lookup instead of a flatten and a walk; any other call is flattened.
    """
    memo = _memo_key(args, kwargs, strict, phase)
    if memo is not None:
        key = _CALL_KEYS.get(memo)
        if key is not None:
            return key
    leaves, structure = flatten_sample(args, kwargs)
    key = dispatch_key(structure, [leaf.dim() for leaf in leaves], strict, phase)
    if memo is not None:
        if len(_CALL_KEYS) >= _MAX_CALL_KEYS:
            _CALL_KEYS.clear()
        _CALL_KEYS[memo] = key
    return key


def _memo_key(args: tuple[Any, ...], kwargs: dict[str, Any], strict: bool, phase: str | None) -> tuple[Any, ...] | None:
    """What decides the key of a call whose arguments are all plain tensors or plain values, else None.

    A tensor stands for its rank, a plain value (``None``, bool, int, float, str, dtype) for its exact class
    and, when strict, itself; keyword arguments count in the order given. Calls with equal memo keys flatten
    to specs with equal ranks that differ at most in values the key leaves out, so their keys are equal.
    """
    if len(args) + len(kwargs) > _MAX_MEMO_ARGS:
        return None
    parts = []
    for value in chain(args, kwargs.values()) if kwargs else args:
        cls = type(value)
        if cls is _Tensor:
            parts.append(value.dim())
        elif cls in _PLAIN_VALUES and not is_ignored_type(cls):
            parts.append((cls, value) if strict else cls)
        else:
            return None
    return (len(args), tuple(kwargs), tuple(parts), strict, phase)


_Tensor = torch.Tensor
_PLAIN_VALUES = frozenset((type(None), bool, int, float, str, torch.dtype))
_MAX_MEMO_ARGS = 32
_MAX_CALL_KEYS = 4096
_CALL_KEYS: dict[tuple[Any, ...], tuple[Any, ...]] = {}
"""Dispatch keys of calls by :func:`_memo_key`; emptied when full."""


def leaf_paths(spec: Spec, root: str) -> list[str]:
    """Human-readable locators of the tensor leaves of ``spec`` (``args[0]``, ``kwargs['mask']``...)."""
    paths: list[str] = []
    spec.paths(root, paths)
    return paths


def sample_leaf_paths(spec: Spec) -> list[str]:
    """Locators of the tensor leaves of a spec made by :func:`flatten_sample`."""
    positional, keywords = spec.children  # type: ignore[attr-defined]
    paths: list[str] = []
    for i, child in enumerate(positional.children):
        child.paths(f"args[{i}]", paths)
    for name, child in zip(keywords.keys, keywords.children):
        child.paths(f"kwargs[{name!r}]", paths)
    return paths


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
