"""Slow-to-compile candidates built ahead of their turn, in the executor's background worker.

Why: Inductor and TorchAO compile for 40-100 s on a 2-core machine, and the candidates before them (OpenVINO,
ONNX Runtime) leave a core idle for much of their builds. When a graph's tuning starts on a process executor,
the candidates whose :meth:`~torch_tweak.torch.backend.Backend.compiles_ahead` is True are built in its
background worker (``executor/background.py``) at the lowest priority, paused whenever anything is timed, in
the order of their turns (the main worker reaches the first one first; building the last turn first had a BERT-base
wait 32 s for Inductor while the background decided, over 37 s under contention, to skip TorchAO). In its turn
the candidate is checked and measured by the background worker on the build it made, while the main worker
idles (compiling it again there took Inductor 13-25 s on a ResNet-50), and swept there if screening keeps it;
when the background worker has gone on to its next build by then, the main worker builds, checks and measures
the candidate as every other, from the compiler's caches the background build warmed on disk. A build swept there
stays until the graph's head-to-head, which then runs in the background worker on it (``contest.py``): the main
worker would compile it again (an Inductor BERT-base: 22.8 s).

Not built ahead: candidates whose results the result cache already has (and none at all when the results of
every converting candidate, OpenVINO, ONNX Runtime and eager, are reused, or stored results of their every-core
twins skip them: there is nothing to overlap; a BERT-base rerun started and stopped a background worker for builds
the stand-in rules then skipped), and those a stand-in rule skips whatever the others measure (TorchAO on a graph
whose ``nn.Linear`` layers do almost nothing; the background worker decides that, as it runs the module). In a candidate's turn the strategy waits for its background build
if that has started, drops it if it has not (the candidate is then built in its turn from scratch), and drops
it when a stand-in rule skips the candidate. What a background build does not finish (a failure, a crash, its
time limit) costs only its head start: the build in turn reports what goes wrong.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.executor.base import TIMED_OUT, Background, Executor, Failure, Finished, Outcome, Pending, Shared
from torch_tweak.torch.tune_strategy.base import GraphTask, describe_task
from torch_tweak.torch.tune_strategy.isolated import (
    build_ahead,
    evaluate_candidate,
    forget_built,
    keep_only,
    sweep_candidate,
)
from torch_tweak.torch.tune_strategy.result_cache import ResultCache
from torch_tweak.torch.tune_strategy.results import BASELINE, Evaluation, Plan
from torch_tweak.torch.tune_strategy.twins import thread_limited_reason
from torch_tweak.utils import pause

logger = logging.getLogger(__name__)


class BuildsAhead:
    """The background builds of one graph's candidates, by backend key."""

    def __init__(self, background: Background, shared: Shared, tickets: dict[str, int], task: GraphTask,
                 time_limit_s: float | None, hold_swept: bool = False) -> None:
        self._background = background
        self._shared = shared
        self._tickets = tickets
        self._task = task
        self._time_limit_s = time_limit_s
        self._kept: set[str] = set()  # keys of candidates the background worker keeps for their sweep
        self._hold_swept = hold_swept  # keep them after it too, for the graph's head-to-head
        self._held: set[str] = set()  # keys of candidates it keeps after their sweep (or full evaluation) there
        self.group = background.group
        if self.group is not None:
            pause.hold([self.group])  # this process's timed calls pause it too

    def take_turn(self, template: Backend, role: str, plan: Plan, keep: bool) -> str | Pending | None:
        """In ``template``'s turn: wait for its background build if that has started (drop it if it has not).

        Returns the reason a stand-in rule skips the candidate when the background worker decided that for good
        (its int8 probe: timed there in process CPU time too, which neither a pause nor a busy core inflates);
        the candidate's evaluation (:func:`evaluate_candidate`, ``keep`` as there; a build measured on the full plan is
        kept too when the strategy holds head-to-heads, which then serve it) by the background worker on the build it
        made, when that worker has nothing else running (the main worker idles meanwhile); or None: the
        main worker builds, checks and measures it, its build starting from the compiler's warm caches.

        After an evaluation there, the background worker starts its next build only in a turn the main worker
        takes (or one skipped): until then it keeps what it may sweep, which stopping a build would lose (the next
        turn is often a candidate built ahead that a stand-in rule skips on this one's measurements)."""
        ticket = self._tickets.pop(template.key(), None)
        background, name = self._background, template.describe()
        if ticket is None or not background.started(ticket):
            if ticket is not None:
                background.drop(ticket)
            background.resume()  # the main worker takes the turn: the background builds the next ones meanwhile
            return None
        start = time.perf_counter()
        outcome = background.wait(ticket, self._time_limit_s, hold=True)  # its next unit waits for the turn
        waited = time.perf_counter() - start
        if isinstance(outcome, Failure) or outcome.value is None or isinstance(outcome.value, str):
            background.resume()
            if isinstance(outcome, Failure):
                logger.info("%s: %s was not built ahead (%s); it is built in its turn", describe_task(self._task),
                            name, outcome.message)
                return None
            logger.debug("%s: %s was not built ahead: a stand-in rule skips it", describe_task(self._task), name)
            return outcome.value  # type: ignore[no-any-return]
        built = f"{name} was built ahead in the background in {outcome.value:.1f} s (waited {waited:.1f} s for it now)"
        if background.busy(ticket):  # it went on to the next build: this one would wait for that
            self._forget_built()
            background.resume()
            logger.info("%s: %s; the main worker builds it again in its turn, from the compiler's warm caches",
                        describe_task(self._task), built)
            return None
        hold = keep or self._hold_swept  # a full plan measured there: the build serves the head-to-head too
        evaluation = background.start(self._shared, evaluate_candidate, (template, role, plan, hold),
                                      f"{describe_task(self._task)} candidate {name}", first=True)
        background.resume()
        evaluated = background.wait(evaluation, self._time_limit_s, hold=True)
        if isinstance(evaluated, Failure) and evaluated.kind != TIMED_OUT:
            background.resume()
            logger.info("%s: %s; checking and measuring it there failed (%s), so the main worker evaluates it",
                        describe_task(self._task), built, evaluated.message)
            return None
        logger.info("%s: %s, and checked and measured there in its turn", describe_task(self._task), built)
        if keep:
            self._kept.add(template.key())
        elif hold and not isinstance(evaluated, Failure) and evaluated.value[1] is not None:
            self._held.add(template.key())
        return Finished(evaluated)

    def sweep(self, template: Backend, role: str, plan: Plan) -> Outcome | None:
        """The sweep of ``plan`` by the background worker when it keeps ``template`` from its turn, else None."""
        if template.key() not in self._kept:
            return None
        self._kept.discard(template.key())
        outcome = self.run(sweep_candidate, (template, role, plan, self._hold_swept),
                           f"{describe_task(self._task)} candidate {template.describe()}")
        if self._hold_swept and not isinstance(outcome, Failure):
            self._held.add(template.key())
        return outcome

    def holds(self, keys: list[str]) -> bool:
        """Whether the background worker still holds a swept build of one of ``keys`` (and is alive to serve it)."""
        return self._background.group is not None and any(key in self._held for key in keys)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], label: str) -> Outcome:
        """Run ``fn(context, *args)`` in the background worker before anything queued there, and wait for it."""
        ticket = self._background.start(self._shared, fn, args, label, first=True)
        self._background.resume()
        return self._background.wait(ticket, self._time_limit_s, hold=True)

    def keep_only(self, keys: list[str]) -> None:
        """Let the background worker release the candidates it keeps whose keys are not in ``keys``."""
        if self._kept - set(keys):
            self._kept &= set(keys)
            self._background.start(self._shared, keep_only, (keys,), f"{describe_task(self._task)}: releasing",
                                   first=True)

    def pending(self, template: Backend) -> bool:
        """Whether ``template``'s background build is queued, running or done and not yet taken in its turn."""
        return template.key() in self._tickets

    def stop(self, template: Backend) -> bool:
        """A stand-in rule skips ``template`` before its turn: its background build is dropped now (dequeued,
        released, or stopped while it runs), unless stopping it would kill the worker with another build queued or
        kept there; it then runs on and its turn drops it (:meth:`skipped`). Queued units stay held. Returns
        whether it was dropped. (A new background worker for the builds queued behind was tried and not kept: its
        start and its paused lowest-priority build made an MLP's Inductor turn wait 17-18 s, where the main worker
        built it in 16 s; ``docs/benchmark_history.md``, 2026-12-07.)"""
        ticket = self._tickets.get(template.key())
        running = ticket is not None and self._background.running(ticket)
        if ticket is None or (running and (self._kept or len(self._tickets) > 1)):
            return False
        del self._tickets[template.key()]
        built = not running and self._background.started(ticket)
        self._background.drop(ticket)
        if built:
            self._forget_built([template.key()])
        return True

    def skipped(self, template: Backend) -> None:
        """``template`` will not be built: its background build is dropped (a running one is stopped)."""
        ticket = self._tickets.pop(template.key(), None)
        if ticket is not None:
            self._background.drop(ticket)
            self._forget_built([template.key()])  # in case it was built already
        self._background.resume()

    def _forget_built(self, keys: list[str] | None = None) -> None:
        """Let the background worker release its builds made ahead (those of ``keys`` only, when given), before its
        next unit."""
        self._background.start(self._shared, forget_built, (keys,), f"{describe_task(self._task)}: releasing builds",
                               first=True)

    def close(self) -> None:
        """Stop the background worker (tuning of the graph ended, or failed)."""
        self._background.close()
        if self.group is not None:
            pause.release([self.group])


