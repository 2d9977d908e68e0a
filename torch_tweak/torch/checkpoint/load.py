"""``tt.load``: restore tuned modules from a checkpoint into a model or pipeline, without tuning again.

Loading runs in two phases. The first changes nothing: it verifies the archive, audits what the manifest
asks for (:mod:`.audit`: backend classes, artifact references, inert settings, native code, signature),
checks that every stored module is found at its path with the same class and tensors, extracts the members
the modules use into a private folder and recreates the backends with ``from_dict``. The second wraps
the modules, puts stored tensors in place and deploys the backends; every change is journaled, and if
anything fails the journal is undone so the caller's model is left as it was.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import CheckpointError, ConfigError
from torch_tweak.torch._device import get_device
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.cache import cache_folder
from torch_tweak.torch.cache_limit import enforce_size_limit
from torch_tweak.torch.checkpoint import weights
from torch_tweak.torch.checkpoint.archive import VerifiedArchive, member_name_problem, open_verified
from torch_tweak.torch.checkpoint.audit import Audit, audit, check_trust, drop_optional_native
from torch_tweak.torch.checkpoint.codec import decode_state, route_types
from torch_tweak.torch.checkpoint.locate import resolve
from torch_tweak.torch.checkpoint.manifest import (
    EnvironmentDiff,
    ModuleEntry,
    compare_environment,
    parse_modules,
    path_text,
    warn_environment,
)
from torch_tweak.torch.config import config
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.state import TunedGraph, internals
from torch_tweak.torch.module.tree import qualified_name
from torch_tweak.torch.module.walk import Slot, nested_prefixes, place
from torch_tweak.torch.module.wrapper import Module, hand_over_name, proxy_of, release
from torch_tweak.utils.leftovers import owner_tag, remove_leftovers
from torch_tweak.utils.validate import check_bool

logger = logging.getLogger(__name__)


class _Extracted:
    """Owns the folder a checkpoint was extracted to; the folder is deleted when no loaded module uses it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(path), True)

    def delete(self) -> None:
        """Delete the folder now."""
        self._finalizer()


@dataclass
class _Plan:
    """Everything needed to restore one module, prepared without changing the caller's objects."""

    entry: ModuleEntry
    slot: Slot
    inner: nn.Module
    proxy: Module | None
    nested: list[str]
    device: torch.device | None
    env_differs: bool
    classes: list[type[Backend]] = field(default_factory=list)
    old_backends: list[Backend] = field(default_factory=list)
    fallback: str | None = None
    weights: dict[str, torch.Tensor] | None = None
    specs: list[GraphSpec] = field(default_factory=list)
    keys: list[tuple[Any, ...]] = field(default_factory=list)
    backends: list[Backend] = field(default_factory=list)


def _device_map(device_map: Any, names: list[str]) -> dict[str, torch.device]:
    if device_map is None:
        return {}
    if not isinstance(device_map, dict):
        raise CheckpointError(f"device_map must be a dict {{module name: device}}, got {type(device_map).__name__}.")
    unknown = sorted(str(k) for k in device_map if k not in names and k != "")
    if unknown:
        raise CheckpointError(f"device_map names module(s) {unknown} that the checkpoint does not have; its modules "
                              f"are {names} (the key \"\" stands for all of them).")
    result = {}
    whole = dict.fromkeys(names, device_map[""]) if "" in device_map else {}  # "": the whole object
    for name, device in {**whole, **{k: v for k, v in device_map.items() if k != ""}}.items():
        try:
            result[name] = get_device(device)
        except ConfigError as exc:
            raise CheckpointError(f"device_map[{name!r}]: {exc}") from exc
    return result


def _plan(obj: Any, entry: ModuleEntry, entries: list[ModuleEntry], devices: dict[str, torch.device],
          diff: EnvironmentDiff, checked: Audit) -> _Plan:
    slot = resolve(obj, entry.path, entry.name)
    where = path_text(entry.path)
    proxy = proxy_of(slot.value)
    inner = proxy.wrapped if proxy is not None else slot.value
    if proxy is not None and proxy.name != entry.name:
        raise CheckpointError(f"The module at {where} is wrapped as {proxy.name!r}, but the checkpoint stores it as "
                              f"{entry.name!r}. Wrap it with name={entry.name!r}, or leave it unwrapped before tt.load.")
    if type(inner).__qualname__ != entry.class_name.rpartition(":")[2]:  # the module may differ (__main__ vs import)
        raise CheckpointError(f"The module at {where} is a {qualified_name(type(inner))}, but the checkpoint stores "
                              f"a {entry.class_name} there ({entry.name!r}). Load into the model that was saved.")
    nested = nested_prefixes(entry.path, [e.path for e in entries])
    weights.check_matches(inner, nested, entry.parameters, entry.name, where)
    types = [t for g in entry.graphs for t in route_types(g.backend_type, g.state)]
    plan = _Plan(entry, slot, inner, proxy, nested, devices.get(entry.name),
                 bool(diff.missing_flags or diff.relevant_to(types)))
    plan.classes = [classes[0] for classes in checked.classes[entry.name]]
    plan.old_backends = internals(proxy).backends() if proxy is not None else []
    if diff.missing_flags and entry.name in checked.native:
        plan.fallback = (f"its compiled code may use {', '.join(diff.missing_flags)}, which this CPU lacks")
    return plan


