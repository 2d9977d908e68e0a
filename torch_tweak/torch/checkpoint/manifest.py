"""The checkpoint manifest: a versioned JSON document describing every tuned module and its graphs.

Layout (format version 1)::

    {"format": "torch_tweak.checkpoint", "format_version": 1, "created": "2026-01-01T00:00:00Z",
     "environment": {"torch_tweak": ..., "torch": ..., "openvino": ..., "torchao": ..., "python": ...,
                     "machine": "x86_64", "cpu": {"model": ..., "flags": ["avx2", ...]}},
     "root": "module" | "object",
     "modules": [{"name": ..., "path": [["child", "encoder"], ...], "class": "pkg.mod:Class",
                  "parameters": [[name, [shape], dtype], ...], "weights": "tensors/m0.safetensors" | null,
                  "stores_weights": bool, "aliases": {tied name: stored name}, "offloaded": bool,
                  "graphs": [{"name": "0", "graph_spec": {...GraphSpec.to_dict()...},
                              "backend": {"type": ..., "class": "pkg.mod:Class", "description": ...,
                                          "requires_original_module": bool, "native_code": bool,
                                          "artifacts": [member, ...], "state": {...encoded to_dict()...}}}]}],
     "files": {member: {"size": int, "sha256": hex}}}

``path`` steps are ``child`` (an ``nn.Module`` child), ``attr`` (an attribute of a plain object), ``item``
(a dict key) and ``index`` (a list or tuple position). Every value read back is checked here before use.
"""

from __future__ import annotations

import json
import platform
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_tweak.__version__ import __version__
from torch_tweak.errors import CheckpointError
from torch_tweak.torch import environment as environment_probe
from torch_tweak.torch.backend.registry import required_packages

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "torch_tweak.checkpoint"
FORMAT_VERSION = 1
PATH_KINDS = ("child", "attr", "item", "index")
ISA_FLAGS = environment_probe.ISA_FLAGS  # the flags a manifest records (one list, in the probe)
# Distributions whose versions a manifest records, after torch_tweak's and torch's.
_LIBRARIES = ("openvino", "torchao", "safetensors")


class CheckpointWarning(UserWarning):
    """A checkpoint loads, but was made in a different environment (library versions, CPU features)."""


def parse_json(data: bytes, where: str) -> Any:
    """Parse untrusted JSON strictly: UTF-8, no duplicate keys, no NaN/Infinity, bounded nesting."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in items:
            if key in result:
                raise ValueError(f"duplicate key {key!r}")
            result[key] = value
        return result

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not allowed")

    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not valid JSON ({exc}); the checkpoint is corrupt.") from exc


def check_header(manifest: Any, path: Path) -> int:
    """Check the format name and version; return the version."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a torch_tweak checkpoint (its manifest has no format {FORMAT_NAME!r}).")
    version = manifest.get("format_version")
    if type(version) is not int or version < 1:
        raise CheckpointError(f"{path} has an invalid format version {version!r}; the checkpoint is corrupt.")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} uses checkpoint format {version}, made by a newer torch_tweak; this version ({__version__}) "
            f"reads format {FORMAT_VERSION} and older. Upgrade torch_tweak to load it."
        )
    return version


def library_versions() -> dict[str, str | None]:
    """Versions of torch_tweak and the runtimes a checkpoint may depend on (from package metadata)."""
    return {**environment_probe.core_versions(), **environment_probe.distribution_versions(_LIBRARIES)}


