"""Screening before sweeping, and the time budget of a tuning run.

Measuring every candidate over every batch size costs as much as building some of them. A measuring
strategy therefore first measures each candidate at the smallest and the largest batch size of its plan
(the two ends, where latency and throughput winners show), and sweeps all batch sizes only for the
candidates within ``screening_margin`` of the best at either end (the sweep keeps the two screening
measurements and measures only the sizes between them); the others are ``screened_out`` rows with their two
measurements. The eager baseline is always swept in full (the eager gate compares with it). A candidate
whose small-end throughput is already out of reach of what it needs at both ends
(:func:`~.results.out_of_reach`) is neither checked nor measured at the large end: a BERT-base quantized by
TorchAO ran at 0.04x the best at batch 1 and would have spent 19 recorded calls of 3.7 s on its check and two
35-second calls at batch 8 to show 0.03x there.

``tt.tune(..., time_budget_s=...)`` gives each graph a share of the remaining time when its tuning starts
(unused time rolls over to the next graph). A strategy builds its candidates cheapest first (the registry's
``build_cost``) and skips a candidate, with a ``skipped`` row saying why, once the graph's share would not
cover what a candidate of the same backend class took earlier in the run (or once it is used up).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.executor.base import Executor, Shared
from torch_tweak.torch.profiling import Measurement, SweepResult
from torch_tweak.torch.profiling.limit import run_with_time_limit
from torch_tweak.torch.report.report import CandidateReport
from torch_tweak.torch.report.status import CandidateStatus
from torch_tweak.torch.tune_strategy.ahead import BuildsAhead
from torch_tweak.torch.tune_strategy.base import CandidateFailedError, GraphTask, release_quietly
from torch_tweak.torch.tune_strategy.result_cache import ResultCache
from torch_tweak.torch.tune_strategy.results import BASELINE, Evaluation, Plan, out_of_reach, selection_dict


def screening_plan(plan: Plan) -> Plan | None:
    """The plan's two end batch sizes, or None when the plan has no more than two (nothing to save)."""
    if len(plan.batch_sizes) <= 2:
        return None
    return replace(plan, batch_sizes=[min(plan.batch_sizes), max(plan.batch_sizes)])


def best_at_ends(evaluations: list[Evaluation], sizes: list[int]) -> dict[int, float]:
    """The highest throughput any screened candidate reached at each screening batch size."""
    best: dict[int, float] = {}
    for evaluation in evaluations:
        for size in sizes:
            measured = evaluation.sweep.at(size) if evaluation.sweep is not None else None
            if measured is not None:
                best[size] = max(best.get(size, 0.0), measured.throughput)
    return best


def screened_out(sweep: SweepResult | None, best: dict[int, float], margin: float) -> str | None:
    """Why a screened candidate cannot win (None: it is within ``margin`` of the best at some end)."""
    if sweep is None:
        return None
    ratios = {size: m.throughput / best[size] for size in best if (m := sweep.at(size)) is not None and best[size]}
    if not ratios or any(r >= 1.0 - margin for r in ratios.values()):
        return None
    shown = ", ".join(f"{r:.2f}x at batch {size}" for size, r in sorted(ratios.items()))
    unmeasured = sorted(size for size in best if sweep.at(size) is None)
    bounded = (f" (batch {', '.join(map(str, unmeasured))} not measured: calls there take no less time, so its "
               f"throughput could not grow enough)") if unmeasured else ""
    return (f"screened out: {shown} of the best candidate's throughput{bounded}, below the {1.0 - margin:.2f}x "
            f"(screening_margin={margin:g}) a candidate needs at one end to be swept over every batch size")


def _screened(evaluations: list[Evaluation]) -> list[Evaluation]:
    """The candidates screening compares: measured, and built here or reused (the baseline is not one)."""
    return [e for e in evaluations if e.role != BASELINE and (e.backend is not None or e.reused)]


def mark_screened_out(evaluation: Evaluation, reason: str) -> None:
    """Turn a passed candidate's row into a ``screened_out`` row."""
    evaluation.row.status = CandidateStatus.SCREENED_OUT
    evaluation.row.error = reason
    evaluation.pick = None


@dataclass
class TimeBudget:
    """The deadline of a whole tuning run, shared out among its graphs as they start."""

    seconds: float
    graphs_left: int
    start: float = field(default_factory=time.perf_counter)

    def graph_deadline(self) -> float:
        """The deadline of the next graph: an equal share of the time left (the previous graphs' savings too)."""
        now = time.perf_counter()
        left = max(0.0, self.start + self.seconds - now)
        share = left / max(1, self.graphs_left)
        self.graphs_left = max(0, self.graphs_left - 1)
        return now + share