def _prepare(plan: _Plan, archive: VerifiedArchive, root: Path) -> None:
    """Load tensors, decode states and recreate the backends (CHECKPOINT_LOADED); nothing is deployed yet."""
    entry = plan.entry
    loaded: dict[str, torch.Tensor] = {}
    if entry.weights is not None:  # present and named safely: checked by the audit
        loaded = weights.read_safetensors(root / entry.weights, entry.weights)
    if entry.stores_weights:
        plan.weights = weights.module_weights(loaded, entry.aliases, [n for n, _, _ in entry.parameters], entry.name)
        weights.check_loaded(plan.weights, entry.parameters, entry.name)
    covered = set(plan.weights or ())
    on_meta = weights.meta_tensors(plan.inner, plan.nested, covered)
    if on_meta and (plan.fallback is not None or any(c.requires_original_module for c in plan.classes)):
        raise CheckpointError(f"Module {entry.name!r} has tensors without data ({on_meta[:3]}: on the meta device or "
                              "released after tuning) that the checkpoint does not hold; build the model with its "
                              "real weights before tt.load.")
    if plan.fallback is not None:
        return

    def artifact(marker: dict[str, Any], where: str) -> Path:
        member, kind = marker.get("member"), marker.get("kind")
        if not isinstance(member, str) or member_name_problem(member) or kind not in ("file", "dir"):
            raise CheckpointError(f"The manifest's {where} is a malformed artifact reference.")
        target = root.joinpath(*member.split("/"))
        present = target.is_file() if kind == "file" else target.is_dir()
        if not present:
            raise CheckpointError(f"The manifest's {where} refers to {member!r}, which is not in the checkpoint.")
        return target

    def tensor(marker: dict[str, Any], where: str) -> torch.Tensor:
        key = marker.get("key")
        if not isinstance(key, str) or not key.startswith(weights.BACKEND_PREFIX) or key not in loaded:
            raise CheckpointError(f"The manifest's {where} refers to a tensor the checkpoint does not hold.")
        return loaded[key]

    for graph, cls in zip(entry.graphs, plan.classes):
        where = f"Module {entry.name!r}, graph {graph.name!r}"
        if "graph_spec" in graph.state and graph.state["graph_spec"] != graph.graph_spec:
            raise CheckpointError(f"{where}: the backend's graph spec differs from the manifest's; the checkpoint is "
                                  "corrupt.")
        try:
            state = decode_state(graph.state, f"{where} backend state", artifact, tensor)
            spec = GraphSpec.from_dict(graph.graph_spec)  # structures checked against the type policy (tree_json)
            key = spec.key()
            backend = cls.from_dict(plan.inner, state)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{where}: cannot restore the {graph.backend_type} ({type(exc).__name__}: {exc}). "
                                  "Types named in the graph must be imported before tt.load, and container "
                                  "classes other than namedtuples, dataclasses and Hugging Face outputs registered "
                                  "with tt.register_type.") from exc
        if key in plan.keys:
            raise CheckpointError(f"{where}: two graphs of this module have the same inputs; the checkpoint is corrupt.")
        plan.specs.append(spec)
        plan.keys.append(key)
        plan.backends.append(backend)


def _restore(plan: _Plan, holder: _Extracted, journal: list[Callable[[], None]]) -> Module:
    entry = plan.entry
    proxy = plan.proxy
    if proxy is None:
        journal.append(hand_over_name(entry.name))  # a live module of that name (the one tuned) keeps working
        try:
            proxy = Module(plan.inner, name=entry.name)
        except ConfigError as exc:
            raise CheckpointError(f"Cannot wrap the module at {path_text(entry.path)}: {exc}") from exc
        created = proxy
        journal.append(lambda: release(created))
        undo = place(plan.slot, proxy)
        if undo is not None:
            journal.append(lambda: Slot.undo(undo))
    else:
        journal.append(internals(proxy).snapshot())
    if plan.weights is not None:
        previous = weights.assign(plan.inner, plan.weights)
        journal.append(lambda: weights.restore(plan.inner, previous))
    if plan.fallback is None:
        try:
            for backend in plan.backends:
                backend.deploy(plan.device)
        except Exception as exc:
            if not plan.env_differs:
                raise CheckpointError(f"Module {entry.name!r}: deploying its backends failed ({type(exc).__name__}: "
                                      f"{exc}).") from exc
            plan.fallback = f"its backend could not be deployed here ({type(exc).__name__}: {exc})"
    state = internals(proxy)
    if plan.fallback is not None:
        logger.warning("Module %s runs its original code: %s.", entry.name, plan.fallback)
        state.mark_passthrough(plan.fallback)
    else:
        state.mark_tuned([TunedGraph(*g) for g in zip(plan.specs, plan.keys, plan.backends)], checkpoint=holder)
    state.reset_after_load()
    return proxy


