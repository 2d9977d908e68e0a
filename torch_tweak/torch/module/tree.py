"""Structure-aware flattening of call arguments and outputs.

A value is split into its tensor leaves and a hashable *spec* that records everything else: the
containers (tuple, list, dict, namedtuple, dataclass, dict subclasses such as Hugging Face
``ModelOutput``) and the non-tensor values (``None``, numbers, strings, dtypes). ``unflatten`` puts
new tensors back into the same structure with the original container types, so a backend that only
produces tensors can return what the eager module returned.

Specs are nested tuples, cheap to hash and compare, and convert to JSON with :func:`spec_to_json`.
Types named in a JSON spec are resolved only from :func:`register_type` or by a static lookup in modules
that are already imported; loading a spec never imports anything and never runs a module ``__getattr__``.

Containers are rebuilt through their own protocol, never by calling a class with keyword arguments
taken from a spec: a namedtuple through ``tuple.__new__``, a dataclass field by field without
``__init__``/``__post_init__``, a Hugging Face ``ModelOutput`` / diffusers ``BaseOutput`` through its
own field-name constructor, an ``OrderedDict`` from its items. Only classes the user registered (or,
in-process, classes the program's own values produced) are called. Specs read from files are checked
by :func:`~torch_tweak.torch.module.tree_json.spec_from_json`, the one owner of that policy.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from collections import OrderedDict
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

# Slot descriptors read an object's or a class's namespace without attribute lookup, so no ``__getattr__``,
# ``__getattribute__`` or metaclass hook can run while a name from a file is resolved.
_MODULE_NAMESPACE = types.ModuleType.__dict__["__dict__"]
_CLASS_NAMESPACE = type.__dict__["__dict__"]
_CLASS_MRO = type.__dict__["__mro__"]
_CLASS_MODULE = type.__dict__["__module__"]
_CLASS_QUALNAME = type.__dict__["__qualname__"]
_MISSING = object()

_OUTPUT_BASES = (("transformers.utils.generic", "ModelOutput"), ("diffusers.utils.outputs", "BaseOutput"))
"""Where the output base classes live; looked up in ``sys.modules`` only, never imported."""


def register_type(cls: type) -> type:
    """Trust ``cls`` to be named in saved specs and rebuilt by calling it (works as a decorator).

    Without registration a spec read from a file may only name containers that are rebuilt without
    running their code (namedtuples, plain dataclasses, ``OrderedDict``, Hugging Face ``ModelOutput`` and
    diffusers ``BaseOutput`` subclasses). Registering says the class is safe to call with values from a
    checkpoint: e.g. a list subclass (rebuilt as ``cls(items)``) or a custom mapping (``cls(**items)``).
    """
    if not isinstance(cls, type):
        raise UnsupportedInputError(
            f"register_type expects a class, got {type(cls).__name__} {cls!r:.80}: only classes can be rebuilt "
            "from a saved structure. Pass the container class itself, e.g. tt.register_type(MyOutput)."
        )
    _USER_TYPES[qualified_name(cls)] = cls
    return cls


def is_registered_type(cls: type) -> bool:
    """True if ``cls`` itself was passed to :func:`register_type` (or :func:`register_container`)."""
    return _USER_TYPES.get(qualified_name(cls)) is cls


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
    """Return ``"module:QualName"`` for a class (read statically, so no metaclass hook runs)."""
    if not issubclass(type(cls), type):
        return repr(cls)
    return f"{_CLASS_MODULE.__get__(cls)}:{_CLASS_QUALNAME.__get__(cls)}"


def static_lookup(cls: type, name: str, default: Any = None) -> Any:
    """``name`` as defined in the namespaces along ``cls.__mro__``, without descriptors or attribute hooks.

    Used to inspect classes named in a file (``__new__``, ``__del__``, ``_fields``...) without running them.
    """
    for klass in _CLASS_MRO.__get__(cls):
        namespace = _CLASS_NAMESPACE.__get__(klass)
        if name in namespace:
            return namespace[name]
    return default


def in_mro(cls: type, base: type) -> bool:
    """``issubclass(cls, base)`` by identity along the stored MRO: no ``__subclasscheck__`` or ``__eq__`` runs."""
    return any(klass is base for klass in _CLASS_MRO.__get__(cls))


def is_output_class(cls: type) -> bool:
    """True for subclasses of transformers' ``ModelOutput`` or diffusers' ``BaseOutput``.

    The bases are looked up in ``sys.modules`` only: if transformers is not imported, no class can derive
    from its ``ModelOutput``, so there is nothing to import.
    """
    for module_name, class_name in _OUTPUT_BASES:
        module = sys.modules.get(module_name)
        if module is None or not issubclass(type(module), types.ModuleType):
            continue
        base = _MODULE_NAMESPACE.__get__(module).get(class_name)
        if issubclass(type(base), type) and in_mro(cls, base):
            return True
    return False


def resolve_type(name: str) -> type:
    """Find the class named ``"module:QualName"`` among registered types and imported modules only.

    The name comes from a file, so the lookup is static: it reads ``vars(module)`` and then ``vars(cls)``
    for nested classes, in modules already in ``sys.modules``. A module-level ``__getattr__`` (lazy
    modules import on attribute access) never runs, and nothing is imported. The class found must carry
    the name it was asked for, so an alias cannot smuggle a class in under another module's name.
    """
    registered = _USER_TYPES.get(name)
    if registered is not None:
        return registered
    module_name, _, qualname = name.partition(":")
    if not module_name or not qualname:
        raise UnsupportedInputError(
            f"Malformed type name {name!r:.120} in a structure spec: types are written as 'module:QualName'. "
            "The file is corrupt or was not written by torch_tweak."
        )
    module = sys.modules.get(module_name)
    if module is None:
        raise UnsupportedInputError(
            f"Type {name!r} is not available: module {module_name!r} is not imported. torch_tweak never imports "
            f"modules named in a file; import {module_name!r} before loading, or register the type with "
            "torch_tweak.torch.register_type()."
        )
    if not issubclass(type(module), types.ModuleType):
        raise UnsupportedInputError(
            f"Type {name!r} is not available: sys.modules[{module_name!r}] is not a module, so it cannot be "
            "searched without running its code. Register the type with torch_tweak.torch.register_type()."
        )
    namespace: Any = _MODULE_NAMESPACE.__get__(module)
    found: Any = _MISSING
    for part in qualname.split("."):
        found = namespace.get(part, _MISSING) if namespace is not None else _MISSING
        if found is _MISSING or not issubclass(type(found), type):
            break
        namespace = _CLASS_NAMESPACE.__get__(found)
    if found is _MISSING or not issubclass(type(found), type) or qualified_name(found) != name:
        raise UnsupportedInputError(
            f"Type {name!r} does not exist in the imported module {module_name!r} (looked up statically: "
            "module-level __getattr__ and aliases are not followed). Import the module that defines it, or "
            "register the type with torch_tweak.torch.register_type()."
        )
    return found


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
        return build_namedtuple(spec[1], tuple(_unflatten(s, it) for s in spec[2]))
    if kind == "map":
        values = {k: _unflatten(s, it) for k, s in zip(spec[2], spec[3])}
        return build_mapping(spec[1], values)
    if kind == "dc":
        return build_dataclass(spec[1], dict(zip(spec[2], (_unflatten(s, it) for s in spec[3]))))
    if kind == "seq":
        return spec[1](_unflatten(s, it) for s in spec[2])
    raise UnsupportedInputError(
        f"Cannot rebuild an object of type {qualified_name(spec[1])}: it is not a tensor, a container or a "
        "plain value. Return tensors, tuples, lists, dicts, namedtuples or dataclasses from the tuned module."
    )


def build_namedtuple(cls: type, values: tuple[Any, ...]) -> Any:
    """A namedtuple from its items through the tuple protocol: the class's ``__new__``/``__init__`` never run."""
    fields = getattr(cls, "_fields", None)
    if isinstance(fields, tuple) and len(fields) != len(values):
        raise UnsupportedInputError(
            f"Cannot rebuild {qualified_name(cls)}: it has {len(fields)} fields but the structure holds "
            f"{len(values)} items. The structure was saved for another version of the class; save it again."
        )
    return tuple.__new__(cls, values)


