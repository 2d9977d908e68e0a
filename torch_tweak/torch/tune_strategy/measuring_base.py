"""MeasuringStrategy: build, check and profile every candidate plus the eager baseline, then choose.

Each candidate runs in its own block (build, fidelity check, pause, warm-up, measurement) so the thread pools of
different runtimes never alternate calls; the best and its close rivals are then timed again in turns before the
choice is final (:mod:`~torch_tweak.torch.tune_strategy.contest`). A candidate gets a time limit covering all of
that; one that exceeds it is abandoned and reported as ``timeout``. Subclasses say which batch sizes to measure
and how to score a sweep (:mod:`torch_tweak.torch.tune_strategy.measuring`). Limits of abandoning: Python cannot
kill a thread. A measurement stops at its next call, but a call or a build that never returns keeps its thread
(and, for a build, the redirection of stdout/stderr into its ``build.log``) until it does.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any

from torch_tweak.errors import ConfigError, TuningError
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.batch_router import BatchRouterBackend
from torch_tweak.torch.backend.registry import backends_from, build_cost, default_candidates
from torch_tweak.torch.backend.torch_eager import TorchEagerBackend
from torch_tweak.torch.executor.base import Executor, Pending, Shared
from torch_tweak.torch.fidelity import FidelityConfig
from torch_tweak.torch.profiling import (
    Measurement,
    ProfilingCancelledError,
    ProfilingConfig,
    SweepResult,
    power_of_two_batch_sizes,
)
from torch_tweak.torch.profiling.limit import run_with_time_limit
from torch_tweak.torch.profiling.stop_rules import apply_stop_rules
from torch_tweak.torch.report.report import CHOSEN, INFER_FAILED, TIMEOUT, CandidateReport, GraphReport
from torch_tweak.torch.tune_strategy.ahead import BuildsAhead, start_builds_ahead
from torch_tweak.torch.tune_strategy.base import (
    CandidateFailedError,
    GraphTask,
    Measure,
    TuneStrategy,
    describe_task,
    format_failures,
    release_quietly,
)
from torch_tweak.torch.tune_strategy.batch_search import search_if_enabled
from torch_tweak.torch.tune_strategy.contest import Contests
from torch_tweak.torch.tune_strategy.eager_gate import EagerGate
from torch_tweak.torch.tune_strategy.graph_probes import KEPT_PROBES
from torch_tweak.torch.tune_strategy.isolated import IsolatedCandidates
from torch_tweak.torch.tune_strategy.mixed_routes import MixedRoutes
from torch_tweak.torch.tune_strategy.result_cache import ResultCache, ReusedResults
from torch_tweak.torch.tune_strategy.results import (
    BASELINE,
    Evaluation,
    Plan,
    StrategyResult,
    precision_retry,
    selection_dict,
    unbuilt,
)
from torch_tweak.torch.tune_strategy.routing import batch_routes, describe_routes, serving_of, worth_keeping
from torch_tweak.torch.tune_strategy.screening import BuildCosts, ScreeningSteps, screening_plan
from torch_tweak.torch.tune_strategy.stand_ins import StandIns, skipped_row
from torch_tweak.torch.tune_strategy.sweeping import sweep_backend
from torch_tweak.torch.tune_strategy.twins import remember_judged, twin_of
from torch_tweak.utils.validate import check_bool, check_int, check_positive

logger = logging.getLogger(__name__)


class MeasuringStrategy(ReusedResults, IsolatedCandidates, ScreeningSteps, Contests, MixedRoutes, StandIns, EagerGate,
                        TuneStrategy):
    """Base of the strategies that measure: candidates, eager baseline, eager gate, time limit, batch search.

    Args:
        backends: candidate templates (None: every backend available, see ``default_candidates``).
        profiling: stop rules and caps of each measurement (:class:`ProfilingConfig`).
        eager_margin: a candidate is chosen only if it beats eager by this fraction (0.05 = 5 %).
        candidate_time_limit_s: seconds one candidate may take (build, check, measurement); None disables it.
        find_max_batch_size: before measuring, search on eager for the batch size with the highest
            throughput and extend the graph's max shapes to it (graphs with a batch axis only).
        max_batch_size_limit: largest batch size that search tries.
        baseline: the eager reference (default ``TorchEagerBackend()``), always built and measured.
        fidelity: tolerances of the fidelity check.
        measurement_stop_strategy: a stop strategy of the reference Torch Tweak for each measurement
            (:mod:`torch_tweak.torch.profiling.stop_rules`), applied on top of ``profiling``.
        profiling_stop_strategy: the same for the batch-size sweep.
        screening: measure candidates at the plan's smallest and largest batch size first and sweep every
            batch size only for those within ``screening_margin`` of the best at either end
            (:mod:`~torch_tweak.torch.tune_strategy.screening`).
        screening_margin: how far below the best screened throughput (0.5 = half of it) a candidate may be
            and still be swept.
        reuse_results: reuse what an earlier run measured for the same weights, graph, backend, settings and
            environment (:mod:`~torch_tweak.torch.tune_strategy.result_cache`); a reused candidate is built
            again only if it is chosen.
        skip_stand_ins: skip, with a ``skipped`` row, a candidate another measured one stands in for or that
            eager's own kernels already keep out of reach (TorchAO, Inductor JIT and AOT; the rules are in
            :mod:`~torch_tweak.torch.tune_strategy.stand_ins`).
    """

    metric_name = "throughput"
    #: Whether the strategy may serve ranges of batch sizes with other candidates (``routing`` module).
    _routes_batches = False

    def __init__(
        self,
        backends: Iterable[Backend] | None = None,
        *,
        profiling: ProfilingConfig | None = None,
        eager_margin: float = 0.05,
        candidate_time_limit_s: float | None = 600.0,
        find_max_batch_size: bool = False,
        max_batch_size_limit: int = 256,
        baseline: Backend | None = None,
        fidelity: FidelityConfig | None = None,
        measurement_stop_strategy: Any = None,
        profiling_stop_strategy: Any = None,
        screening: bool = True,
        screening_margin: float = 0.5,
        reuse_results: bool = True,
        skip_stand_ins: bool = True,
    ) -> None:
        super().__init__(fidelity)
        owner = type(self).__name__
        self._backends = backends_from(backends, owner)
        if profiling is not None and not isinstance(profiling, ProfilingConfig):
            raise ConfigError(f"{owner}: profiling must be a ProfilingConfig, got {type(profiling).__name__}.")
        self.profiling = apply_stop_rules(profiling or ProfilingConfig(), measurement_stop_strategy,
                                          profiling_stop_strategy, owner)
        self.eager_margin = check_positive(eager_margin, f"{owner}: eager_margin", allow_zero=True)
        self.candidate_time_limit_s = None if candidate_time_limit_s is None else check_positive(
            candidate_time_limit_s, f"{owner}: candidate_time_limit_s", allow_zero=False)
        self.find_max_batch_size = check_bool(find_max_batch_size, f"{owner}: find_max_batch_size")
        self.max_batch_size_limit = check_int(max_batch_size_limit, f"{owner}: max_batch_size_limit", minimum=1)
        self.baseline = backends_from([baseline], owner)[0] if baseline is not None else TorchEagerBackend()
        self.screening = check_bool(screening, f"{owner}: screening")
        self.screening_margin = check_positive(screening_margin, f"{owner}: screening_margin", allow_zero=True)
        if self.screening_margin >= 1:
            raise ConfigError(f"{owner}: screening_margin must be < 1 (0.5 sweeps candidates with at least half the "
                              f"best screened throughput), got {screening_margin!r}.")
        self.reuse_results = check_bool(reuse_results, f"{owner}: reuse_results")
        self.skip_stand_ins = check_bool(skip_stand_ins, f"{owner}: skip_stand_ins")
        self.results: list[StrategyResult] = []
        self._costs = BuildCosts()

    def candidates(self) -> list[Backend]:
        """The candidate templates (the defaults when none were given)."""
        return list(self._backends) if self._backends else default_candidates()

    # subclass hooks ---------------------------------------------------------------------------

    def _batch_sizes(self, low: int, high: int) -> list[int]:
        """Batch sizes to measure for a graph whose batch range is ``[low, high]``."""
        return power_of_two_batch_sizes(low, high)

    def _keep_going(self, measurement: Measurement) -> bool:
        """False ends a candidate's sweep early (e.g. once a latency budget is exceeded)."""
        return True

    @abstractmethod
    def _pick(self, result: SweepResult) -> Measurement | None:
        """The measurement this strategy judges a candidate by (None: the candidate does not qualify)."""

    @abstractmethod
    def _score(self, measurement: Measurement) -> float:
        """Higher is better."""

    @abstractmethod
    def _speedup(self, candidate: Measurement, eager: Measurement) -> float:
        """How many times better ``candidate`` is than ``eager`` on this strategy's metric."""

    @abstractmethod
    def _describe_pick(self, measurement: Measurement) -> str:
        """``"1234.5 samples/s at batch 8"`` for messages."""

    def _nothing_qualifies(self, task: GraphTask, evaluations: list[Evaluation]) -> TuningError:
        """The error raised when neither a candidate nor eager can be chosen."""
        return TuningError(
            f"No candidate for {describe_task(task)} could be built, checked and measured: "
            f"{format_failures([e.row for e in evaluations])}"
        )

    # the tuning flow --------------------------------------------------------------------------

    def _templates(self, task: GraphTask) -> list[tuple[Backend, str]]:
        """The baseline, then the candidates cheapest build first, in the order ``StandIns._turn_order`` gives."""
        baseline_key = self.baseline.key()
        others = sorted((t for t in self.candidates() if t.key() != baseline_key), key=build_cost)
        return [(self.baseline, BASELINE), *self._turn_order([(t, "candidate") for t in others], task)]

    def _plan(self, task: GraphTask) -> Plan:
        spec = task.graph_spec
        sample = copy.deepcopy(task.samples[0].sample)
        if spec.has_batch_axis():
            low, high = spec.batch_range() or (1, 1)
            return Plan(self._batch_sizes(low, high), True, sample)
        return Plan([task.samples[0].batch_size or 1], False, sample)

    def _tune(self, task: GraphTask) -> Backend:
        search_if_enabled(self, task)
        plan = self._plan(task)
        screen = screening_plan(plan) if self.screening else None
        cache = ResultCache(task.module, task.graph_spec, self._settings(plan, screen, task)) \
            if self.reuse_results else None
        if cache is not None:  # a rerun's rules and routes decide on what the first run probed and timed
            cache.restore_probes(task.probed, KEPT_PROBES)
        executor, shared = self._open_executor(task)
        ahead = start_builds_ahead(self, task, executor, shared, cache)
        try:
            try:
                evaluations = self._evaluate_all(task, plan, screen, cache, executor, shared, ahead)
                if screen is not None:
                    self._sweep_survivors(task, evaluations, plan, screen, cache, executor, shared, ahead)
                winner, contest, versus_eager = self._contest(task, evaluations, plan, executor, shared, ahead)
            finally:
                if ahead is not None:
                    ahead.close()
            while True:  # a reused result serves once built and checked again; then routes are worked out again
                best = winner if winner is not None and winner.qualified else self._best(evaluations)
                chosen, reason = self._choose(task, evaluations, best, versus_eager if best is winner else None)
                routes = batch_routes(chosen, evaluations, 1.0 + self.eager_margin) if self._routes_batches else None
                if missing := unbuilt(serving_of(chosen, routes)):
                    for evaluation in missing:
                        self._rebuild(task, evaluation)
                    continue
                routes, confirmed = self._confirm_routes(task, chosen, evaluations, routes, plan, executor, shared)
                routes, crossing = self._routes_across_runtimes(task, chosen, evaluations, routes, plan, executor,
                                                                shared) if self._routes_batches else (routes, "")
                # routes can leave out a worker-measured contest winner, then give it sizes back: build it now
                if all(self._rebuild(task, evaluation) for evaluation in unbuilt(serving_of(chosen, routes))):
                    break
        finally:  # the worker times routes across runtimes too
            if executor is not None and shared is not None:
                executor.release(shared)
            if cache is not None:  # what the graph's probes and mixed calls measured, for a rerun
                cache.store_probes(task.probed, KEPT_PROBES)
        serving = serving_of(chosen, routes)
        for evaluation in evaluations:
            if all(evaluation is not e for e in serving) and evaluation.backend is not None:
                release_quietly(evaluation.backend)
        for evaluation in serving:
            evaluation.row.status = CHOSEN
        if routes is None:
            backend, task.report.chosen = chosen.backend, chosen.row.backend  # built: the loop above saw to it
        else:
            backend = BatchRouterBackend([(bound, e.backend) for bound, e in routes], task.graph_spec)
            task.report.chosen = backend.describe()
            reason = f"{reason}; {describe_routes(routes, chosen)}"
        task.report.reason = reason + contest + confirmed + crossing
        self.results.append(StrategyResult(task.module_name, task.report))
        logger.info("%s: chose %s (%s)", describe_task(task), task.report.chosen, reason)
        return backend

    def _evaluate_all(self, task: GraphTask, plan: Plan, screen: Plan | None, cache: ResultCache | None,
                      executor: Executor | None, shared: Shared | None, ahead: BuildsAhead | None = None) -> list[Evaluation]:
        """Evaluate the baseline and every candidate (reused, skipped, in process or by ``executor``; those
        ``ahead`` builds in the background wait for that build)."""
        evaluations: list[Evaluation] = []
        queue = self._templates(task)
        seen = {template.key() for template, _ in queue}
        prefetched: dict[str, Pending] = {}
        while queue:
            template, role = queue.pop(0)
            key = cache.key(template, role) if cache is not None else None
            stored = cache.load(key) if cache is not None else None
            skipped = None if role == BASELINE or stored is not None else (
                self._costs.skip_row(template, task.deadline, role)
                or (None if template.key() in prefetched else self._stand_in_row(template, role, task, evaluations)))
            own_plan = plan if screen is None or role == BASELINE else self._screen_plan(screen, evaluations)
            if stored is not None:
                evaluation = self._reused(task, role, *stored)
            elif skipped is not None:
                if ahead is not None:
                    ahead.skipped(template)
                task.report.candidates.append(skipped)
                logger.info("%s: %s %s", describe_task(task), skipped.backend, skipped.error)
                continue
            else:
                started = time.perf_counter()
                turn = ahead.take_turn(template, role, own_plan, own_plan is not plan) if ahead is not None else None
                if isinstance(turn, str):  # the background worker's stand-in probe: no build
                    task.report.candidates.append(row := skipped_row(template, role, turn))
                    logger.info("%s: %s %s", describe_task(task), row.backend, row.error)
                    if cache is not None:
                        cache.store(key, row, None)
                    continue
                if executor is None or shared is None:
                    evaluation = self._evaluate(template, task, role, own_plan)
                else:
                    pending = turn or prefetched.pop(template.key(), None) or \
                        self._submit(executor, shared, template, task, role, own_plan, keep=own_plan is not plan)
                    if executor.concurrent and not prefetched:  # submit the rest now: they run in parallel
                        for other, other_role in queue:
                            other_plan = plan if screen is None or other_role == BASELINE else screen
                            prefetched[other.key()] = self._submit(executor, shared, other, task, other_role,
                                                                   other_plan)
                    evaluation = self._evaluate_isolated(pending, template, task, role)
                self._costs.note(template, time.perf_counter() - started)
                if cache is not None:
                    cache.store(key, evaluation.row, evaluation.sweep)
            evaluation.template, evaluation.key = template, key
            evaluations.append(evaluation)
            self.drop_stood_in(ahead, queue, task, evaluations)
            retry = precision_retry(template, evaluation, seen)
            if retry is not None:
                queue.insert(0, (retry, role))
            if screen is not None:
                qualified = sum(e.qualified for e in evaluations)
                self._screen(evaluations, screen)
                if executor is not None and shared is not None and sum(e.qualified for e in evaluations) < qualified:
                    kept = self._keep_only(executor, shared, evaluations, task)  # the workers drop the screened out
                    if ahead is not None:
                        ahead.keep_only(kept)
            else:
                self._release_unneeded(evaluations, self._best(evaluations))
        return evaluations

    def _best(self, evaluations: list[Evaluation]) -> Evaluation | None:
        """The built candidate (not the baseline) with the best score, if any qualifies."""
        qualified = [e for e in evaluations if e.role != BASELINE and e.qualified]
        return max(qualified, key=lambda e: self._score(e.pick), default=None)  # type: ignore[arg-type]

    def _release_unneeded(self, evaluations: list[Evaluation], best: Evaluation | None) -> None:
        """Deactivate candidates that can no longer be chosen or serve a batch-size range (eager stays)."""
        keep = [best, *(worth_keeping(evaluations, 1.0 + self.eager_margin) if self._routes_batches else [])]
        for evaluation in evaluations:
            if evaluation.role != BASELINE and evaluation.backend is not None and all(evaluation is not k for k in keep):
                release_quietly(evaluation.backend)

    def _evaluate(self, template: Backend, task: GraphTask, role: str, plan: Plan) -> Evaluation:
        private = dataclasses.replace(task, report=GraphReport(name=task.report.name))
        try:
            finished, value = run_with_time_limit(
                lambda cancel: self._build_and_measure(template, private, role, plan, cancel),
                self.candidate_time_limit_s,
            )
        except CandidateFailedError as failure:
            task.report.candidates.append(row := failure.report)
            logger.info("%s: %s %s: %s", describe_task(task), row.backend, row.status, row.error)
            return Evaluation(role, row)
        if not finished:
            row = CandidateReport(backend=template.describe(), key=template.key(), role=role, status=TIMEOUT)
            row.error = (f"TimeoutError: did not finish building, checking and measuring within "
                         f"candidate_time_limit_s={self.candidate_time_limit_s:g} s and was abandoned; raise the "
                         "limit if this backend is just slow to build")
            task.report.candidates.append(row)
            logger.warning("%s: %s exceeded its time limit of %g s and was abandoned; if its call is still running "
                           "it may slow down the candidates measured after it", describe_task(task),
                           row.backend, self.candidate_time_limit_s)
            return Evaluation(role, row)
        backend, result = value
        row = private.report.candidates[-1]
        task.report.candidates.append(row)
        pick = self._pick(result)
        row.measurements = result.to_dict()
        row.measurements["selection"] = selection_dict(self.metric_name, pick)
        return Evaluation(role, row, backend, result, pick)

    def _build_and_measure(self, template: Backend, task: GraphTask, role: str, plan: Plan, cancel: threading.Event,
                           built: tuple[Backend, float] | None = None) -> tuple[Backend, SweepResult]:
        if role != BASELINE and (skipped := self._probe_row(template, role, task)) is not None:
            if built is not None:
                release_quietly(built[0])
            raise CandidateFailedError(skipped)  # decided where it is built: the probe times a layer
        first: list[tuple[Backend, Measurement]] = []  # screening's small end, measured before the check
        twin = twin_of(task, template) if role != BASELINE else None  # same artifact, other scheduling: confirmed
        backend, row = self.try_backend(template, task, role, confirm=role == BASELINE or twin is not None,
                                        before_check=self._screen_first(task, plan, cancel, first), judged=twin,
                                        built=built)
        remember_judged(task, template, row)
        known = (*plan.known, *(m for b, m in first if b is backend))  # not behind a guard the check added
        try:
            result = self._measure_backend(backend, task, dataclasses.replace(plan, known=known), cancel)
        except ProfilingCancelledError:
            release_quietly(backend)
            raise
        if not result.measurements:
            row.status = INFER_FAILED
            row.error = f"could not be measured: {result.error}"
            row.measurements = result.to_dict()
            release_quietly(backend)
            raise CandidateFailedError(row)
        return backend, result

    def _measure_backend(self, backend: Backend, task: GraphTask, plan: Plan,
                         cancel: threading.Event | None) -> SweepResult:  # the plan's sizes, after the pause
        return sweep_backend(backend, task.graph_spec, task.device, plan, self.profiling, cancel, self._keep_going)

    def batch_search_baseline(self) -> Backend:
        """The backend the max-batch-size search measures: the eager baseline unless another one was set."""
        return self._search_backend if self._search_backend is not None else self.baseline

    def batch_search_measure(self) -> Measure:
        """This strategy's own measurement, unless the search was given a profiling config of its own."""
        return self._measure_backend if self._search_profiling is None else super().batch_search_measure()
