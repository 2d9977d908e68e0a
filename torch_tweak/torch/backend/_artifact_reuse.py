"""Converted files reused when nothing they depend on changed (OpenVINO IR, ONNX models).

Why: a candidate measured in a worker process is built again in the tuning process when it is chosen, and a
tuning run builds what an earlier run built; converting again costs seconds to minutes. A build folder keeps
``fingerprint.json`` beside its files: a SHA-256 over the graph spec, the backend config, the module class,
the library versions and the weights (:func:`~torch_tweak.torch.module.digest.weights_digest`). A build whose
fingerprint matches uses the files; any difference, a missing or unreadable fingerprint converts again. The
files are data (an IR, an ONNX graph) read by their runtime; nothing here is unpickled or imported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from torch_tweak.torch.module.digest import weights_digest
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.utils.permissions import secure_file, secure_mkdir

logger = logging.getLogger(__name__)

FINGERPRINT_NAME = "fingerprint.json"


def fingerprint(module: nn.Module, graph_spec: GraphSpec, config: dict[str, Any], versions: dict[str, str]) -> str | None:
    """A hash of everything a converted file depends on; None if it cannot be computed (no reuse then)."""
    digest = hashlib.sha256()
    try:
        head = {"graph": graph_spec.to_dict(), "config": config, "versions": versions,
                "module": f"{type(module).__module__}.{type(module).__qualname__}"}
        digest.update(json.dumps(head, sort_keys=True, default=str).encode())
    except Exception as exc:  # noqa: BLE001 - an undescribable graph only disables reuse
        logger.debug("No fingerprint for graph %s: %s", graph_spec.name, exc)
        return None
    weights = weights_digest(module)
    if weights is None:
        return None
    digest.update(weights.encode())
    return digest.hexdigest()


def matches(folder: Path, fp: str | None) -> bool:
    """Whether ``folder`` holds files saved with fingerprint ``fp``."""
    if fp is None:
        return False
    try:
        return json.loads((folder / FINGERPRINT_NAME).read_text(encoding="utf-8")).get("fingerprint") == fp
    except (OSError, ValueError, AttributeError):
        return False


def record(folder: Path, fp: str | None) -> None:
    """Mark the files now in ``folder`` as built with fingerprint ``fp`` (write them first)."""
    if fp is None:
        return
    path = folder / FINGERPRINT_NAME
    path.write_text(json.dumps({"fingerprint": fp}), encoding="utf-8")
    secure_file(path)


def forget(folder: Path) -> None:
    """Remove ``folder``'s fingerprint (before its files change)."""
    (folder / FINGERPRINT_NAME).unlink(missing_ok=True)


def copy_files(source: Path, target: Path, names: Iterable[str]) -> bool:
    """Copy the files ``names`` of ``source`` (another candidate's build folder) into ``target``, each written as a
    partial file first and moved into place; False, with no partial file left, if one cannot be copied. The caller
    checks the fingerprint of ``source`` and records its own after.

    A file is hard-linked where the file system allows (a BERT-base IR is 440 MB): no copy on disk, and ``tt.save``
    sees the two candidates' files as one. That is safe because nothing writes into a built file: every build
    writes new files and moves them into place, and the cache limit deletes a folder's names, not the other's."""
    partials = []
    try:
        secure_mkdir(target)
        for name in names:
            partial = target / f"{name}.partial"
            partials.append(partial)
            partial.unlink(missing_ok=True)
            try:
                os.link(source / name, partial)
            except OSError:
                shutil.copyfile(source / name, partial)
            secure_file(partial)
            os.replace(partial, target / name)
    except OSError as exc:
        logger.debug("Could not copy %s from %s to %s: %s", ", ".join(names), source, target, exc)
        for partial in partials:
            partial.unlink(missing_ok=True)
        return False
    return True
