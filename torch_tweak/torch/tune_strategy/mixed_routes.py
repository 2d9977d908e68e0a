"""Batch routes between runtimes, kept only when calls of mixed batch sizes confirm them.

Routes within one runtime follow from the candidates' own sweeps (``routing.py``). A route to another
runtime (ONNX Runtime for small batches, OpenVINO for large ones) looks faster on paper too, but calls that
alternate between runtimes pay for their competing thread pools (ONNX Runtime's threads spin after a call
while OpenVINO's start), which no single-runtime sweep shows. So such a route is measured before it serves:
the proposed router and the single-runtime choice each serve the same cycle of calls, one at every batch
size the chosen candidate was measured at, and each call is timed on its own. The router is kept when, in
that cycle, the calls of the batch sizes it sends elsewhere take the strategy's ``eager_margin`` less time
together and, over all batch sizes, the geometric mean of the per-size speed-ups is at least 1 (a size that
follows a call of the other runtime pays for the switch; the gains must outweigh it). Judging by sizes matters:
summed over the whole cycle, the large batches' time hides what a small batch gains (a batch-1 call 3x
faster is a few percent of a cycle that also runs batch 32). The graph's reason in the report gives the
per-call times either way. A refused proposal is proposed once more without the batch sizes whose calls the routes
did not make ``eager_margin`` faster (within :data:`MAX_PROPOSALS` measured per graph), so that one size's loss does not
cost the others their gain.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.batch_router import BatchRouterBackend
from torch_tweak.torch.executor.base import Executor, Failure, Shared
from torch_tweak.torch.module.spec import GraphSpec, resize_batch
from torch_tweak.torch.profiling import ProfilingConfig, device_sync, percentile
from torch_tweak.torch.report.report import CandidateReport, GraphReport
from torch_tweak.torch.tune_strategy.base import GraphTask, describe_task, release_quietly
from torch_tweak.torch.tune_strategy.graph_probes import MIXED_CALL_TIMES
from torch_tweak.torch.tune_strategy.isolated import WorkerContext, take_kept
from torch_tweak.torch.tune_strategy.results import Evaluation, Plan, unbuilt
from torch_tweak.torch.tune_strategy.routing import Routes, batch_routes, runtime_of, serving_of
from torch_tweak.utils import pause
from torch_tweak.utils.pause import paused

logger = logging.getLogger(__name__)

MIN_CYCLES = 2  # timed cycles of mixed calls per backend, however long one takes
MAX_PROPOSALS = 2  # routes to other runtimes measured on mixed calls, at most, per graph
T = TypeVar("T")


class CallCycle:
    """One call at each of ``sizes`` (the plan's sample resized), in turn, each timed on its own."""

    def __init__(self, spec: GraphSpec, device: torch.device, plan: Plan, sizes: list[int],
                 profiling: ProfilingConfig) -> None:
        sample = copy.deepcopy(plan.sample)
        self.calls = [(size, *(resize_batch(sample, spec, size) if plan.batched else sample)) for size in sizes]
        self.clock, self.sync = profiling.clock, device_sync(device)

    def __call__(self, backend: Backend, record: dict[int, list[float]] | None) -> float:
        """Run the cycle on ``backend``, adding each call's milliseconds to ``record`` (if any); its seconds."""
        clock, serve, begin = self.clock, backend.serving(), self.clock()  # what a tuned module calls (sweeping.py)
        for size, args, kwargs in self.calls:
            start = clock()
            serve(*args, **kwargs)
            if self.sync is not None:
                self.sync()
            if record is not None:
                record[size].append((clock() - start) * 1000.0)
        return clock() - begin


def mixed_call_times(backends: list[Backend], spec: GraphSpec, device: torch.device, plan: Plan, sizes: list[int],
                     profiling: ProfilingConfig) -> list[dict[int, float]]:
    """For each of ``backends``: the median milliseconds of one call at each of ``sizes`` while it serves them in
    turn, cycle after cycle.

    Each backend first runs one untimed cycle; then the backends take turns, one timed cycle each, until
    ``profiling.max_time_s`` has passed (at least :data:`MIN_CYCLES` rounds, at most ``profiling.max_calls``), so
    a drift of the machine's speed falls on all of them alike.
    """
    cycle, clock = CallCycle(spec, device, plan, sizes, profiling), profiling.clock
    times: list[dict[int, list[float]]] = [{size: [] for size in sizes} for _ in backends]
    with torch.no_grad(), paused():
        for backend in backends:
            cycle(backend, None)
        begin, rounds = clock(), 0
        while rounds < MIN_CYCLES or (clock() - begin < profiling.max_time_s and rounds < profiling.max_calls):
            for backend, record in zip(backends, times):
                cycle(backend, record)
            rounds += 1
    return [{size: percentile(values, 50) for size, values in record.items()} for record in times]


def route_verdict(before: dict[int, float], after: dict[int, float], rerouted: set[int],
                  margin: float) -> bool:
    """Whether the router's per-call times ``after`` confirm it against ``before``: the rerouted sizes' calls take
    ``margin`` times less time together, and over every size the router is not slower (the geometric mean of
    the per-size speed-ups is at least 1: a size that follows a call of the other runtime may pay a little for
    the switch, as long as the gains elsewhere outweigh it in ratio, whatever the sizes' absolute times)."""
    faster = sum(before[size] for size in rerouted) >= margin * sum(after[size] for size in rerouted)
    logs = [math.log(before[size] / after[size]) for size in before if before[size] > 0 and after[size] > 0]
    return faster and bool(logs) and sum(logs) >= 0.0


def _times(values: dict[int, float]) -> str:
    return "/".join(f"{values[size]:.3g}" for size in sorted(values))


def _serving(routes: Routes | None, chosen: Evaluation, spec: GraphSpec) -> Backend:
    if routes is None:
        assert chosen.backend is not None
        return chosen.backend
    return BatchRouterBackend([(bound, e.backend) for bound, e in routes], spec)  # type: ignore[misc]


class MixedRoutes:
    """Mixed into ``MeasuringStrategy``: routes to other runtimes, proposed and then measured on mixed calls."""

    eager_margin: float
    profiling: ProfilingConfig
    # From MeasuringStrategy and its mixins: ``_rebuild``.

    def _routes_across_runtimes(self: Any, task: GraphTask, chosen: Evaluation, evaluations: list[Evaluation],
                                routes: Routes | None, plan: Plan, executor: Executor | None = None,
                                shared: Shared | None = None) -> tuple[Routes | None, str]:
        """``routes`` or routes that cross runtimes where mixed calls confirm them, and what the reason adds.

        Each other runtime is proposed on its own (a router over three runtimes pays for two foreign thread
        pools), the one its candidates' sweeps promise to save the most time first; at most
        :data:`MAX_PROPOSALS` are measured. With an isolated ``executor``, its worker builds and times them
        (:func:`time_routes`): this process builds only a router it keeps.
        """
        margin = 1.0 + self.eager_margin
        if not plan.batched:
            return routes, ""
        proposals = _proposals(chosen, evaluations, routes, margin)
        notes: list[str] = []
        lost: set[tuple[int, int]] = set()
        for _ in range(MAX_PROPOSALS):
            if not proposals:
                break
            proposal = proposals.pop(0)
            kept, note, slower = self._try_proposal(task, chosen, routes, proposal, plan, margin, executor, shared)
            notes.append(note)
            if kept:
                return proposal, "".join(notes)
            lost |= slower
            narrower = _narrowed(chosen, evaluations, margin, proposal, lost) if slower else None
            if narrower is not None:
                proposals.insert(0, narrower)
        return routes, "".join(notes)

    def _try_proposal(self: Any, task: GraphTask, chosen: Evaluation, routes: Routes | None, proposal: Routes,
                      plan: Plan, margin: float, executor: Executor | None,
                      shared: Shared | None) -> tuple[bool, str, set[tuple[int, int]]]:
        """Measure ``proposal`` against ``routes`` on mixed calls: whether it is kept, what the reason adds, and the
        ``(id(candidate), batch size)`` pairs of another runtime whose calls there were not ``margin`` times faster."""
        serving = serving_of(chosen, routes)
        others = sorted({e.row.backend for _, e in proposal if runtime_of(e) != runtime_of(chosen)})
        built_now = unbuilt(e for _, e in proposal)
        assert chosen.sweep is not None
        sizes = [m.batch_size for m in chosen.sweep.measurements if m.batched]
        timing_key = _timing_key(routes, proposal, chosen, sizes)
        stored = _stored_times(task.probed.get(MIXED_CALL_TIMES), timing_key, sizes)
        if stored is not None:  # timed by an earlier run on the same reused results: it decides as that one did
            before, after = stored
        elif executor is not None and shared is not None:
            outcome = executor.submit(shared, time_routes, ([sent(routes, chosen), sent(proposal, chosen)], sizes,
                                                            plan), time_limit_s=self.candidate_time_limit_s,
                                      label=f"{describe_task(task)}: routes to {', '.join(others)}").result()
            if isinstance(outcome, Failure):
                return False, f"; routes to {', '.join(others)} were not tried (timing them failed: {outcome.message})", set()
            before, after = outcome.value
        else:
            for evaluation in built_now:
                if not self._rebuild(task, evaluation):
                    return False, f"; a route to {evaluation.row.backend} was not tried (building it here failed)", set()
            current, proposed = _serving(routes, chosen, task.graph_spec), _serving(proposal, chosen, task.graph_spec)
            before, after = mixed_call_times([current, proposed], task.graph_spec, task.device, plan, sizes,
                                             self.profiling)
            for component in {id(c): c for c in (*current.components(), *proposed.components())}.values():
                component.release_scratch()  # every size's buffers in every backend of both: serving needs fewer
        if not isinstance(task.probed.get(MIXED_CALL_TIMES), dict):
            task.probed[MIXED_CALL_TIMES] = {}
        task.probed[MIXED_CALL_TIMES][timing_key] = [before, after]
        rerouted = {size for size in sizes if _route_at(proposal, size) is not _route_at(routes, size, chosen)}
        cycle = (f"one call at each batch size {sizes} in turn, p50 ms per call: {_times(after)} with the routes vs "
                 f"{_times(before)} without")
        if route_verdict(before, after, rerouted, margin):
            for evaluation in unbuilt(e for _, e in proposal):  # measured by the worker: built here to serve
                if not self._rebuild(task, evaluation):
                    return False, f"; a route to {evaluation.row.backend} was not kept (building it here failed)", set()
            logger.info("%s: routes to %s confirmed on mixed calls (%s)", describe_task(task), others, cycle)
            return True, f"; routes to another runtime ({', '.join(others)}) confirmed on mixed calls ({cycle})", set()
        for evaluation in built_now:
            if all(evaluation is not e for e in serving) and evaluation.backend is not None:
                release_quietly(evaluation.backend)
                evaluation.backend = None
        logger.info("%s: routes to %s not kept: mixed calls did not confirm them (%s)", describe_task(task), others,
                    cycle)
        slower = {(id(e), size) for size in rerouted if (e := _route_at(proposal, size)) is not None
                  and runtime_of(e) != runtime_of(chosen) and after[size] * margin > before[size]}
        return False, (f"; routes to another runtime ({', '.join(others)}) were measured on mixed calls and not "
                       f"kept ({cycle}; the rerouted batch sizes need {margin:.2f}x less time together, and the "
                       "speed-ups of all batch sizes a geometric mean of at least 1)"), slower


Sent = list[tuple[int | None, Backend, str, CandidateReport]]


def _timing_key(routes: Routes | None, proposal: Routes, chosen: Evaluation, sizes: list[int]) -> str:
    """What a mixed-call timing of ``proposal`` against ``routes`` measured: both routings and the batch sizes."""
    routings = [[(bound, template.key(), role) for bound, template, role, _ in sent(r, chosen)]
                for r in (routes, proposal)]
    return json.dumps([routings, sizes])


def _stored_times(stored: Any, key: str, sizes: list[int]) -> tuple[dict[int, float], dict[int, float]] | None:
    """The per-size times ``before, after`` of ``sizes`` an earlier run kept under ``key`` (None: none, or
    malformed)."""
    pair = stored.get(key) if isinstance(stored, dict) else None
    if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(times, dict) for times in pair):
        return None
    try:
        before, after = ({int(size): float(ms) for size, ms in times.items()} for times in pair)
    except (TypeError, ValueError):
        return None
    return (before, after) if set(before) == set(after) == set(sizes) else None


