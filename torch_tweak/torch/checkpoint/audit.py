"""What a verified checkpoint asks of the loading process, checked before anything is extracted or built.

The sums file proves that a checkpoint arrived intact, not who wrote it, so every manifest is read as if a
stranger crafted it. :func:`audit` resolves each stored backend class (never importing anything), refuses
artifact references that are not archive members and configs with settings that could run a program or
touch files, lists the archive members each module uses (a member nothing uses is refused: ``tt.save``
never writes one), and finds the modules whose artifacts are native code. :func:`check_trust` then applies
the caller's decision: native code loads only with ``trust_native_code=True`` or a verified signature.
``tt.load`` and ``torch-tweak verify`` both run these checks, so ``verify`` says OK only to what ``load``
would accept. Native artifacts a backend can do without (the Inductor and TorchAO warm-load packages) do not
make a checkpoint refused: without trust, :func:`drop_optional_native` removes them from the states before
anything is extracted, and those modules compile at load.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_tweak.errors import CheckpointError
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.checkpoint import signing
from torch_tweak.torch.checkpoint.archive import VerifiedArchive, member_name_problem
from torch_tweak.torch.checkpoint.codec import check_backend_state, is_native, native_references, referenced_members
from torch_tweak.torch.checkpoint.manifest import MANIFEST_NAME, CheckpointWarning, ModuleEntry


@dataclass
class Audit:
    """The result of :func:`audit`: per module, the backend classes of its graphs, the members it uses and
    whether it carries native code (``native``: required; ``optional_native``: warm-load packages it can do
    without); and whether the checkpoint is signed."""

    classes: dict[str, list[list[type[Backend]]]] = field(default_factory=dict)
    members: dict[str, set[str]] = field(default_factory=dict)
    native: list[str] = field(default_factory=list)
    optional_native: list[str] = field(default_factory=list)
    signed: bool = False


def audit(archive: VerifiedArchive, entries: list[ModuleEntry]) -> Audit:
    """Check what ``entries`` (the parsed manifest of ``archive``) refer to; raise CheckpointError."""
    result = Audit(signed=archive.signature is not None)
    names = archive.names
    used: set[str] = set()
    for entry in entries:
        members: set[str] = set()
        if entry.weights is not None:
            if entry.weights not in names or member_name_problem(entry.weights):
                raise CheckpointError(f"Module {entry.name!r}: tensor file {entry.weights!r} is not in the checkpoint.")
            members.add(entry.weights)
        graph_classes = []
        for graph in entry.graphs:
            where = f"Module {entry.name!r}, graph {graph.name!r}"
            graph_classes.append(check_backend_state(graph.backend_type, graph.backend_class, graph.state, where))
            members |= referenced_members(graph.state, names)
            if any(optional for _, _, optional in native_references(graph.backend_type, graph.backend_class,
                                                                      graph.state, where)):
                if entry.name not in result.optional_native:
                    result.optional_native.append(entry.name)
        result.classes[entry.name] = graph_classes
        result.members[entry.name] = members
        if any(g.native_code for g in entry.graphs) or any(is_native(c) for cs in graph_classes for c in cs):
            result.native.append(entry.name)
        used |= members
    unused = sorted(set(names) - used - {MANIFEST_NAME, signing.SIGNATURE_NAME})
    if unused:
        raise CheckpointError(f"Checkpoint {archive.path} holds member(s) that nothing in its manifest uses "
                              f"({unused[:5]}); tt.save never writes such members, so it was edited. Do not load it.")
    return result


def check_trust(result: Audit, archive: VerifiedArchive, path: Path, trust_native_code: bool, verify_key: Any) -> None:
    """Verify the signature when ``verify_key`` is given, and refuse native code the caller did not trust."""
    if verify_key is not None:
        signing.verify(archive.manifest_bytes, archive.signature, verify_key, f"Checkpoint {path}")
        return
    if result.native and not trust_native_code:
        raise CheckpointError(
            f"Checkpoint {path} carries native code (compiled machine code that runs as soon as it is loaded) for "
            f"module(s) {result.native}. torch_tweak cannot check what native code does, so it loads it only when "
            "you trust whoever made the file: pass tt.load(..., trust_native_code=True), or have them sign it "
            "(tt.save(..., signing_key=...)) and pass verify_key=. Otherwise ask for a checkpoint without "
            "TorchInductorAOTBackend modules."
        )


def drop_optional_native(result: Audit, entries: list[ModuleEntry], names: list[str], path: Path) -> None:
    """Without trust in native code: remove the optional native artifacts (warm-load packages) from the states of
    ``entries``, so they are neither extracted nor loaded and their modules compile at load; warn once."""
    if not result.optional_native:
        return
    for entry in entries:
        if entry.name not in result.optional_native:
            continue
        members = {entry.weights} if entry.weights is not None else set()
        for graph in entry.graphs:
            graph.state = copy.deepcopy(graph.state)
            for sub, key, optional in native_references(graph.backend_type, graph.backend_class, graph.state,
                                                        f"Module {entry.name!r}, graph {graph.name!r}"):
                if optional:
                    sub[key] = None
            members |= referenced_members(graph.state, names)
        result.members[entry.name] = members
    warnings.warn(
        f"Checkpoint {path} carries compiled code (warm-load packages) for module(s) {result.optional_native}, which "
        "is native code; it is not used because native code is not trusted, so those modules compile now and their "
        "first calls are slower. Pass tt.load(..., trust_native_code=True) (or verify_key=) to load them warm if you "
        "trust whoever made the file.", CheckpointWarning, stacklevel=3)
