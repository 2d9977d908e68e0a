"""TuningReport: what ``tt.tune`` tried and chose, per module, graph and candidate."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch_tweak.errors import ConfigError
from torch_tweak.utils.permissions import open_secure
from torch_tweak.utils.table import format_table

SCHEMA_VERSION = 1

# Candidate statuses
CHOSEN = "chosen"
PASSED = "passed"
BUILD_FAILED = "build_failed"
INFER_FAILED = "infer_failed"
REJECTED = "rejected"
TIMEOUT = "timeout"


@dataclass
class CandidateReport:
    """One backend tried for one graph.

    Attributes:
        backend: the backend's ``describe()``.
        key: the backend's ``key()`` (also the name of its cache folder).
        status: ``chosen``, ``passed``, ``build_failed``, ``infer_failed``, ``rejected`` (fidelity) or ``timeout``.
        precision: the precision the candidate executed (``fp32``, ``bf16``, ``int8``...).
        build_time_s: seconds spent in ``build``.
        fidelity: the fidelity result (``FidelityResult.to_dict()``), when checked.
        error: ``"ExceptionType: message"`` when the candidate failed.
        log_path: the candidate's build log.
        measurements: profiling results, when the strategy measured the candidate.
        role: ``candidate`` or ``baseline`` (eager measured for comparison).
    """

    backend: str
    key: str
    status: str = "pending"
    precision: str | None = None
    build_time_s: float | None = None
    fidelity: dict[str, Any] | None = None
    error: str | None = None
    log_path: str | None = None
    measurements: dict[str, Any] | None = None
    role: str = "candidate"


@dataclass
class GraphReport:
    """The candidates of one graph and the choice made.

    ``batch_search`` holds the max-batch-size search on eager (when the strategy ran it): the batch sizes
    tried with their measurements, the size found and whether the graph's max shapes were extended.
    """

    name: str
    strategy: str = ""
    spec: dict[str, Any] | None = None
    candidates: list[CandidateReport] = field(default_factory=list)
    chosen: str | None = None
    reason: str | None = None
    batch_search: dict[str, Any] | None = None


@dataclass
class ModuleReport:
    """One wrapped module: ``tuned``, ``passthrough`` (tuning failed, original code runs) or ``dry_run``."""

    name: str
    status: str = "pending"
    error: str | None = None
    graphs: list[GraphReport] = field(default_factory=list)


@dataclass
class TuningReport:
    """Returned by ``tt.tune``; prints as a table and serializes to JSON."""

    modules: list[ModuleReport] = field(default_factory=list)
    device: str = "cpu"
    batch_sizes: list[int] = field(default_factory=list)
    dry_run: bool = False
    duration_s: float = 0.0
    environment: dict[str, Any] = field(default_factory=dict)

    def module(self, name: str) -> ModuleReport:
        """The report of the module called ``name``."""
        for module in self.modules:
            if module.name == name:
                return module
        raise KeyError(f"No module named {name!r} in this report; modules: {[m.name for m in self.modules]}")

    def rows(self) -> list[list[Any]]:
        """One row per candidate: module, graph, candidate, status, precision, fidelity, build time, error."""
        rows: list[list[Any]] = []
        for module in self.modules:
            if not module.graphs:
                rows.append([module.name, "", "", module.status, "", "", "", module.error or ""])
            for graph in module.graphs:
                if not graph.candidates:
                    rows.append([module.name, graph.name, "", module.status, "", "", "", module.error or ""])
                for cand in graph.candidates:
                    fid = cand.fidelity or {}
                    fidelity = f"{fid.get('max_abs_error', 0):.2e}" if fid else ""
                    build = f"{cand.build_time_s:.2f}s" if cand.build_time_s is not None else ""
                    rows.append([module.name, graph.name, cand.backend, cand.status, cand.precision or "",
                                 fidelity, build, _short(cand.error)])
        return rows

    def __str__(self) -> str:
        headers = ["module", "graph", "candidate", "status", "precision", "max abs err", "build", "error"]
        title = f"Tuning report ({'dry run, ' if self.dry_run else ''}device {self.device}, {self.duration_s:.1f}s)"
        return format_table(headers, self.rows(), title=title)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form with a schema version."""
        data = asdict(self)
        data["schema_version"] = SCHEMA_VERSION
        return data

    def to_json(self, path: str | Path | None = None) -> str:
        """Return the JSON text, and write it to ``path`` (owner-only) when given."""
        text = json.dumps(self.to_dict(), indent=2, default=str)
        if path is not None:
            with open_secure(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuningReport:
        """Inverse of :meth:`to_dict`; refuses reports with a newer schema."""
        version = data.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ConfigError(
                f"Report schema version {version!r} is not supported (this torch_tweak reads up to {SCHEMA_VERSION}); "
                "upgrade torch_tweak to read it."
            )
        modules = []
        for m in data.get("modules", []):
            graphs = [
                GraphReport(**{**g, "candidates": [CandidateReport(**c) for c in g.get("candidates", [])]})
                for g in m.get("graphs", [])
            ]
            modules.append(ModuleReport(**{**m, "graphs": graphs}))
        fields = {k: v for k, v in data.items() if k not in ("modules", "schema_version")}
        return cls(modules=modules, **fields)


def _short(text: str | None, limit: int = 80) -> str:
    if not text:
        return ""
    line = text.splitlines()[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."
