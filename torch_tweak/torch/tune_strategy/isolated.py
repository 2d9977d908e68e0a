"""Candidates evaluated by an isolated executor (a worker process, a Ray task) instead of in the tuning process.

The measuring strategies hand each candidate to ``task.executor`` (:mod:`torch_tweak.torch.executor`): the
worker builds, checks and measures it with the strategy's own code (:func:`evaluate_candidate`) and sends back
the report row and the sweep; the built backend stays there and is released. The strategy compares the rows
as it compares results read from the result cache, and builds only the candidates that are to serve again in
this process (a compiler's warm cache and the converters' files make that quick). A worker that dies, runs
out of memory or overruns the candidate time limit gives a ``crashed`` or ``timeout`` row and tuning goes on.

A graph that cannot be sent (the module or a task metric does not pickle) is tuned in this process; a warning
and the graph report's ``executor`` field say so. A worker that cannot start raises :class:`WorkerError`, which
says how to fix it (a script without an ``if __name__ == "__main__":`` guard is the usual cause).
"""

from __future__ import annotations

import copy
import ctypes
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch_tweak.errors import WorkerError
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.executor.base import (
    OUT_OF_MEMORY,
    TIMED_OUT,
    WRONG_HARDWARE,
    Executor,
    Failure,
    Outcome,
    Pending,
    Shared,
)
from torch_tweak.torch.profiling import SweepResult
from torch_tweak.torch.report.report import CandidateReport, GraphReport
from torch_tweak.torch.report.status import CandidateStatus
from torch_tweak.torch.tune_strategy.base import (
    CandidateFailedError,
    GraphTask,
    build_in_cache,
    describe_task,
    release_quietly,
    release_scratch,
)
from torch_tweak.torch.tune_strategy.results import BASELINE, Evaluation, Plan, selection_dict
from torch_tweak.utils import pause, priority

logger = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    """What a worker needs for every candidate of one graph: the strategy's settings and the task."""

    strategy: Any
    task: GraphTask
    #: Built candidates kept in the worker for their full sweep (``keep``), by backend key.
    kept: dict[str, Backend] = field(default_factory=dict)
    #: In the background worker: candidates built ahead of their turn and their build seconds, by backend key.
    built: dict[str, tuple[Backend, float]] = field(default_factory=dict)
    #: Process groups of background builds that the worker's measurements pause (``utils/pause.py``).
    paused: tuple[tuple[int, int], ...] = ()


def evaluate_candidate(context: WorkerContext, template: Backend, role: str, plan: Plan,
                       keep: bool = False) -> tuple[CandidateReport, SweepResult | None]:
    """In the worker: build, check and measure ``template`` like the strategy does in process; release it, or
    with ``keep`` hold it in the context for :func:`sweep_candidate` (screening measured it at two batch sizes).
    In the background worker, the build it made ahead (:func:`build_ahead`) is checked and measured, at the
    worker's normal priority (``utils/priority.py``)."""
    with priority.normal():
        return _evaluate(context, template, role, plan, keep)


def _evaluate(context: WorkerContext, template: Backend, role: str, plan: Plan,
              keep: bool) -> tuple[CandidateReport, SweepResult | None]:
    pause.hold_only(context.paused)
    task = replace(context.task, report=GraphReport(name=context.task.report.name))
    if task.store is not None and not task.store.folder.is_dir():  # another machine: the caller's disk is not here
        logger.warning("%s: the recorded calls in %s are not on this machine; calibrating and judging with the "
                       "in-memory samples only", describe_task(task), task.store.folder)
        task = replace(task, store=None)
    try:
        backend, sweep = context.strategy._build_and_measure(template, task, role, plan, None,
                                                             context.built.pop(template.key(), None))
    except CandidateFailedError as failure:
        return failure.report, None
    if keep:
        set_aside(backend)  # it waits for its sweep
        context.kept[template.key()] = backend
    else:
        release_quietly(backend)
    _return_freed_memory()
    return task.report.candidates[-1], sweep


def set_aside(backend: Backend) -> None:
    """Hold as little of a kept candidate as its next use allows: its runtime deactivated when it loads again from
    its files in about a second (:meth:`Backend.reactivates_quickly`), else only its scratch buffers freed. A
    BERT-base's worker otherwise held two bf16 and two int8 OpenVINO models (2.4 GB with their batch-32 buffers)
    while NNCF and ONNX Runtime's quantizer ran beside them; :func:`take_kept` makes it ready again. Either way its
    shapes count as cold again (``warm_calls.py``): the next measurement warms them up first."""
    release_scratch(backend)
    if backend.reactivates_quickly():
        release_quietly(backend)


