"""TuningReport: what ``tt.tune`` tried and chose, per module, graph and candidate."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from torch_tweak.errors import ConfigError
from torch_tweak.torch.report.metrics import (
    format_fidelity,
    format_ms,
    format_speedup,
    format_throughput,
    graph_metrics,
)
from torch_tweak.torch.report.status import CandidateStatus, ModuleStatus
from torch_tweak.utils.permissions import open_secure
from torch_tweak.utils.table import format_table

# 2: structured environment block and creation time.
SCHEMA_VERSION = 2



CHOSEN, PASSED, REJECTED = CandidateStatus.CHOSEN, CandidateStatus.PASSED, CandidateStatus.REJECTED
BUILD_FAILED, INFER_FAILED, TIMEOUT = CandidateStatus.BUILD_FAILED, CandidateStatus.INFER_FAILED, CandidateStatus.TIMEOUT
CRASHED = CandidateStatus.CRASHED

TABLE_HEADERS = ["module", "graph", "candidate", "status", "precision", "max abs err", "throughput", "p50 ms",
                 "p99 ms", "vs eager", "chosen"]


@dataclass
class CandidateReport:
    """One backend tried for one graph.

    Attributes:
        backend: the backend's ``describe()``.
        key: the backend's ``key()`` (also the name of its cache folder).
        status: ``chosen``, ``passed``, ``build_failed``, ``infer_failed``, ``rejected`` (fidelity), ``timeout``,
            ``crashed`` (its worker process died), ``screened_out`` or ``skipped``.
        precision: the precision the candidate executed (``fp32``, ``bf16``, ``int8``...).
        build_time_s: seconds spent in ``build``.
        fidelity: the fidelity result (``FidelityResult.to_dict()``), when checked.
        error: ``"ExceptionType: message"`` when the candidate failed.
        log_path: the candidate's build log.
        measurements: profiling results, when the strategy measured the candidate.
        role: ``candidate`` or ``baseline`` (eager measured for comparison).
        reused: the check and the measurements come from an earlier run (the tuning-result cache).
        worker: where the candidate was built and measured (``"pid 123 on host"``, a Ray node), when an
            executor ran it outside the tuning process.
    """

    backend: str
    key: str
    status: str = CandidateStatus.PENDING
    precision: str | None = None
    build_time_s: float | None = None
    fidelity: dict[str, Any] | None = None
    error: str | None = None
    log_path: str | None = None
    measurements: dict[str, Any] | None = None
    role: str = "candidate"
    reused: bool = False
    worker: str | None = None

    @property
    def selection(self) -> dict[str, Any] | None:
        """The measurement the strategy judged this candidate by (batch size, throughput, p50/p99), if any."""
        return (self.measurements or {}).get("selection")

    def _selected(self, key: str) -> Any:
        return (self.selection or {}).get(key)

    @property
    def batch_size(self) -> int | None:
        """The batch size of :attr:`selection`."""
        return self._selected("batch_size")

    @property
    def throughput(self) -> float | None:
        """Samples per second at :attr:`batch_size`."""
        return self._selected("throughput")

    @property
    def p50_ms(self) -> float | None:
        """Median latency per call at :attr:`batch_size`."""
        return self._selected("p50_ms")

    @property
    def p99_ms(self) -> float | None:
        """99th percentile latency per call at :attr:`batch_size`."""
        return self._selected("p99_ms")

    @property
    def stable(self) -> bool | None:
        """Whether the measurement at :attr:`batch_size` met the stop rule's stability criterion."""
        return self._selected("stable")


@dataclass
class GraphReport:
    """The candidates of one graph and the choice made.

    ``batch_search`` holds the max-batch-size search on eager (when the strategy ran it): the batch sizes
    tried with their measurements, the size found and whether the graph's max shapes were extended.
    ``executor`` says where its candidates ran (``tt.tune(executor=...)``), and why not there if the executor
    could not take the graph.
    """

    name: str
    strategy: str = ""
    spec: dict[str, Any] | None = None
    candidates: list[CandidateReport] = field(default_factory=list)
    chosen: str | None = None
    reason: str | None = None
    batch_search: dict[str, Any] | None = None
    executor: str | None = None


@dataclass
class ModuleReport:
    """One wrapped module: ``tuned``, ``passthrough`` (tuning failed, original code runs) or ``dry_run``."""

    name: str
    status: str = ModuleStatus.PENDING
    error: str | None = None
    graphs: list[GraphReport] = field(default_factory=list)