def environment() -> dict[str, Any]:
    """The environment recorded in a manifest."""
    cpu = environment_probe.cpu_info()
    return {
        **library_versions(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "system": sys.platform,
        "cpu": {"model": cpu.model,
                "flags": environment_probe.isa_flags()},
    }


@dataclass
class EnvironmentDiff:
    """How the loading environment differs from the saving one."""

    missing_flags: list[str]
    versions: dict[str, tuple[Any, Any]]

    def relevant_to(self, backend_types: list[str]) -> list[str]:
        """Library names whose version changed and that ``backend_types`` use."""
        used = {"torch", "torch_tweak"} | {p for t in backend_types for p in required_packages(t)}
        return sorted(k for k in self.versions if k in used)


def compare_environment(saved: Any) -> EnvironmentDiff:
    """Compare a manifest's ``environment`` with this process's."""
    saved = saved if isinstance(saved, dict) else {}
    current = library_versions()
    versions = {k: (saved[k], v) for k, v in current.items()
                if k in saved and (saved[k] is None or isinstance(saved[k], str)) and saved[k] != v}
    cpu = saved.get("cpu") if isinstance(saved.get("cpu"), dict) else {}
    saved_flags = cpu.get("flags")
    flags = environment_probe.cpu_info().flags
    missing: list[str] = []
    if isinstance(saved_flags, list) and flags is not None:
        missing = sorted(str(f) for f in saved_flags if f in ISA_FLAGS and f not in flags)
    return EnvironmentDiff(missing, versions)


def warn_environment(diff: EnvironmentDiff, path: Path, backend_types: list[str]) -> None:
    """Warn about version changes of the libraries the checkpoint uses and about missing CPU features."""
    changed = diff.relevant_to(backend_types)
    if changed:
        text = ", ".join(f"{k} {diff.versions[k][0]} → {diff.versions[k][1]}" for k in changed)
        warnings.warn(f"Checkpoint {path} was saved with other library versions ({text}); outputs and speed may "
                      "differ from those measured when tuning. Tune again with these versions to be sure.",
                      CheckpointWarning, stacklevel=3)
    if diff.missing_flags:
        warnings.warn(f"Checkpoint {path} was saved on a CPU with {', '.join(diff.missing_flags)}, which this CPU "
                      "lacks; modules whose artifacts are machine code compiled for that CPU run their original code, "
                      "and the others may be slower than when tuning.", CheckpointWarning, stacklevel=3)


# schema -----------------------------------------------------------------------------------------


@dataclass
class GraphEntry:
    """One graph of a module as stored."""

    name: str
    graph_spec: dict[str, Any]
    backend_type: str
    backend_class: str
    native_code: bool
    artifacts: list[str]
    state: dict[str, Any]


@dataclass
class ModuleEntry:
    """One tuned module as stored."""

    name: str
    path: list[tuple[str, str | int]]
    class_name: str
    parameters: list[tuple[str, tuple[int, ...], str]]
    weights: str | None
    stores_weights: bool
    aliases: dict[str, str]
    offloaded: bool
    graphs: list[GraphEntry]


def _get(d: Any, key: str, kind: type | tuple[type, ...], where: str, optional: bool = False) -> Any:
    if not isinstance(d, dict):
        raise CheckpointError(f"The manifest's {where} is not an object; the checkpoint is corrupt.")
    value = d.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CheckpointError(f"The manifest's {where}.{key} is missing or has the wrong type; the checkpoint is corrupt.")
    return value


def path_text(path: list[tuple[str, str | int]]) -> str:
    """``[("attr", "unet"), ("child", "0")]`` → ``.unet.0``; the root is ``<root>``."""
    text = "".join(f".{key}" if kind in ("child", "attr") else f"[{key!r}]" for kind, key in path)
    return text or "<root>"


def _path(value: Any, where: str) -> list[tuple[str, str | int]]:
    steps = []
    for step in value:
        if not (isinstance(step, list) and len(step) == 2 and step[0] in PATH_KINDS):
            raise CheckpointError(f"The manifest's {where}.path has a malformed step {step!r:.80}.")
        kind, key = step
        valid = isinstance(key, str) if kind in ("child", "attr") else (
            type(key) is int if kind == "index" else isinstance(key, (str, int)) and not isinstance(key, bool))
        if not valid:
            raise CheckpointError(f"The manifest's {where}.path has a malformed step {step!r:.80}.")
        steps.append((kind, key))
    return steps


def _parameters(value: Any, where: str) -> list[tuple[str, tuple[int, ...], str]]:
    result = []
    for item in value:
        ok = isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[2], str)
        if not ok or not isinstance(item[1], list) or not all(type(s) is int for s in item[1]):
            raise CheckpointError(f"The manifest's {where}.parameters has a malformed entry {item!r:.80}.")
        result.append((item[0], tuple(item[1]), item[2]))
    return result


def parse_modules(manifest: dict[str, Any]) -> list[ModuleEntry]:
    """Validate the ``modules`` list of a manifest."""
    modules = []
    for i, m in enumerate(_get(manifest, "modules", list, "root")):
        where = f"modules[{i}]"
        graphs = []
        for j, g in enumerate(_get(m, "graphs", list, where)):
            gw = f"{where}.graphs[{j}]"
            b = _get(g, "backend", dict, gw)
            artifacts = _get(b, "artifacts", list, f"{gw}.backend")
            if not all(isinstance(a, str) for a in artifacts):
                raise CheckpointError(f"The manifest's {gw}.backend.artifacts holds non-strings.")
            graphs.append(GraphEntry(
                _get(g, "name", str, gw), _get(g, "graph_spec", dict, gw), _get(b, "type", str, f"{gw}.backend"),
                _get(b, "class", str, f"{gw}.backend"), _get(b, "native_code", bool, f"{gw}.backend"), artifacts,
                _get(b, "state", dict, f"{gw}.backend")))
        aliases = _get(m, "aliases", dict, where)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
            raise CheckpointError(f"The manifest's {where}.aliases must map names to names.")
        if not graphs:
            raise CheckpointError(f"The manifest's {where} has no graphs; the checkpoint is corrupt.")
        modules.append(ModuleEntry(
            _get(m, "name", str, where), _path(_get(m, "path", list, where), where), _get(m, "class", str, where),
            _parameters(_get(m, "parameters", list, where), where), _get(m, "weights", str, where, optional=True),
            _get(m, "stores_weights", bool, where), aliases, _get(m, "offloaded", bool, where), graphs))
    if not modules:
        raise CheckpointError("The manifest lists no module; tt.save never writes such a checkpoint, so it is corrupt.")
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise CheckpointError("The manifest lists a module name twice; the checkpoint is corrupt.")
    return modules
