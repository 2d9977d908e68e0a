"""Reusing tuning results: a candidate already built, checked and measured is not built again.

Tuning the same model again (under any module name), or again after a run was interrupted (Ctrl-C,
``kill -9``), reads what each candidate produced from ``<cache>/results/<key>.json``, written atomically as
soon as the candidate finished. The key is a SHA-256 over everything the result depends on: the module's weights
(:func:`~torch_tweak.torch.module.digest.weights_digest`), the graph spec, the backend's ``key()``, the
strategy's settings (class, profiling, fidelity, batch sizes, role) and the environment (CPU model and ISA
flags, torch and torch_tweak versions, the versions of the packages the backend needs). A changed weight,
library or CPU therefore misses exactly the affected entries; stale files are never read again and go
with ``tt.tune(clear_cache=True)`` or ``torch-tweak cache clear``.

Only outcomes that a rerun would reproduce are kept (passed, rejected, failed to build or to run); a
timeout or a skipped candidate is tried again. A reused candidate that the strategy chooses is built again
(OpenVINO and ONNX Runtime reuse their converted files; compilers their own caches) and checked again on
the current samples before it serves. A stored file is JSON parsed into plain values; a malformed one is
a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, fields
from typing import Any

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.registry import required_packages
from torch_tweak.torch.cache import cache_folder
from torch_tweak.torch.cache_limit import touch
from torch_tweak.torch.environment import core_versions, cpu_info, distribution_versions, isa_flags
from torch_tweak.torch.module.digest import weights_digest
from torch_tweak.torch.profiling import SweepResult
from torch_tweak.torch.report.report import CandidateReport
from torch_tweak.torch.report.status import CandidateStatus

logger = logging.getLogger(__name__)

FORMAT = 1
REUSABLE = {CandidateStatus.PASSED, CandidateStatus.REJECTED, CandidateStatus.BUILD_FAILED,
            CandidateStatus.INFER_FAILED}


class ResultCache:
    """The stored results of one graph's candidates (see the module docstring)."""

    def __init__(self, module: Any, graph_spec: Any, settings: dict[str, Any]) -> None:
        self.folder = cache_folder("results")
        weights = weights_digest(module)
        self._base: dict[str, Any] | None = None if weights is None else {
            "format": FORMAT, "weights": weights, "graph": graph_spec.to_dict(), "settings": settings,
            "cpu": cpu_info().model, "isa": isa_flags(), "versions": core_versions(),
        }

    def key(self, template: Backend, role: str) -> str | None:
        """The result key of ``template`` in ``role``; None when the weights cannot be hashed."""
        if self._base is None:
            return None
        packages = distribution_versions(required_packages(type(template).__name__))
        doc = {**self._base, "backend": template.key(), "role": role, "packages": packages}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()

    def load(self, key: str | None) -> tuple[CandidateReport, SweepResult | None] | None:
        """The stored row and sweep for ``key``, or None (missing, unreadable or malformed)."""
        if key is None:
            return None
        path = self.folder / f"{key}.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            row = _row(doc["row"])
            sweep = SweepResult.from_dict(doc["sweep"]) if doc["sweep"] is not None else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("Ignoring the stored tuning result %s (%s); the candidate is tried again.", path, exc)
            return None
        if row.status not in REUSABLE:
            return None
        touch(path)
        return row, sweep

    def store(self, key: str | None, row: CandidateReport, sweep: SweepResult | None) -> None:
        """Write the row (status ``passed`` for a candidate that qualified) and its sweep, atomically."""
        if key is None or row.status not in REUSABLE:
            return
        doc = {"format": FORMAT, "row": asdict(row), "sweep": sweep.to_dict() if sweep is not None else None}
        try:
            handle, temporary = tempfile.mkstemp(dir=self.folder, prefix=".result-", suffix=".tmp")
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(doc, out, default=str)
            os.replace(temporary, self.folder / f"{key}.json")
        except OSError as exc:
            logger.warning("Could not store the tuning result of %s in %s: %s", row.backend, self.folder, exc)


def _row(data: Any) -> CandidateReport:
    if not isinstance(data, dict):
        raise ValueError("the row is not an object")
    known = {f.name for f in fields(CandidateReport)}
    row = CandidateReport(**{k: v for k, v in data.items() if k in known})
    if not isinstance(row.backend, str) or not isinstance(row.key, str):
        raise ValueError("the row has no backend name or key")
    row.status = CandidateStatus(row.status)
    return row
