"""Check a checkpoint without loading it (for ``torch-tweak verify`` and for scripts)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch_tweak.torch.checkpoint.archive import open_verified
from torch_tweak.torch.checkpoint.audit import audit, check_trust
from torch_tweak.torch.checkpoint.manifest import compare_environment, parse_modules, path_text


def verify(path: str | os.PathLike[str], *, verify_key: Any = None) -> dict[str, Any]:
    """Verify every member of the checkpoint at ``path``, audit its manifest as ``tt.load`` does, and summarize
    it; raise CheckpointError if it is bad. Native code is reported (``native_code``: required by the module;
    ``warm_native_code``: warm-load packages used only when trusted), not refused; with ``verify_key`` the
    signature must verify.

    Returns:
        ``{"path", "format_version", "created", "environment", "environment_changes", "signed", "native_code",
        "modules"}`` where each module is ``{"name", "path", "class", "graphs": [{"name", "backend"}]}``.
    """
    with open_verified(Path(path)) as archive:
        manifest = archive.manifest
        modules = parse_modules(manifest)
        checked = audit(archive, modules)
        check_trust(checked, archive, Path(path), True, verify_key)
    diff = compare_environment(manifest.get("environment"))
    return {
        "path": str(path),
        "format_version": manifest["format_version"],
        "created": manifest.get("created"),
        "environment": manifest.get("environment"),
        "environment_changes": {"missing_cpu_flags": diff.missing_flags,
                                "versions": {k: list(v) for k, v in diff.versions.items()}},
        "signed": checked.signed,
        "native_code": checked.native,
        "warm_native_code": checked.optional_native,
        "modules": [{"name": m.name, "path": path_text(m.path), "class": m.class_name,
                     "graphs": [{"name": g.name, "backend": g.backend_type} for g in m.graphs]} for m in modules],
    }