@dataclass
class TuningReport:
    """Returned by ``tt.tune``; prints as a table, serializes to JSON and renders to HTML.

    ``environment`` describes the machine and libraries (:mod:`.environment`); ``created`` is the UTC time the
    tune finished (ISO 8601). ``tt.tune`` also writes every report to ``<cache_dir>/reports/``.
    """

    modules: list[ModuleReport] = field(default_factory=list)
    device: str = "cpu"
    batch_sizes: list[int] = field(default_factory=list)
    dry_run: bool = False
    duration_s: float = 0.0
    environment: dict[str, Any] = field(default_factory=dict)
    created: str | None = None

    def module(self, name: str) -> ModuleReport:
        """The report of the module called ``name``."""
        for module in self.modules:
            if module.name == name:
                return module
        raise KeyError(f"No module named {name!r} in this report; modules: {[m.name for m in self.modules]}")

    def rows(self) -> list[list[Any]]:
        """One row per candidate, under :data:`TABLE_HEADERS` (modules or graphs without candidates get one row)."""
        return [row for row, _ in self._rows_and_notes()]

    def _rows_and_notes(self) -> list[tuple[list[Any], str | None]]:
        rows: list[tuple[list[Any], str | None]] = []
        blank = [""] * (len(TABLE_HEADERS) - 4)
        for module in self.modules:
            if not module.graphs:
                rows.append(([module.name, "", "", module.status, *blank], module.error))
            for graph in module.graphs:
                if not graph.candidates:
                    rows.append(([module.name, graph.name, "", module.status, *blank], module.error))
                for cand, m in zip(graph.candidates, graph_metrics(graph)):
                    name = f"{cand.backend} (baseline)" if cand.role == "baseline" else cand.backend
                    name += " (reused)" if cand.reused else ""
                    rows.append(([module.name, graph.name, name, cand.status, cand.precision or "",
                                  format_fidelity(cand), format_throughput(m), format_ms(m.p50_ms),
                                  format_ms(m.p99_ms), format_speedup(m.speedup),
                                  "*" if cand.status == CHOSEN else ""], cand.error))
        return rows

    def __str__(self) -> str:
        kind = "dry run, " if self.dry_run else ""
        title = f"Tuning report ({kind}device {self.device}, batch sizes {self.batch_sizes}, {self.duration_s:.1f}s)"
        rows, notes = [], []
        for row, error in self._rows_and_notes():
            if error:
                notes.append(f"  [{len(notes) + 1}] {row[0]}/{row[1] or '-'} {row[2] or row[3]}: {_short(error, 160)}")
                row = [*row[:3], f"{row[3]} [{len(notes)}]", *row[4:]]
            rows.append(row)
        text = format_table(TABLE_HEADERS, rows, title=title)
        if notes:
            text += "\nNotes:\n" + "\n".join(notes)
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form with a schema version (the environment block is part of it)."""
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
        """Inverse of :meth:`to_dict`; refuses what is not a report or has a newer schema (:class:`ConfigError`)."""
        if not isinstance(data, dict) or "schema_version" not in data or not isinstance(data.get("modules"), list):
            raise ConfigError("This is not a torch_tweak tuning report: it has no schema_version or no modules list.")
        version = data.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ConfigError(
                f"Report schema version {version!r} is not supported (this torch_tweak reads up to {SCHEMA_VERSION}); "
                "upgrade torch_tweak to read it."
            )
        try:
            modules = []
            for m in data["modules"]:
                graphs = [_build(GraphReport, g, candidates=[_build(CandidateReport, c) for c in g.get("candidates", [])])
                          for g in m.get("graphs", [])]
                modules.append(_build(ModuleReport, m, graphs=graphs))
            report = _build(cls, data, modules=modules)
        except (TypeError, AttributeError, KeyError) as exc:
            raise ConfigError(f"This is not a well-formed torch_tweak tuning report: {exc}.") from exc
        if not isinstance(report.environment, dict):
            report.environment = {}
        return report

    @classmethod
    def load(cls, path: str | Path) -> TuningReport:
        """Read a report written by :meth:`to_json` (raises :class:`ConfigError` for anything else)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"Cannot read report {path}: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not a torch_tweak tuning report: it is not JSON ({exc}).") from exc
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    def to_html(self, full_page: bool = True) -> str:
        """The HTML report (plots inline, no network fetches); needs matplotlib."""
        from torch_tweak.torch.report.html import render_html

        return render_html(self, full_page=full_page)

    def save_html(self, path: str | Path) -> Path:
        """Write the report as ONE self-contained HTML file (summary, per-module sections, plots)."""
        path = Path(path)
        with open_secure(path, "w") as f:
            f.write(self.to_html())
        return path

    def _repr_html_(self) -> str:
        """Rich display in notebooks."""
        return self.to_html(full_page=False)


def _build(kind: type, data: dict[str, Any], **overrides: Any) -> Any:
    """``kind(**data)`` keeping only its fields (keys added by newer writers of the same schema are ignored)."""
    if not isinstance(data, dict):
        raise TypeError(f"expected an object for {kind.__name__}, got {type(data).__name__}")
    names = {f.name for f in fields(kind)}
    return kind(**{k: v for k, v in data.items() if k in names and k not in overrides}, **overrides)


def _short(text: str | None, limit: int = 80) -> str:
    if not text:
        return ""
    line = text.splitlines()[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."
