"""``tt.save``: write every tuned module of a model or pipeline to a ``.tt`` checkpoint."""

from __future__ import annotations

import datetime
import filecmp
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torch_tweak.errors import CheckpointError
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.checkpoint import signing, weights
from torch_tweak.torch.checkpoint.archive import member_name_problem
from torch_tweak.torch.checkpoint.codec import MARKER, encode_state, is_native, native_references
from torch_tweak.torch.checkpoint.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, environment, path_text
from torch_tweak.torch.checkpoint.writer import (
    ArchiveWriter,
    no_space_hint,
    remove_save_leftovers,
    temporary_prefix,
)
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.state import ModuleState, internals
from torch_tweak.torch.module.tree import qualified_name
from torch_tweak.torch.module.walk import Found, find_wrapped, nested_prefixes
from torch_tweak.utils.permissions import secure_mkdir

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """What a save will write, collected (and validated) before anything touches the disk."""

    artifacts: dict[str, Path] = field(default_factory=dict)
    by_source: dict[Path, dict[str, Any]] = field(default_factory=dict)
    stored: list[tuple[dict[str, Path], dict[str, Any]]] = field(default_factory=list)  # (files, marker) per artifact
    tensor_files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def _target(path: str | os.PathLike[str]) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"tt.save needs a file path ending in .tt, got {type(path).__name__}.")
    target = Path(path).expanduser()
    if not target.name.endswith(".tt") or target.name == ".tt":
        raise CheckpointError(f"Checkpoint paths end in .tt (a sums file <name>_sha256_sums.txt is written beside "
                              f"it); got {str(path)!r}. Use e.g. 'model.tt'.")
    if target.is_dir():
        raise CheckpointError(f"{target} is a folder; pass the path of the .tt file to write.")
    try:
        secure_mkdir(target.parent)
    except OSError as exc:
        raise CheckpointError(f"Cannot create the folder {target.parent} for the checkpoint ({exc.strerror or exc}); "
                              "check the path and its permissions.") from exc
    return target


def _add_artifact(pending: _Pending, source: Path, prefix: str, where: str) -> dict[str, Any]:
    try:
        resolved = source.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: the artifact {source} does not exist (the cache folder may have been "
                              "cleaned); tune the module again before saving.") from exc
    if resolved in pending.by_source:
        return pending.by_source[resolved]
    files: dict[str, Path] = {}  # name within the artifact -> file
    if resolved.is_file():
        name = resolved.name if member_name_problem(resolved.name) is None else "artifact"
        files[name] = resolved
        marker = {MARKER: "artifact", "kind": "file", "member": f"{prefix}/{name}"}
    elif resolved.is_dir():
        for folder, dirs, names in os.walk(resolved):
            for entry in dirs + names:
                full = Path(folder, entry)
                relative = full.relative_to(resolved).as_posix()
                if full.is_symlink() or not (full.is_dir() or full.is_file()):
                    raise CheckpointError(f"{where}: {full} in the artifact folder is not a regular file or folder; "
                                          "checkpoints hold regular files only.")
                if full.is_file():
                    member = f"{prefix}/{relative}"
                    if member_name_problem(member) is not None:
                        raise CheckpointError(f"{where}: the artifact file {relative!r} has a name a checkpoint cannot "
                                              f"hold ({member_name_problem(member)}).")
                    files[relative] = full
        marker = {MARKER: "artifact", "kind": "dir", "member": prefix}
    else:
        raise CheckpointError(f"{where}: the artifact {source} is neither a file nor a folder.")
    # an artifact equal to one already stored (the same IR compiled with two performance hints, say) is stored once
    twin = next((m for f, m in pending.stored if m["kind"] == marker["kind"] and _same_files(f, files)), None)
    if twin is not None:
        marker = twin
    else:
        pending.artifacts.update({f"{prefix}/{name}": path for name, path in files.items()})
        pending.stored.append((files, marker))
    pending.by_source[resolved] = marker
    return marker