def dataclass_field_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s dataclass fields, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls))


def build_dataclass(cls: type, values: dict[str, Any]) -> Any:
    """A dataclass set field by field, without ``__init__``/``__post_init__`` (frozen and slots classes too).

    The values were read from an existing instance (or a file); running the constructor again could
    transform them twice, and for a file would run the class's code on chosen arguments.
    """
    names = dataclass_field_names(cls)
    if len(values) != len(names) or set(values) != set(names):
        raise UnsupportedInputError(
            f"Cannot rebuild the dataclass {qualified_name(cls)}: the structure has the fields {sorted(values)} "
            f"but the class has {list(names)}. The structure was saved for another version of the class; save it again."
        )
    try:
        obj = object.__new__(cls)
    except TypeError as exc:
        raise UnsupportedInputError(
            f"Cannot rebuild the dataclass {qualified_name(cls)} without calling it ({exc}): it derives from a built-in "
            "type other than object. Return a plain dataclass, a namedtuple or a dict from the tuned module."
        ) from exc
    for name in names:
        object.__setattr__(obj, name, values[name])
    return obj


def build_mapping(cls: type, values: dict[Any, Any]) -> Any:
    """A mapping through its protocol: output classes by field name, ``OrderedDict`` from its items.

    Other mappings (registered ones, or in-process values the program produced) are called as before:
    ``cls(**values)`` when the keys are strings, else ``cls(values)``.
    """
    if is_output_class(cls) and dataclasses.is_dataclass(cls):
        return _build_output(cls, values)
    if cls is OrderedDict:
        return OrderedDict(values.items())
    if all(isinstance(k, str) for k in values):
        try:
            return cls(**values)
        except TypeError:
            pass
    return cls(values)


def _build_output(cls: type, values: dict[Any, Any]) -> Any:
    """A ``ModelOutput``/``BaseOutput`` through its own constructor, checked to hold exactly ``values``.

    Their ``__post_init__`` reinterprets a lone non-tensor first field as ``(name, value)`` pairs and sets
    those as attributes; a structure that triggers this is refused instead of being silently reshaped.
    """
    names = set(dataclass_field_names(cls))
    unknown = [k for k in values if not isinstance(k, str) or k not in names]
    if unknown:
        raise UnsupportedInputError(
            f"Cannot rebuild {qualified_name(cls)}: {unknown!r:.120} are not among its fields {sorted(names)}. "
            "The structure was saved for another version of the class, or the file was crafted; save it again."
        )
    obj = cls(**values)
    expected = {k: v for k, v in values.items() if v is not None}
    if set(dict.keys(obj)) != set(expected) or any(dict.__getitem__(obj, k) is not v for k, v in expected.items()):
        raise UnsupportedInputError(
            f"Cannot rebuild {qualified_name(cls)}: its constructor reinterpreted the values (a lone non-tensor first "
            "field is read as (name, value) pairs), so the result would not match the saved structure. Return the "
            "first field as a tensor, or the file was crafted."
        )
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
        return build_namedtuple(cls, tuple(map_tensors(item, fn) for item in obj))
    if isinstance(obj, Mapping):
        return build_mapping(cls, {k: map_tensors(obj[k], fn) for k in obj.keys()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return build_dataclass(cls, {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)})
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
