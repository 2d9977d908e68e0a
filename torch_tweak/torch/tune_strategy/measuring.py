"""The measuring strategies: HighestThroughputStrategy, LowestLatencyStrategy, LatencyBudgetStrategy.

All three build and check every candidate, measure it and the eager baseline, and apply the eager gate:
a candidate replaces eager only when it beats it by ``eager_margin`` (5 % by default) on the strategy's
metric. Measurements (with raw per-call times) land in each candidate's report row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from torch_tweak.errors import ConfigError, TuningError
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.profiling import Measurement, SweepResult
from torch_tweak.torch.tune_strategy.base import GraphTask, describe_task
from torch_tweak.torch.tune_strategy.measuring_base import Evaluation, MeasuringStrategy
from torch_tweak.utils.validate import check_bool

logger = logging.getLogger(__name__)


class HighestThroughputStrategy(MeasuringStrategy):
    """Choose the candidate with the highest throughput (samples/s) at its best batch size.

    Each candidate is swept over the powers of two in the graph's batch range (extended first by the
    opt-in max-batch-size search); the sweep stops when throughput saturates. Graphs without a batch
    axis are measured at their own batch only.

    With ``batch_routing`` (the default), batch sizes at which another candidate of the chosen one's
    runtime was measured faster by ``eager_margin`` go to that candidate: the graph is served by a
    :class:`~torch_tweak.torch.backend.BatchRouterBackend` (OpenVINO LATENCY for batch 1, THROUGHPUT for
    large batches, say). A route to a candidate of another runtime (ONNX Runtime for small batches) serves
    only when calls of mixed batch sizes confirm it, batch size by batch size, since alternating calls between
    thread pools can cost more than it gains on a few cores (:mod:`~torch_tweak.torch.tune_strategy.mixed_routes`).
    See :class:`MeasuringStrategy` for the other arguments.
    """

    def __init__(self, backends: Iterable[Backend] | None = None, *, batch_routing: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(backends, **kwargs)
        self._routes_batches = check_bool(batch_routing, "HighestThroughputStrategy: batch_routing")

    def _pick(self, result: SweepResult) -> Measurement | None:
        return result.best()

    def _score(self, measurement: Measurement) -> float:
        return measurement.throughput

    def _speedup(self, candidate: Measurement, eager: Measurement) -> float:
        return candidate.throughput / eager.throughput

    def _describe_pick(self, measurement: Measurement) -> str:
        return f"{measurement.throughput:.1f} samples/s at batch {measurement.batch_size}"

    _contested = True

    def _contest_score(self, times: dict[int, float]) -> float:
        return max(size * 1000.0 / max(ms, 1e-9) for size, ms in times.items())


class LowestLatencyStrategy(MeasuringStrategy):
    """Choose the candidate with the lowest median (p50) latency at batch 1, or the graph's smallest batch.

    Only that one batch size is measured. See :class:`MeasuringStrategy` for the arguments.
    """

    metric_name = "p50 latency"

    def _batch_sizes(self, low: int, high: int) -> list[int]:
        return [low]

    def _pick(self, result: SweepResult) -> Measurement | None:
        return result.measurements[0] if result.measurements else None

    def _score(self, measurement: Measurement) -> float:
        return -measurement.p50_ms

    def _speedup(self, candidate: Measurement, eager: Measurement) -> float:
        return eager.p50_ms / max(candidate.p50_ms, 1e-12)

    def _describe_pick(self, measurement: Measurement) -> str:
        return f"p50 {measurement.p50_ms:.3f} ms at batch {measurement.batch_size}"

    _contested = True

    def _contest_score(self, times: dict[int, float]) -> float:
        return -min(times.values())


class LatencyBudgetStrategy(MeasuringStrategy):
    """Choose the highest throughput whose p99 latency, at the batch size giving it, stays within a budget.

    A candidate's sweep stops at the first batch size over the budget (larger batches take longer per
    call). When no candidate, eager included, fits, :class:`TuningError` lists every candidate's p99.

    Args:
        latency_budget_ms: the p99 latency limit of one call, in milliseconds (> 0).
        backends: candidate templates (None: every backend available).
        **kwargs: see :class:`MeasuringStrategy`.
    """

    def __init__(self, latency_budget_ms: float, backends: Iterable[Backend] | None = None, **kwargs: Any) -> None:
        ok = (not isinstance(latency_budget_ms, bool) and isinstance(latency_budget_ms, (int, float))
              and math.isfinite(latency_budget_ms) and latency_budget_ms > 0)
        if not ok:
            raise ConfigError(
                f"LatencyBudgetStrategy: latency_budget_ms must be a finite number of milliseconds > 0, got "
                f"{latency_budget_ms!r}; e.g. LatencyBudgetStrategy(latency_budget_ms=20)."
            )
        super().__init__(backends, **kwargs)
        self.latency_budget_ms = float(latency_budget_ms)

    @property
    def metric_name(self) -> str:  # type: ignore[override]
        """Throughput within the latency budget."""
        return f"throughput within p99 <= {self.latency_budget_ms:g} ms"

    def describe(self) -> str:
        """The strategy with its budget and candidates."""
        return f"{super().describe()[:-1]}; latency_budget_ms={self.latency_budget_ms:g})"

    def _fits(self, measurement: Measurement) -> bool:
        return measurement.p99_ms <= self.latency_budget_ms

    def _keep_going(self, measurement: Measurement) -> bool:
        return self._fits(measurement)

    def _pick(self, result: SweepResult) -> Measurement | None:
        fitting = [m for m in result.measurements if self._fits(m)]
        return max(fitting, key=lambda m: m.throughput, default=None)

    def _score(self, measurement: Measurement) -> float:
        return measurement.throughput

    def _speedup(self, candidate: Measurement, eager: Measurement) -> float:
        return candidate.throughput / eager.throughput

    def _describe_pick(self, measurement: Measurement) -> str:
        return (f"{measurement.throughput:.1f} samples/s at batch {measurement.batch_size} "
                f"(p99 {measurement.p99_ms:.3f} ms)")

    def _nothing_qualifies(self, task: GraphTask, evaluations: list[Evaluation]) -> TuningError:
        lines = []
        for e in evaluations:
            if e.sweep is not None and e.sweep.measurements:
                fastest = min(e.sweep.measurements, key=lambda m: m.p99_ms)
                lines.append(f"{e.row.backend}: p99 {fastest.p99_ms:.3f} ms at batch {fastest.batch_size}")
            else:
                lines.append(f"{e.row.backend}: {e.row.status} ({e.row.error})")
        return TuningError(
            f"No candidate meets the latency budget of {self.latency_budget_ms:g} ms (p99 per call) for "
            f"{describe_task(task)}: " + "; ".join(lines) + ". Raise latency_budget_ms, or add a faster backend."
        )
