"""Backend state in a checkpoint: the ``to_dict`` protocol, encoded as JSON, and backend classes by name.

``Backend.to_dict()`` values are JSON values, ``pathlib.Path`` values (artifact files or folders that are
copied into the checkpoint) and ``torch.Tensor`` values (stored as safetensors). In the manifest a path
becomes ``{"$tt": "artifact", "kind": "file"|"dir", "member": <name in the archive>}`` and a tensor becomes
``{"$tt": "tensor", "key": <key in the module's safetensors file>}``; decoding turns them back into the
extracted path and the loaded tensor.

Backend classes are resolved by the backend registry (:func:`~torch_tweak.torch.backend.registry.resolve_backend`):
torch_tweak's own backends, registered classes and ``Backend`` subclasses the program has already imported.
:func:`check_backend_state` then refuses states a stranger could abuse. Nothing named in a checkpoint is
ever imported.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

import torch

from torch_tweak.errors import CheckpointError, ConfigError
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.registry import resolve_backend

MARKER = "$tt"


def is_native(cls: type[Backend]) -> bool:
    """True if the backend's artifacts are native code, run as soon as they are loaded and compiled for the
    saving CPU (AOTInductor packages); a custom backend says so with ``native_code = True``."""
    return bool(getattr(cls, "native_code", False))


def components(backend_type: str, backend_class: str, state: Any) -> list[tuple[str, str, Any]]:
    """``(type, class, state)`` of a stored backend and of every backend nested in its state, outermost first.

    A backend assembled from others (a router's routes, a guard's inner backend, a guard inside a route)
    stores each of them as ``{"backend_type", "backend_class", "state"}``; every dict with a string
    ``backend_type`` is such an entry wherever it sits, so the audit checks each one (artifact references,
    unsafe settings, native code) without knowing which backend classes nest others.
    """
    found = [(backend_type, backend_class, state)]
    pending = deque([state])
    while pending:
        value = pending.popleft()
        if isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, dict):
            if isinstance(value.get("backend_type"), str):
                found.append((value["backend_type"], value.get("backend_class"), value.get("state")))
            pending.extend(value.values())
    return found


def route_types(backend_type: str, state: Any) -> list[str]:
    """``backend_type`` and the types of the backends nested in its state (see :func:`components`)."""
    return [t for t, _, _ in components(backend_type, "", state)]


def check_backend_state(backend_type: str, backend_class: str, state: Any, where: str) -> list[type[Backend]]:
    """Resolve the classes of a stored backend (and of those nested in it); refuse a state a stranger could abuse.

    Every key a class declares in ``artifact_keys`` must be an archive-member reference (never a path on
    disk), and the stored config must rebuild with no :meth:`BackendConfig.unsafe_settings` (options that
    could run a program or touch files). Returns the classes, outermost first. Nothing is loaded or run.
    """
    classes = []
    for type_name, class_name, sub in components(backend_type, backend_class, state):
        if not isinstance(class_name, str) or not isinstance(sub, dict):
            raise CheckpointError(f"The manifest's {where} has a malformed backend entry; the checkpoint is corrupt.")
        cls = resolve_backend(type_name, class_name, where)
        for key in cls.artifact_keys:
            value = sub.get(key)
            if value is not None and not (isinstance(value, dict) and value.get(MARKER) == "artifact"):
                raise CheckpointError(
                    f"{where}: the {type_name} state's {key!r} is {str(value)[:120]!r}, not a file inside the "
                    "checkpoint. Checkpoints refer to artifacts only as archive members, so this one was edited "
                    "to point elsewhere; do not load it."
                )
        config_class = cls.config_class
        if config_class is not None and isinstance(sub.get(Backend.STATE_CONFIG), dict):
            try:
                config = config_class.from_dict(sub[Backend.STATE_CONFIG])
            except (ConfigError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{where}: the stored {type_name} config is invalid ({exc}).") from exc
            unsafe = config.unsafe_settings()
            if unsafe:
                raise CheckpointError(
                    f"{where}: the stored {type_name} config has settings a checkpoint may not carry: "
                    f"{'; '.join(unsafe)}. They could run a program or touch files when the checkpoint is loaded; "
                    "do not load it unless you wrote it (then remove those options and save again)."
                )
        classes.append(cls)
    return classes


def native_references(backend_type: str, backend_class: str, state: Any, where: str,
                      live: dict[str, type[Backend]] | None = None) -> list[tuple[dict[str, Any], str, bool]]:
    """``(sub-state, key, optional)`` for every artifact reference in a stored backend state that is native code.

    A native backend's (``native_code``) artifacts are all native and required; a backend's
    ``optional_native_keys`` are native artifacts it can do without (it compiles instead), marked ``optional``.
    Classes resolve as in :func:`check_backend_state`, from the class attributes, never from the manifest;
    ``tt.save`` passes the classes of the live backends instead (``live``: type name → class).
    """
    found = []
    for type_name, class_name, sub in components(backend_type, backend_class, state):
        if not isinstance(class_name, str) or not isinstance(sub, dict):
            continue  # refused by check_backend_state
        cls = live.get(type_name) if live is not None else resolve_backend(type_name, class_name, where)
        if cls is None:
            continue
        native = is_native(cls)
        for key in cls.artifact_keys if native else cls.optional_native_keys:
            value = sub.get(key)
            if isinstance(value, dict) and value.get(MARKER) == "artifact":
                found.append((sub, key, not native))
    return found


def referenced_members(state: Any, names: list[str]) -> set[str]:
    """Archive members that the artifact references in ``state`` use (a folder reference uses its files)."""
    found: set[str] = set()
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            member = value.get("member")
            if value.get(MARKER) == "artifact" and isinstance(member, str) and value.get("kind") == "file":
                found.add(member)
            elif value.get(MARKER) == "artifact" and isinstance(member, str):
                found.update(n for n in names if n.startswith(member + "/"))
            else:
                stack.extend(value.values())
    return found


def encode_state(value: Any, where: str, on_path: Callable[[Path, str], dict[str, Any]],
                 on_tensor: Callable[[torch.Tensor, str], dict[str, Any]]) -> Any:
    """JSON form of a ``to_dict`` value; ``on_path``/``on_tensor`` store artifacts and tensors and return markers."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointError(f"{where} is {value}, which a checkpoint cannot store; use a finite number or None.")
        return value
    if isinstance(value, PurePath):
        return on_path(Path(value), where)
    if isinstance(value, torch.Tensor):
        return on_tensor(value, where)
    if isinstance(value, (list, tuple)):
        return [encode_state(v, f"{where}[{i}]", on_path, on_tensor) for i, v in enumerate(value)]
    if isinstance(value, dict):
        result = {}
        for key, item in value.items():
            if not isinstance(key, str) or key == MARKER:
                raise CheckpointError(f"{where} has the key {key!r}; checkpoint dicts need string keys other than "
                                      f"{MARKER!r}.")
            result[key] = encode_state(item, f"{where}[{key!r}]", on_path, on_tensor)
        return result
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot store: Backend.to_dict() must return JSON "
        "values, pathlib.Path artifacts and torch.Tensor values only (checkpoints are never pickled)."
    )


def decode_state(value: Any, where: str, artifact: Callable[[dict[str, Any], str], Path],
                 tensor: Callable[[dict[str, Any], str], torch.Tensor]) -> Any:
    """Inverse of :func:`encode_state`; markers are resolved through ``artifact`` and ``tensor``."""
    if isinstance(value, list):
        return [decode_state(v, f"{where}[{i}]", artifact, tensor) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if MARKER in value:
            kind = value[MARKER]
            if kind == "artifact":
                return artifact(value, where)
            if kind == "tensor":
                return tensor(value, where)
            raise CheckpointError(f"The manifest's {where} has an unknown marker {kind!r:.40}; the checkpoint is corrupt.")
        return {k: decode_state(v, f"{where}[{k!r}]", artifact, tensor) for k, v in value.items()}
    return value