def start_builds_ahead(strategy: Any, task: GraphTask, executor: Executor | None, shared: Shared | None,
                       cache: ResultCache | None) -> BuildsAhead | None:
    """Queue the graph's slow-to-compile candidates in the executor's background worker (None: nothing to build
    ahead, or the executor has no background worker)."""
    if executor is None or shared is None:
        return None
    unbuilt = [(t, role) for t, role in strategy._templates(task)
               if cache is None or (cache.load(cache.key(t, role)) is None and not _twin_skips(t, role, cache))]
    if not any(type(t).rebuilds_from_files for t, _ in unbuilt):  # no conversion to overlap (OpenVINO, ONNX
        return None  # Runtime and eager results reused): a background worker would only compete with the rest
    # (asked after that: TorchAO's answer imports Inductor, 3-7 s, which a rerun that reuses every result skips)
    templates = [t for t, role in unbuilt if role != BASELINE and t.compiles_ahead()]
    background = executor.background() if templates else None
    if background is None:
        return None
    tickets: dict[str, int] = {}
    try:
        for template in templates:  # in turn order: the earliest turn is the earliest one waited for
            tickets[template.key()] = background.start(shared, build_ahead, (template,),
                                                       f"{describe_task(task)}: building {template.describe()} ahead")
    except OSError as exc:  # no background worker: every candidate is built in its turn
        logger.info("%s: no background builds (%s)", describe_task(task), exc)
        background.close()
        return None
    ahead = BuildsAhead(background, shared, tickets, task, strategy.candidate_time_limit_s,
                        hold_swept=bool(getattr(strategy, "_contested", False)))
    if ahead.group is None:  # no /proc to tell the worker's start time: its group could not be paused safely
        logger.info("%s: no background builds (this system does not show process start times)", describe_task(task))
        ahead.close()
        return None
    shared.context.paused = (ahead.group,)  # sent to the main worker with its first unit
    logger.info("%s: building %s ahead in a background worker", describe_task(task),
                ", ".join(t.describe() for t in templates))
    return ahead


def _twin_skips(template: Backend, role: str, cache: ResultCache) -> bool:
    """Whether the stored result of ``template``'s every-core twin already skips it (``twins.py``): then it is never
    built, and a rerun needs no background worker for its sake."""
    twin = template.every_core_twin()
    stored = None if twin is None else cache.load(cache.key(twin, role))
    if twin is None or stored is None:
        return False
    row, sweep = stored
    return thread_limited_reason(twin, [Evaluation(role, row, None, sweep, template=twin, reused=True)]) is not None