_LOAD_FOLDER = re.compile(r"load_(?P<tag>\d+x\d+)_[^/]+")


def _workdir(path: Path) -> Path:
    """A new private folder to extract into (``<cache>/checkpoints/load_<owner tag>_*``); folders of loads whose
    process was killed are removed first."""
    try:
        parent = cache_folder("checkpoints")
        remove_leftovers(parent, _LOAD_FOLDER)
        return Path(tempfile.mkdtemp(prefix=f"load_{owner_tag()}_", dir=parent))
    except (ConfigError, OSError) as exc:
        raise CheckpointError(f"Cannot create a folder to extract {path} into under {config.cache_dir} "
                              f"({getattr(exc, 'strerror', None) or exc}); point tt.config.cache_dir (TORCH_TWEAK_CACHE_DIR) at a "
                              "writable folder.") from exc


def load(obj: Any, path: str | os.PathLike[str], device_map: dict[str, Any] | None = None, *,
         trust_native_code: bool = False, verify_key: Any = None) -> Any:
    """Restore the tuned modules saved by ``tt.save`` into ``obj`` (the same model or pipeline, built fresh).

    Every member of the checkpoint is verified against its manifest and sums file, and the manifest is
    audited as if a stranger wrote it, before anything is used (see ``docs/security.md``). Modules found at
    their stored paths are wrapped (if they are not already) and their backends deployed without tuning
    again; ``device_map`` ({module name: device}; the key ``""`` means every module) overrides the stored
    device per module. A live module with a stored name (the one that was tuned, say) keeps working, and the
    loaded one takes the name.

    Args:
        trust_native_code: allow artifacts that are native code (AOTInductor packages run their compiled
            code as soon as they are loaded). Off by default: such a checkpoint is refused, naming the modules.
        verify_key: require a valid signature made with ``tt.save(..., signing_key=...)``: the HMAC secret
            (``bytes``) or the Ed25519 public key. A verified checkpoint may carry native code.

    Returns:
        ``obj``, or the root ``tt.Module`` when the saved object was itself a tuned ``tt.Module``.

    Raises:
        CheckpointError: the checkpoint is missing, tampered with, or does not match ``obj``; ``obj`` is unchanged.
    """
    start, started_at = time.perf_counter(), time.time()
    path = Path(path)
    check_bool(trust_native_code, "trust_native_code")
    with open_verified(path) as archive:
        entries = parse_modules(archive.manifest)
        checked = audit(archive, entries)
        check_trust(checked, archive, path, trust_native_code, verify_key)
        if not trust_native_code and verify_key is None:  # warm-load packages stay in the archive: modules compile
            drop_optional_native(checked, entries, archive.names, path)
        devices = _device_map(device_map, [e.name for e in entries])
        diff = compare_environment(archive.manifest.get("environment"))
        plans = [_plan(obj, e, entries, devices, diff, checked) for e in entries]
        targets = [id(p.inner) for p in plans]
        if len(set(targets)) != len(targets):
            raise CheckpointError(f"Checkpoint {path} maps two modules to the same object; it is corrupt.")
        warn_environment(diff, path, sorted({t for e in entries for g in e.graphs for t in route_types(g.backend_type, g.state)}))
        holder = _Extracted(_workdir(path))
        try:
            archive.extract(holder.path, {m for p in plans if p.fallback is None for m in checked.members[p.entry.name]}
                            | {p.entry.weights for p in plans if p.entry.weights is not None})
        except BaseException:
            holder.delete()
            raise
    journal: list[Callable[[], None]] = []
    try:
        for plan in plans:
            _prepare(plan, archive, holder.path)
        proxies = [_restore(plan, holder, journal) for plan in plans]
    except BaseException as exc:
        for undo in reversed(journal):
            undo()
        holder.delete()
        if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            raise
        raise CheckpointError(f"Loading {path} failed ({type(exc).__name__}: {exc}); the model is unchanged.") from exc
    for plan, proxy in zip(plans, proxies):
        if plan.fallback is None:
            internals(proxy).offload_weights(config.device_after_tuning)
        for backend in plan.old_backends:  # release what the module ran before (built in this process)
            if backend not in plan.backends:
                backend.release()
    enforce_size_limit(keep_since=started_at)  # what deploying wrote (OpenVINO's compiled models) stays
    logger.info("Loaded %d module(s) from %s in %.2fs", len(plans), path, time.perf_counter() - start)
    root = next((proxy for plan, proxy in zip(plans, proxies) if not plan.entry.path), None)
    return root if root is not None else obj