def sent(routes: Routes | None, chosen: Evaluation) -> Sent:
    """What a worker needs to build ``routes`` (or ``chosen`` alone) again: bound, template, role, judged row."""
    pairs = [(None, chosen)] if routes is None else routes
    return [(bound, e.template, e.role, e.row) for bound, e in pairs]  # type: ignore[misc]


def serve_in_worker(context: WorkerContext, routings: list[Sent], time: Callable[[list[Backend]], T]) -> T:
    """In the worker: build each routing's candidates again (confirmed as a rebuild is; a build the worker holds
    from its sweep serves as it is), serve each routing (a router, or its one candidate) and return what ``time``
    measures on those servings; all are released."""
    strategy, task = context.strategy, context.task
    pause.hold_only(context.paused)
    built: dict[str, Backend] = {}
    try:
        servings: list[Backend] = []
        for routing in routings:
            for _, template, role, row in routing:
                if template.key() not in built and template.key() in context.kept:
                    built[template.key()] = take_kept(context, template.key())  # type: ignore[assignment]
                elif template.key() not in built:
                    private = replace(task, report=GraphReport(name=task.report.name))
                    built[template.key()], rebuilt = strategy.try_backend(template, private, role, confirm=True,
                                                                          judged=row)
                    logger.debug("%s: %s built again to be served in turns in %.1f s", describe_task(task),
                                 rebuilt.backend, rebuilt.build_time_s or 0.0)
            backends = [(bound, built[template.key()]) for bound, template, _, _ in routing]
            servings.append(backends[0][1] if len(backends) == 1 else
                            BatchRouterBackend(backends, task.graph_spec))  # type: ignore[arg-type]
        return time(servings)
    finally:
        for backend in built.values():
            release_quietly(backend)