def take_kept(context: WorkerContext, key: str) -> Backend | None:
    """The candidate kept under ``key``, active again (None: none kept); it leaves the context."""
    backend = context.kept.pop(key, None)
    if backend is not None:
        backend.ensure_active()
    return backend


def sweep_candidate(context: WorkerContext, template: Backend, role: str, plan: Plan,
                    hold: bool = False) -> SweepResult | None:
    """In the worker: measure ``plan`` on the candidate kept from screening, or build, check and measure it again
    (the worker was replaced since); the candidate is released afterwards, or with ``hold`` kept for the graph's
    head-to-head (``contest.py``), which then serves this build instead of compiling it again."""
    pause.hold_only(context.paused)
    backend = take_kept(context, template.key())
    if backend is None:
        return evaluate_candidate(context, template, role, plan, keep=hold)[1]
    try:
        with priority.normal():
            return context.strategy._measure_backend(backend, context.task, plan, None)
    finally:
        if hold:
            set_aside(backend)
            context.kept[template.key()] = backend
        else:
            release_quietly(backend)
            _return_freed_memory()


def build_ahead(context: WorkerContext, template: Backend) -> float | str | None:
    """In the background worker (``executor/background.py``): build ``template`` as the main worker would in its
    turn (the same module, graph, samples, threads and folder), and keep it for :func:`evaluate_candidate` in its
    turn (:func:`forget_built` releases it if that turn goes to the main worker, whose build then starts from the
    compiler's warm caches on disk). Nothing is checked or measured here. Returns its seconds; without a build,
    when a stand-in rule skips the candidate whatever the others measure (decided here: it runs the module
    eagerly), the rule's reason if it is final, else None."""
    task = context.task
    skipped, reason = context.strategy._skipped_whatever_measured(template, task)
    if skipped:
        return reason
    backend = copy.deepcopy(template)
    start = time.perf_counter()
    try:
        build_in_cache(backend, task, console=False)
    except BaseException:
        release_quietly(backend)
        _return_freed_memory()
        raise
    seconds = time.perf_counter() - start
    context.built[template.key()] = (backend, seconds)
    return seconds


def forget_built(context: WorkerContext, keys: list[str] | None = None) -> None:
    """In the background worker: release the candidates built ahead (their turns went to the main worker, or a
    stand-in rule skips them), those with the backend ``keys`` only when given."""
    for key in list(context.built) if keys is None else keys:
        if (built := context.built.pop(key, None)) is not None:
            release_quietly(built[0])
    _return_freed_memory()