@dataclass
class BuildCosts:
    """Seconds a candidate of each backend class took (build, check, measurement), learned during a run."""

    seconds: dict[str, float] = field(default_factory=dict)

    def note(self, template: Backend, seconds: float) -> None:
        """Remember the longest time a candidate of this class took."""
        name = type(template).__name__
        self.seconds[name] = max(self.seconds.get(name, 0.0), seconds)

    def skip_row(self, template: Backend, deadline: float | None, role: str) -> CandidateReport | None:
        """A ``skipped`` row if the candidate does not fit before ``deadline``, else None."""
        if deadline is None:
            return None
        left = deadline - time.perf_counter()
        expected = self.seconds.get(type(template).__name__, 0.0)
        if left > expected and left > 0:
            return None
        row = CandidateReport(backend=template.describe(), key=template.key(), role=role,
                              status=CandidateStatus.SKIPPED)
        why = (f"its graph's share of time_budget_s is used up ({-left:.1f} s over)" if left <= 0 else
               f"{left:.1f} s of its graph's share of time_budget_s are left and a {type(template).__name__} "
               f"candidate took {expected:.1f} s earlier in this run")
        row.error = f"skipped: {why}; raise time_budget_s to try it"
        return row


class ScreeningSteps:
    """Mixed into ``MeasuringStrategy``: dropping screened candidates and sweeping the survivors."""

    screening_margin: float
    candidate_time_limit_s: float | None
    metric_name: str
    # From MeasuringStrategy and its mixins: ``_pick``, ``_rebuild``, ``_measure_backend``, ``_sweep_isolated``.

    def _screen_plan(self: Any, screen: Plan, evaluations: list[Evaluation]) -> Plan:
        """The screening plan with what a candidate needs at each end to be kept, given the candidates so far."""
        best = best_at_ends(_screened(evaluations), screen.batch_sizes)
        return replace(screen, needs=tuple((size, (1.0 - self.screening_margin) * top)
                                           for size, top in sorted(best.items()) if top))

    def _screen_first(self: Any, task: GraphTask, plan: Plan, cancel: threading.Event | None,
                      into: list[tuple[Backend, Measurement]]) -> Callable[[Backend, CandidateReport], None] | None:
        """With what a candidate needs at the screening ends (``plan.needs``), the ``try_backend`` hook that measures
        it at the small end before the fidelity check (adding ``(backend, measurement)`` to ``into``, for the sweep
        to take) and ends it as ``screened_out`` when it is :func:`~.results.out_of_reach`: neither checked nor
        measured at the large end (the check runs every recorded call, minutes for a candidate 25x slower than
        eager)."""
        if not plan.needs:
            return None
        first = replace(plan, batch_sizes=[min(plan.batch_sizes)])

        def hook(backend: Backend, row: CandidateReport) -> None:
            result = self._measure_backend(backend, task, first, cancel)
            if not result.measurements:
                return  # the call failed: the check says how
            into.append((backend, result.measurements[0]))
            if not out_of_reach(result.measurements[0], plan):
                return
            best = {size: need / (1.0 - self.screening_margin) for size, need in plan.needs}
            row.status, row.measurements = CandidateStatus.SCREENED_OUT, result.to_dict()
            row.error = f"{screened_out(result, best, self.screening_margin)}; its outputs were not checked"
            release_quietly(backend)
            raise CandidateFailedError(row)

        return hook

    def _screen(self: Any, evaluations: list[Evaluation], screen: Plan) -> None:
        """Release the screened candidates that can no longer be within the margin of the best."""
        screened = _screened(evaluations)
        best = best_at_ends(screened, screen.batch_sizes)
        for evaluation in screened:
            reason = screened_out(evaluation.sweep, best, self.screening_margin)
            if reason is not None:
                mark_screened_out(evaluation, reason)
                if evaluation.backend is not None:
                    release_quietly(evaluation.backend)
                evaluation.backend, evaluation.reused = None, False

    def _sweep_survivors(self: Any, task: GraphTask, evaluations: list[Evaluation], plan: Plan, screen: Plan,
                         cache: ResultCache | None, executor: Executor | None, shared: Shared | None,
                         ahead: BuildsAhead | None = None) -> None:
        """Sweep every batch size of the plan for the candidates screening kept (a reused result that was
        swept already keeps its sweep); with an isolated executor, in a worker (the background worker for those
        it evaluated in their turn), which then releases what it kept."""
        for evaluation in evaluations:
            if evaluation.role == BASELINE or not evaluation.qualified:
                continue
            measured = [m.batch_size for m in evaluation.sweep.measurements] if evaluation.sweep else []
            if evaluation.reused and measured != screen.batch_sizes:
                continue
            # the screening's two ends are measurements already: the sweep measures only the sizes between
            own = replace(plan, known=tuple(evaluation.sweep.measurements)) if evaluation.sweep else plan
            if executor is not None and shared is not None:
                done = ahead.sweep(evaluation.template, evaluation.role, own) if ahead is not None else None
                result = self._sweep_isolated(executor, shared, evaluation, task, own, done)
                if result is None:
                    continue
            else:
                if evaluation.backend is None and not self._rebuild(task, evaluation):
                    continue
                backend = evaluation.backend
                finished, result = run_with_time_limit(
                    lambda cancel, b=backend, o=own: self._measure_backend(b, task, o, cancel),
                    self.candidate_time_limit_s)
                if not finished or not result.measurements:
                    continue  # keeps its screening measurements, which already qualified it
            evaluation.sweep, evaluation.pick = result, self._pick(result)
            evaluation.row.measurements = result.to_dict()
            evaluation.row.measurements["selection"] = selection_dict(self.metric_name, evaluation.pick)
            if cache is not None:
                cache.store(evaluation.key, evaluation.row, result)
        if executor is not None and shared is not None:
            self._keep_only(executor, shared, [], task)