def time_routes(context: WorkerContext, routings: list[Sent], sizes: list[int], plan: Plan) -> list[dict[int, float]]:
    """In the worker: serve each routing and time them on mixed calls (:func:`mixed_call_times`)."""
    task = context.task
    return serve_in_worker(context, routings, lambda servings: mixed_call_times(
        servings, task.graph_spec, task.device, plan, sizes, context.strategy.profiling))


def _proposals(chosen: Evaluation, evaluations: list[Evaluation], routes: Routes | None, margin: float) -> list[Routes]:
    """One proposal per other runtime with a faster candidate somewhere, the largest time saved on paper first."""
    own = runtime_of(chosen)
    others = sorted({runtime_of(e) for e in evaluations if e.sweep is not None and e.template is not None} - {own})
    found = []
    for runtime in others:
        proposal = batch_routes(chosen, evaluations, margin, other_runtime=runtime)
        if proposal is not None and any(runtime_of(e) == runtime for _, e in proposal):
            found.append((_saved_ms(chosen, routes, proposal), proposal))
    return [proposal for _, proposal in sorted(found, key=lambda pair: -pair[0])]


def _narrowed(chosen: Evaluation, evaluations: list[Evaluation], margin: float, proposal: Routes,
              lost: set[tuple[int, int]]) -> Routes | None:
    """``proposal``'s runtime proposed again without the ``(id(candidate), batch size)`` pairs mixed calls found no
    faster (``lost``), or None when nothing of that runtime is left: a CNN on Sapphire Rapids whose batch 1 ran
    1.08x faster on ONNX Runtime in mixed calls and batch 2 and 4 slower (batch 2: 100 against 64 ms, where its
    sweep had measured 61 ms) had all three routes refused together."""
    runtime = next((runtime_of(e) for _, e in proposal if runtime_of(e) != runtime_of(chosen)), None)
    narrower = None if runtime is None else batch_routes(chosen, evaluations, margin, other_runtime=runtime,
                                                         refused=frozenset(lost))
    return narrower if narrower is not None and any(runtime_of(e) == runtime for _, e in narrower) else None


def _saved_ms(chosen: Evaluation, routes: Routes | None, proposal: Routes) -> float:
    """Milliseconds a cycle of one call at each of the chosen candidate's batch sizes saves on paper (sweeps)."""
    assert chosen.sweep is not None
    saved = 0.0
    for m in chosen.sweep.measurements:
        now, then = _route_at(routes, m.batch_size, chosen), _route_at(proposal, m.batch_size)
        speeds = [e.sweep.at(m.batch_size) if e is not None and e.sweep is not None else None for e in (now, then)]
        if speeds[0] is not None and speeds[1] is not None:
            saved += m.batch_size * 1000.0 * (1.0 / speeds[0].throughput - 1.0 / speeds[1].throughput)
    return saved


def _route_at(routes: Routes | None, size: int, default: Evaluation | None = None) -> Evaluation | None:
    """The evaluation that serves ``size`` under ``routes`` (``default`` when there are none)."""
    if routes is None:
        return default
    return next(e for bound, e in routes if bound is None or size <= bound)