def keep_only(context: WorkerContext, keys: list[str]) -> None:
    """In the worker: release the kept candidates whose keys are not in ``keys`` (screened out, or tuning ended)."""
    for key in [k for k in context.kept if k not in keys]:
        release_quietly(context.kept.pop(key))
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Give the heap memory freed by released candidates back to the system (glibc's ``malloc_trim``): the worker
    builds one candidate after another, and its RSS otherwise keeps what the earlier ones freed (a ResNet-50's 11
    candidates on 2 cores, empty caches: the worker peaked at 2.5 GB with this and with kept candidates' scratch
    released, 2.8 GB without; 1.2 GB against 1.5 GB after the first five). Nothing happens on other C libraries."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return
    trim(0)


def failure_row(template: Backend, role: str, failure: Failure, cache_dir: Path) -> CandidateReport:
    """The report row of a candidate whose worker did not return."""
    status = {TIMED_OUT: CandidateStatus.TIMEOUT, WRONG_HARDWARE: CandidateStatus.SKIPPED}.get(
        failure.kind, CandidateStatus.CRASHED)
    row = CandidateReport(backend=template.describe(), key=template.key(), role=role, status=status,
                          worker=failure.worker)
    log = cache_dir / template.key() / "build.log"
    kind = {TIMED_OUT: "TimeoutError", OUT_OF_MEMORY: "OutOfMemory", WRONG_HARDWARE: "HardwareMismatch"}.get(
        failure.kind, "WorkerCrashed")
    row.error = f"{kind}: {failure.message}"
    if log.is_file():
        row.log_path = str(log)
        row.error += f" (build log: {log})"
    return row


class IsolatedCandidates:
    """Mixed into ``MeasuringStrategy``: opening a graph on an isolated executor and evaluating candidates there."""

    candidate_time_limit_s: float | None
    metric_name: str
    results: list[Any]
    # From MeasuringStrategy: ``_pick(sweep)``.

    def _open_executor(self, task: GraphTask) -> tuple[Executor | None, Shared | None]:
        """The isolated executor and the shared context for ``task``, or ``(None, None)`` to tune in process."""
        executor = task.executor
        if executor is None or not executor.isolated:
            task.report.executor = "inline"
            return None, None
        strategy = copy.copy(self)
        strategy.results = []  # earlier graphs' reports do not travel
        worker_task = replace(task, report=GraphReport(name=task.report.name), executor=None, deadline=None,
                              cache_dir=executor.worker_path(task.cache_dir))
        try:
            shared = executor.share(WorkerContext(strategy, worker_task))
        except WorkerError as exc:
            logger.warning("%s is tuned in this process, not by the %s executor: %s", describe_task(task),
                           executor.name, exc)
            task.report.executor = f"inline: {exc}"
            return None, None
        task.report.executor = executor.describe()
        return executor, shared

    def _submit(self, executor: Executor, shared: Shared, template: Backend, task: GraphTask, role: str,
                plan: Plan, keep: bool = False) -> Pending:
        return executor.submit(shared, evaluate_candidate, (template, role, plan, keep and executor.keeps_state),
                               time_limit_s=self.candidate_time_limit_s,
                               label=f"{describe_task(task)} candidate {template.describe()}")

    def _keep_only(self, executor: Executor, shared: Shared, evaluations: list[Evaluation],
                   task: GraphTask) -> list[str]:
        """Let the worker release the candidates it keeps that are no longer swept (all, when none qualifies);
        returns the keys of those still swept."""
        keys = [e.template.key() for e in evaluations if e.role != BASELINE and e.qualified and e.template is not None]
        if not executor.keeps_state or all(e.row.reused or e.row.worker is None for e in evaluations):
            return keys  # nothing evaluated by a worker here (a rerun that reuses them all starts none for this)
        outcome = executor.submit(shared, keep_only, (keys,), time_limit_s=self.candidate_time_limit_s,
                                  label=f"{describe_task(task)}: releasing screened-out candidates").result()
        if isinstance(outcome, Failure):
            logger.warning("%s: %s", describe_task(task), outcome.message)
        return keys

    def _evaluate_isolated(self, pending: Pending, template: Backend, task: GraphTask, role: str) -> Evaluation:
        """The evaluation of a submitted candidate; its row goes into the graph's report."""
        outcome = pending.result()
        if isinstance(outcome, Failure):
            row = failure_row(template, role, outcome, task.cache_dir)
            task.report.candidates.append(row)
            logger.warning("%s: %s", describe_task(task), row.error)
            return Evaluation(role, row)
        row, sweep = outcome.value
        row.worker = outcome.worker
        task.report.candidates.append(row)
        if sweep is None:
            said = str(row.error)  # "skipped: ..." and "screened out: ..." already say the status
            status = str(getattr(row.status, "value", row.status))
            shown = said if said.startswith(status.replace("_", " ")) else f"{status}: {said}"
            logger.info("%s: %s %s", describe_task(task), row.backend, shown)
            return Evaluation(role, row)
        pick = self._pick(sweep)  # type: ignore[attr-defined]
        row.measurements = sweep.to_dict()
        row.measurements["selection"] = selection_dict(self.metric_name, pick)
        return Evaluation(role, row, None, sweep, pick, reused=True)

    def _sweep_isolated(self, executor: Executor, shared: Shared, evaluation: Evaluation, task: GraphTask,
                        plan: Plan, outcome: Outcome | None = None) -> SweepResult | None:
        """Every batch size of ``plan`` for a screened candidate, in a worker (None: it failed there this time,
        and keeps its screening measurements). ``outcome``: the sweep by the background worker, which kept the
        candidate from its turn (``tune_strategy/ahead.py``); if that failed, the main worker sweeps."""
        assert evaluation.template is not None
        if outcome is None or isinstance(outcome, Failure):
            outcome = executor.submit(shared, sweep_candidate, (evaluation.template, evaluation.role, plan),
                                      time_limit_s=self.candidate_time_limit_s,
                                      label=f"{describe_task(task)} candidate {evaluation.template.describe()}"
                                      ).result()
        if isinstance(outcome, Failure):
            logger.warning("%s: sweeping %s failed: %s", describe_task(task), evaluation.row.backend, outcome.message)
            return None
        sweep = outcome.value
        return sweep if sweep is not None and sweep.measurements else None
