"""Results of the measuring strategies: per-candidate evaluations and per-graph summaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.profiling import Measurement, SweepResult
from torch_tweak.torch.report.report import CandidateReport


@dataclass
class Evaluation:
    """One candidate's outcome: its report row, the built backend (None if it failed) and its sweep."""

    role: str
    row: CandidateReport
    backend: Backend | None = None
    sweep: SweepResult | None = None
    pick: Measurement | None = None


@dataclass
class CandidateResult:
    """Summary of one candidate in :attr:`MeasuringStrategy.results`."""

    backend: str
    role: str
    status: str
    batch_size: int | None = None
    throughput: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    stable: bool | None = None
    error: str | None = None


@dataclass
class StrategyResult:
    """What a measuring strategy decided for one graph."""

    module_name: str
    graph_spec_name: str
    chosen: str
    reason: str
    candidates: list[CandidateResult] = field(default_factory=list)


@dataclass
class Plan:
    """How a graph is measured: the batch sizes, whether they are real batch sizes, the base inputs."""

    batch_sizes: list[int]
    batched: bool
    sample: Any




def selection_dict(metric: str, pick: Measurement | None) -> dict[str, Any] | None:
    """The measurement a strategy judged a candidate by, for its report row (None: it did not qualify)."""
    if pick is None:
        return None
    return {"metric": metric, "batch_size": pick.batch_size, "throughput": pick.throughput,
            "p50_ms": pick.p50_ms, "p99_ms": pick.p99_ms, "stable": pick.stable}


def summarize(module_name: str, graph_name: str, evaluations: list[Evaluation], chosen: str,
              reason: str) -> StrategyResult:
    """A :class:`StrategyResult` from the evaluations of one graph."""
    rows = []
    for e in evaluations:
        p = e.pick
        rows.append(CandidateResult(
            e.row.backend, e.role, e.row.status, p.batch_size if p else None, p.throughput if p else None,
            p.p50_ms if p else None, p.p99_ms if p else None, p.stable if p else None, e.row.error))
    return StrategyResult(module_name, graph_name, chosen, reason, rows)
