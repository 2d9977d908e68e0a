"""The classes a structure spec names: which are trusted, how a name finds its class, how each is rebuilt.

Structure nodes (:mod:`~torch_tweak.torch.module.nodes`) refer to container classes. This module owns the
facts about those classes that do not depend on the node: the registries filled by the user
(:func:`register_type`, :func:`register_container`, :func:`ignore_type`), the static inspection used on
classes named in a file (a name resolves through ``vars()`` of modules already imported; nothing is
imported, no module ``__getattr__``, descriptor or metaclass hook runs), and the protocols that rebuild a
container without calling a class with values from a spec: a namedtuple through ``tuple.__new__``, a
dataclass field by field without ``__init__``/``__post_init__``, a Hugging Face ``ModelOutput`` / diffusers
``BaseOutput`` through its own field-name constructor, an ``OrderedDict`` from its items. Only classes the
user registered (or, in-process, classes the program's own values produced) are called.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch_tweak.errors import UnsupportedInputError

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


def container_fields(obj: Any) -> Callable[[Any], dict[str, Any]] | None:
    """The ``fields`` function registered for ``obj``'s class or a base of it, or ``None``."""
    if not _CONTAINERS:
        return None
    for klass in type(obj).__mro__:
        if klass in _CONTAINERS:
            return _CONTAINERS[klass]
    return None


def ignore_type(cls: type) -> None:
    """Treat values of ``cls`` as opaque objects: not traversed, not part of graph identity by value."""
    _IGNORED_TYPES.add(cls)


def is_ignored_type(cls: type) -> bool:
    """True if ``cls`` itself was passed to :func:`ignore_type`."""
    return cls in _IGNORED_TYPES


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