def _same_files(a: dict[str, Path], b: dict[str, Path]) -> bool:
    """Whether two artifacts hold the same files under the same names, byte for byte (hard links are not read)."""
    if a.keys() != b.keys():
        return False
    try:
        stats = {name: (a[name].stat(), b[name].stat()) for name in a}
        if any(x.st_size != y.st_size for x, y in stats.values()):
            return False
        return all((x.st_dev, x.st_ino) == (y.st_dev, y.st_ino) or filecmp.cmp(a[name], b[name], shallow=False)
                   for name, (x, y) in stats.items())
    except OSError:
        return False


def _graph_entry(pending: _Pending, backend: Backend, spec: GraphSpec, key: Any, tensors: dict[str, torch.Tensor],
                 prefix: str, where: str) -> dict[str, Any]:
    if spec.key() != key:
        raise CheckpointError(f"{where}: the dispatch key of this graph cannot be rebuilt from its graph spec, so it "
                              "could not be restored; this is a torch_tweak bug, please report it.")
    counter = iter(range(1 << 30))
    artifacts: list[str] = []

    def on_path(path: Path, at: str) -> dict[str, Any]:
        marker = _add_artifact(pending, path, f"{prefix}/a{next(counter)}", f"{where}: {at}")
        if marker["member"] not in artifacts:
            artifacts.append(marker["member"])
        return marker

    def on_tensor(tensor: torch.Tensor, at: str) -> dict[str, Any]:
        name = f"{weights.BACKEND_PREFIX}{prefix.replace('/', '.')}.{len(tensors)}"
        tensors[name] = tensor
        return {MARKER: "tensor", "key": name}

    unsafe = backend.unsafe_settings()
    if unsafe:
        raise CheckpointError(f"{where}: {backend.describe()} has settings a checkpoint may not carry: {'; '.join(unsafe)}. "
                              "tt.load refuses them because they could run a program or touch files on the loading "
                              "machine; tune without them to save this module.")
    try:
        state = backend.to_dict()
    except Exception as exc:
        raise CheckpointError(f"{where}: {backend.name}.to_dict() failed ({exc}); this backend cannot be saved.") from exc
    encoded = encode_state(state, f"{where}: {backend.name}.to_dict()", on_path, on_tensor)
    try:
        graph_spec = spec.to_dict()
    except Exception as exc:
        raise CheckpointError(f"{where}: the graph spec cannot be stored ({exc}). Non-tensor arguments must be None, "
                              "numbers, strings, dtypes, devices or sizes; or set tt.config.strict_mode = False.") from exc
    return {"name": spec.name, "graph_spec": graph_spec,
            "backend": {"type": type(backend).__name__, "class": qualified_name(type(backend)),
                        "description": backend.describe(), "precision": _precision(backend),
                        "requires_original_module": bool(backend.requires_original_module),
                        "native_code": any(is_native(type(b)) for b in backend.components()), "artifacts": artifacts,
                        "native_artifacts": sorted(sub[key]["member"] for sub, key, _ in native_references(
                            type(backend).__name__, qualified_name(type(backend)), encoded, where,
                            {type(b).__name__: type(b) for b in backend.components()})),
                        "state": encoded}}


def _precision(backend: Backend) -> str | None:
    try:
        return str(backend.executed_precision)
    except Exception:  # informational only
        return None


def _module_entry(pending: _Pending, index: int, found: Found, tuned: list[Found]) -> dict[str, Any]:
    proxy = found.proxy
    where = f"Module {proxy.name!r} at {path_text(found.path)}"
    state = internals(proxy)
    nested = nested_prefixes(found.path, [f.path for f in tuned])
    own = weights.own_tensors(proxy.wrapped, nested)
    tensors: dict[str, torch.Tensor] = {}
    graphs = [_graph_entry(pending, g.backend, g.spec, g.key, tensors, f"artifacts/m{index}/g{j}",
                           f"{where}, graph {g.spec.name!r}") for j, g in enumerate(state.graphs)]
    stores_weights = any(b.requires_original_module for b in state.backends())
    aliases: dict[str, str] = {}
    if stores_weights:
        packed, aliases = weights.pack(own, where)
        tensors.update({weights.WEIGHT_PREFIX + k: v for k, v in packed.items()})
    member = f"tensors/m{index}.safetensors" if tensors else None
    if member is not None:
        pending.tensor_files[member], _ = weights.pack(tensors, where)
    return {"name": proxy.name, "path": [[kind, key] for kind, key in found.path],
            "class": qualified_name(type(proxy.wrapped)), "parameters": weights.describe_tensors(own),
            "weights": member, "stores_weights": stores_weights, "aliases": aliases,
            "offloaded": state.offloaded, "graphs": graphs}


