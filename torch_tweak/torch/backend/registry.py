"""The backends torch_tweak ships, in one table: name → module, config class, required packages, candidacy.

Everything that needs to know which backends exist reads this table: the lazy attributes of
``torch_tweak.torch.backend``, the default candidates of the strategies, the checkpoint loader (which
resolves stored type names only among known classes) and the environment checks of checkpoints (which
libraries a backend's artifacts depend on). Adding a backend is one file and one line here.

Stored backend type names (checkpoints) resolve through :func:`resolve_backend`: registered classes
(:func:`register_backend`), ``Backend`` subclasses the program has already imported, and the table's own
classes. Nothing named in a file is ever imported.

What a backend *is* lives on its class, not here: ``native_code``, ``artifact_keys``, ``config_class``,
``runtime``, ``requires_original_module``, the inert options of its config (``unsafe_settings``) and its
default variants (:meth:`Backend.default_variants`). This table holds only what must be known before the
class is imported (its module and the packages it needs), so listing backends never imports openvino or
torchao.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

from torch_tweak.errors import CheckpointError, ConfigError, UnsupportedInputError
from torch_tweak.torch.backend.backend import Backend, BackendState
from torch_tweak.torch.module.tree import qualified_name

logger = logging.getLogger(__name__)

_PACKAGE = "torch_tweak.torch.backend"
_REGISTERED: dict[str, type[Backend]] = {}


@dataclass(frozen=True)
class BackendEntry:
    """One shipped backend.

    Attributes:
        module: the module that defines the backend and its config class.
        config: the config class's name (None for a backend without one).
        requires: packages the backend needs at run time (checked with ``find_spec``, never imported here).
        candidate: tried by strategies given no candidates (the measuring strategies and ``FirstWinsStrategy``),
            in table order: fastest first, eager last.
        build_cost: how long a build usually takes, as a rank (0 nothing to build, 1 an export and a
            conversion, 2 a compiler run, 3 quantization and a compiler run); the measuring strategies build
            their candidates cheapest first so that a time budget is spent on the likely winners.
    """

    module: str
    config: str | None
    requires: tuple[str, ...] = ()
    candidate: bool = True
    build_cost: int = 2


BACKENDS: dict[str, BackendEntry] = {
    "OpenVINOBackend": BackendEntry(f"{_PACKAGE}.openvino", "OpenVINOBackendConfig", ("openvino",), build_cost=1),
    "ONNXRuntimeBackend": BackendEntry(f"{_PACKAGE}.onnxruntime", "ONNXRuntimeBackendConfig", ("onnxruntime",),
                                       build_cost=1),
    "TorchInductorBackend": BackendEntry(f"{_PACKAGE}.torch_inductor", "TorchInductorBackendConfig"),
    "TorchAOBackend": BackendEntry(f"{_PACKAGE}.torchao", "TorchAOBackendConfig", ("torchao",), build_cost=3),
    "TorchInductorAOTBackend": BackendEntry(f"{_PACKAGE}.torch_inductor_aot", "TorchInductorAOTBackendConfig",
                                            candidate=False, build_cost=3),
    "BatchRouterBackend": BackendEntry(f"{_PACKAGE}.batch_router", None, candidate=False),
    "NonFiniteGuardBackend": BackendEntry(f"{_PACKAGE}.non_finite_guard", None, candidate=False),
    "TorchEagerBackend": BackendEntry(f"{_PACKAGE}.torch_eager", "TorchEagerBackendConfig", build_cost=0),
}


def lazy_names() -> dict[str, str]:
    """Every backend and config class name → the module defining it."""
    names = {name: entry.module for name, entry in BACKENDS.items()}
    names.update({entry.config: entry.module for entry in BACKENDS.values() if entry.config is not None})
    return names


def required_packages(name: str) -> tuple[str, ...]:
    """The packages backend ``name`` needs (empty for an unknown name)."""
    entry = BACKENDS.get(name)
    return entry.requires if entry is not None else ()


def available(name: str) -> bool:
    """True if backend ``name`` is known and its required packages are installed (nothing is imported)."""
    entry = BACKENDS.get(name)
    if entry is None:
        return False
    return all(importlib.util.find_spec(package) is not None for package in entry.requires)


def backend_class(name: str) -> type[Backend] | None:
    """The class of the shipped backend ``name`` (imports torch_tweak's own module for it), or None."""
    entry = BACKENDS.get(name)
    if entry is None:
        return None
    try:
        cls = getattr(importlib.import_module(entry.module), name)
    except (ImportError, AttributeError) as exc:
        logger.debug("Backend %s is not importable here: %s", name, exc)
        return None
    return cls if isinstance(cls, type) and issubclass(cls, Backend) else None


def build_cost(backend: Backend) -> int:
    """The ``build_cost`` rank of ``backend``'s class (or of its nearest shipped base class; 2 if none)."""
    for klass in type(backend).__mro__:
        entry = BACKENDS.get(klass.__name__)
        if entry is not None and (klass.__module__ + ".").startswith(entry.module + "."):
            return entry.build_cost
    return 2


def default_candidates() -> list[Backend]:
    """Unbuilt templates of every candidate backend available here, fastest first, eager last."""
    templates: list[Backend] = []
    for name, entry in BACKENDS.items():
        if not entry.candidate or not available(name):
            continue
        cls = backend_class(name)
        if cls is not None:
            templates.extend(cls.default_variants())
    return templates


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Allow checkpoints to restore backends of class ``cls`` (works as a decorator).

    Subclasses of ``Backend`` defined in modules the program has imported are found without registering;
    registration makes the choice explicit, and wins over an imported class of the same name.
    """
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise UnsupportedInputError(f"register_backend expects a Backend subclass, got {cls!r}.")
    _REGISTERED[cls.__name__] = cls
    return cls


def _subclasses(root: type) -> list[type]:
    found, stack = [], list(root.__subclasses__())
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


def known_backends() -> list[str]:
    """Names of the backend classes a checkpoint may name."""
    names = set(BACKENDS) | set(_REGISTERED)
    names |= {c.__name__ for c in _subclasses(Backend) if not getattr(c, "__abstractmethods__", None)}
    return sorted(names)


def resolve_backend(type_name: str, class_name: str, where: str) -> type[Backend]:
    """The backend class for a stored ``type`` (class name) and ``class`` (``module:QualName``)."""
    if type_name in _REGISTERED:
        return _REGISTERED[type_name]
    imported = [c for c in _subclasses(Backend) if c.__name__ == type_name]
    exact = [c for c in imported if qualified_name(c) == class_name]
    if len(exact) == 1:
        return exact[0]
    builtin = backend_class(type_name)  # torch_tweak's own module for a fixed name, nothing else
    if builtin is not None:
        return builtin
    if len(imported) == 1:
        return imported[0]
    if len(imported) > 1:
        raise CheckpointError(
            f"{where}: several imported Backend classes are named {type_name!r} "
            f"({', '.join(qualified_name(c) for c in imported)}); register the right one with "
            "torch_tweak.torch.checkpoint.register_backend(cls) before loading."
        )
    module = class_name.partition(":")[0]
    raise CheckpointError(
        f"{where}: the checkpoint uses backend {type_name!r} ({class_name}), which is not available. torch_tweak never "
        f"imports modules named in a checkpoint: import {module!r} (or register the class with "
        f"torch_tweak.torch.checkpoint.register_backend) before tt.load. Known backends: {known_backends()}."
    )


def backends_from(backends: Any, owner: str) -> list[Backend]:
    """Validate a user-given iterable of backend templates."""
    if backends is None:
        return []
    items = list(backends)
    if not items:
        raise ConfigError(f"{owner} got an empty list of backends; pass at least one, or None for the defaults.")
    for item in items:
        if not isinstance(item, Backend):
            raise ConfigError(f"{owner} expects Backend instances, got {type(item).__name__}.")
        if item.state != BackendState.INIT:
            raise ConfigError(f"{owner} expects unbuilt backends (state INIT); {item.describe()} is {item.state.name}.")
    return items