def save(obj: Any, path: str | os.PathLike[str], *, signing_key: Any = None) -> Path:
    """Save every tuned module in ``obj`` (a ``tt.Module``, a model holding some, or a pipeline) to ``path``.

    Writes ``path`` (a zip) and ``<stem>_sha256_sums.txt`` beside it. Both are written to temporary files in
    the same folder and renamed into place, so a failed save leaves the previous checkpoint intact (and the
    next save removes what a killed one left). Folders it creates are owner-only. Nothing is pickled and
    recorded inputs are not stored; the wrapped modules' own tensors are stored (as safetensors) when one of
    their chosen backends runs them. The manifest records which backends carry native code.

    Args:
        signing_key: sign the checkpoint (see :mod:`torch_tweak.torch.checkpoint.signing`): a ``bytes`` secret
            (HMAC-SHA256) or a ``cryptography`` Ed25519 private key. ``tt.load(..., verify_key=...)`` checks it.

    Returns:
        The checkpoint's path.

    Raises:
        CheckpointError: nothing is tuned, a backend's state cannot be stored, or writing failed.
    """
    start = time.perf_counter()
    if signing_key is not None:
        signing.sign(b"", signing_key)  # refuse a bad key before anything else
    target = _target(path)
    wrapped = find_wrapped(obj)
    tuned = [f for f in wrapped if f.proxy.state is ModuleState.TUNED]
    for f in wrapped:
        if f.proxy.state is not ModuleState.TUNED:
            logger.info("Not saving module %s: it is %s, not tuned (it will run its original code).",
                        f.proxy.name, f.proxy.state.name)
    if not tuned:
        raise CheckpointError(f"{type(obj).__name__} holds no tuned tt.Module ({len(wrapped)} wrapped, none tuned), so "
                              "there is nothing to save. Run tt.tune first.")
    pending = _Pending()
    modules = [_module_entry(pending, i, f, tuned) for i, f in enumerate(tuned)]
    manifest: dict[str, Any] = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "environment": environment(), "root": "module" if any(not f.path for f in tuned) else "object",
        "modules": modules,
    }
    remove_save_leftovers(target)
    try:
        writer = ArchiveWriter(target)
    except OSError as exc:
        raise CheckpointError(f"Could not write the checkpoint {target}: {exc.strerror or exc} (in {target.parent}). "
                              f"Check that the folder is writable.{no_space_hint(exc)}") from exc
    try:
        with tempfile.TemporaryDirectory(prefix=temporary_prefix(target), dir=target.parent) as staging:
            for member, tensors in pending.tensor_files.items():
                staged = Path(staging, member.replace("/", "_"))
                weights.write_safetensors(tensors, staged)
                writer.add_file(member, staged)
        for member, source in pending.artifacts.items():
            writer.add_file(member, source)
        manifest["files"] = {name: {"size": size, "sha256": sha} for name, (size, sha) in sorted(writer.files.items())}
        manifest_bytes = json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode("utf-8")
        writer.add_bytes(MANIFEST_NAME, manifest_bytes)
        if signing_key is not None:
            writer.add_bytes(signing.SIGNATURE_NAME, signing.sign(manifest_bytes, signing_key))
        writer.commit()
    except OSError as exc:
        writer.abort()
        raise CheckpointError(f"Could not write the checkpoint {target}: {exc.strerror or exc}. The previous "
                              f"checkpoint (if any) is unchanged.{no_space_hint(exc)}") from exc
    except BaseException:
        writer.abort()
        raise
    logger.info("Saved %d tuned module(s) to %s in %.2fs", len(modules), target, time.perf_counter() - start)
    return target
