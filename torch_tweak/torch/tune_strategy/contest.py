"""A head-to-head of the best candidate and its close runners-up, timed in turns, before the choice is final.

Why: each candidate is measured in a block of its own, and on a long tuning run those blocks lie minutes apart.
On a shared machine the speed drifts in that time (a 2-core VM served the same ONNX Runtime session of a
ResNet-50 at 37 and at 25 samples/s an hour apart), and at a large batch of a slow graph a block holds one or
two calls, so the sweeps can order two candidates that are level, or even the wrong way round. So before the
choice is final, the best candidate and up to :data:`MAX_RIVALS` others whose score came within
:data:`CONTEST_WITHIN` of it are served again and timed in turns: :data:`ROUNDS` blocks each, the order rotating
from round to round, each at every batch size a sweep judged one of them by (a throughput scored at its best of
them). A drift then falls on all of them alike.
A rival replaces the best only when it beats it in turns by :data:`MIN_WIN` on the strategy's metric. The
graph's reason in the report gives the times either way; the result cache keeps them, so a rerun that reuses
the measurements decides alike without timing anything.

The last round is left out when it cannot change the outcome (``contest_outcome.py``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.executor.base import Executor, Failure, Shared
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.profiling import ProfilingConfig, percentile
from torch_tweak.torch.tune_strategy.base import GraphTask, describe_task
from torch_tweak.torch.tune_strategy.contest_outcome import MIN_WIN, Outcome, Times, median_ranges
from torch_tweak.torch.tune_strategy.contest_outcome import beats as _beats
from torch_tweak.torch.tune_strategy.contest_outcome import factor as _factor
from torch_tweak.torch.tune_strategy.graph_probes import CONTEST_TIMES
from torch_tweak.torch.tune_strategy.isolated import WorkerContext
from torch_tweak.torch.tune_strategy.mixed_routes import CallCycle, Sent, sent, serve_in_worker
from torch_tweak.torch.tune_strategy.results import BASELINE, Evaluation, Plan
from torch_tweak.torch.tune_strategy.routing import Routes, batch_routes
from torch_tweak.utils import priority
from torch_tweak.utils.pause import paused

if TYPE_CHECKING:
    from torch_tweak.torch.tune_strategy.ahead import BuildsAhead

logger = logging.getLogger(__name__)

CONTEST_WITHIN = 1.5  # rivals whose score the best beat by less than this factor are timed in turns with it
MAX_RIVALS = 2  # at most this many rivals (the closest), so a contest costs a few blocks per candidate
ROUNDS = 3  # timed blocks per contender
_WARM_CYCLE_MAX_S = 0.05  # a block starts with an untimed cycle when one takes less (switching costs show there)
#: Seconds each block waits first (at most ``ProfilingConfig.pause_s``), so the previous block's runtime's threads go
#: idle: ONNX Runtime's spin for a while after a call, and a BERT-base's OpenVINO call at batch 1 that followed one
#: took 168 against 145 ms (8 pairs each, 2-vCPU EPYC), and 145 ms after a 50 ms pause. An untimed cycle of short
#: calls ends long before such threads do.
BLOCK_PAUSE_S = 0.05


def contest_times(backends: list[Backend], spec: GraphSpec, device: torch.device, plan: Plan,
                  sizes: Sequence[Sequence[int]], profiling: ProfilingConfig,
                  needed: Callable[[Times, Times], list[bool]] | None = None) -> Times:
    """For each of ``backends``: the median milliseconds of one call at each of its ``sizes`` (one list per backend),
    timed in up to :data:`ROUNDS` rounds of blocks, one block per backend and round, the order rotating from round to
    round.

    A backend's first block runs cycles of one call at each of its sizes for ``profiling.max_time_s`` (at least one
    cycle), or until it has made :func:`block_cycles` of them, and its later blocks make as many cycles: all blocks
    of a contender together make as many calls per size as one sweep measurement at most, so that short calls are
    not timed for seconds (an MLP 256-512-256 spent 5 of its 30 s of tuning in three 0.5 s blocks of 40 µs calls per
    contender). Each block starts after a pause of :data:`BLOCK_PAUSE_S` (the previous backend's threads going idle)
    and, when a cycle is short, with an untimed cycle (cold caches), so neither falls on a timed call. After each
    round but the last, ``needed(lowest, highest)`` gets the range each median can still reach
    (:func:`median_ranges`) and says whose further blocks can still change the outcome: the others' blocks are left
    out (an eager gate settled while the winner is not: eager, the slowest, no longer runs), and the rounds left once
    no one's can.
    """
    made: dict[tuple[int, ...], CallCycle] = {}  # contenders timed at the same sizes share their inputs
    cycles = []
    for own in sizes:
        if tuple(own) not in made:
            made[tuple(own)] = CallCycle(spec, device, plan, list(own), profiling)
        cycles.append(made[tuple(own)])
    clock = profiling.clock
    times: list[dict[int, list[float]]] = [{size: [] for size in own} for own in sizes]
    most = block_cycles(profiling)
    settle = min(BLOCK_PAUSE_S, profiling.pause_s)
    with torch.no_grad(), paused():
        short = [cycle(backend, None) < _WARM_CYCLE_MAX_S  # also the warm-up
                 for cycle, backend in zip(cycles, backends, strict=True)]
        counts: list[int] = []  # cycles per block, as each contender's first block made them
        going = [True] * len(backends)  # whose blocks can still change the outcome
        for r in range(ROUNDS):
            for i in [(r + j) % len(backends) for j in range(len(backends))]:
                if not going[i]:
                    continue
                if settle > 0:
                    time.sleep(settle)
                if short[i]:
                    cycles[i](backends[i], None)
                begin, made_here = clock(), 0
                while True:
                    cycles[i](backends[i], times[i])
                    made_here += 1
                    if r and made_here >= counts[i]:
                        break
                    if not r and (made_here >= most or clock() - begin >= profiling.max_time_s):
                        break
                if not r:
                    counts.append(made_here)
            left = ROUNDS - 1 - r
            if needed is not None and left:
                more = [c * left if on else 0 for c, on in zip(counts, going, strict=True)]
                going = [on and still for on, still in zip(going, needed(*median_ranges(times, more)), strict=True)]
                if not any(going):
                    logger.debug("head-to-head: %d of %d rounds; the rest could not change the outcome", r + 1, ROUNDS)
                    break
    return [{size: percentile(values, 50) for size, values in record.items()} for record in times]


def block_cycles(profiling: ProfilingConfig) -> int:
    """The most cycles one block of a contest makes: ``profiling.max_calls`` shared by the :data:`ROUNDS` blocks."""
    return max(1, -(-profiling.max_calls // ROUNDS))


def time_contest(context: WorkerContext, contenders: list[Sent], sizes: list[list[int]],
                 plan: Plan, decides: Outcome | None = None) -> Times:
    """In the worker: build the contenders again (or serve those it holds) and time them in turns
    (:func:`contest_times`, until what it ``decides`` is settled); the background worker does so at its normal priority."""
    task, strategy = context.task, context.strategy
    needed = decides.rule(strategy._contest_score) if decides is not None else None
    with priority.normal():
        return serve_in_worker(context, contenders, lambda servings: contest_times(
            servings, task.graph_spec, task.device, plan, sizes, strategy.profiling, needed))


class Contests:
    """Mixed into ``MeasuringStrategy``: the head-to-head of close contenders before a graph's choice."""

    candidate_time_limit_s: float | None
    eager_margin: float
    profiling: ProfilingConfig
    #: Whether the strategy holds contests (not when its metric needs more than a median per size, a p99 say).
    _contested = False
    # From MeasuringStrategy and its mixins: ``_best``, ``_speedup``, ``_rebuild``.

    def _contest_score(self, times: dict[int, float]) -> float:
        """The strategy's score (higher is better) of per-size milliseconds per call measured in turns."""
        raise NotImplementedError

    def _contest(self: Any, task: GraphTask, evaluations: list[Evaluation], plan: Plan,
                 executor: Executor | None, shared: Shared | None,
                 ahead: BuildsAhead | None = None) -> tuple[Evaluation | None, str, float | None]:
        """The best candidate after a head-to-head with its close rivals (or the sweeps' best when there are none),
        what the graph's reason adds, and the winner's speed-up over eager timed in turns (None: eager was not).

        Eager joins when the sweeps put the best's speed-up over eager within :data:`CONTEST_WITHIN` of the eager
        gate's ``1 + eager_margin`` either way, so the gate decides on calls timed in turns too: a BERT-base's
        sweeps put eager at 7.1/s and ONNX Runtime at 7.0/s at batch 8, measured minutes apart, and eager kept
        batch 8, which served at 5.0/s against ONNX Runtime's 5.9/s when the two alternated. When the background
        worker still holds a contender it built and measured, the head-to-head runs there, on that build (an
        Inductor BERT-base compiled again from the compiler's caches took 22.8 s in the main worker; the OpenVINO
        and ONNX Runtime contenders load in about 1 s)."""
        best = self._best(evaluations)
        if best is None or not self._contested:
            return best, "", None
        rivals = sorted((e for e in evaluations if e is not best and e.role != BASELINE and e.qualified
                         and e.template is not None and self._speedup(best.pick, e.pick) < CONTEST_WITHIN),
                        key=lambda e: self._speedup(best.pick, e.pick))[:MAX_RIVALS]
        gate = 1.0 + self.eager_margin  # eager joins where the sweeps' verdict of the eager gate is a close one
        eager = next((e for e in evaluations if e.role == BASELINE and e.qualified and e.template is not None
                      and gate / CONTEST_WITHIN < self._speedup(best.pick, e.pick) < gate * CONTEST_WITHIN), None)
        if not (rivals or eager) or best.template is None:
            return best, "", None
        contenders = [best, *rivals, *([eager] if eager is not None else [])]
        # every candidate at each candidate's judged size: a sweep slowed at the largest size by noise judges its
        # candidate at a smaller one, where a batch's calls pay more per sample (an int8 MLP on two threads at
        # batch 16 lost to its one-thread twin at 32, and served 1.25x faster than it at 32); eager adds its own
        picks = sorted({e.pick.batch_size for e in contenders if e is not eager})  # type: ignore[union-attr]
        sizes = [sorted({*picks, e.pick.batch_size}) if e is eager else picks for e in contenders]  # type: ignore
        names = ", ".join(e.row.backend for e in contenders[1:])
        decides = Outcome(rivals=len(rivals), gate=gate if eager is not None else None)
        times = self._time_in_turns(task, contenders, sizes, plan, executor, shared, f"head-to-head with {names}",
                                    decides, ahead)
        if isinstance(times, str):
            return best, f"; a head-to-head with {names} was not run ({times})", None
        scores = [self._contest_score(t) for t in times]
        at, verdict = 0, ""  # the winner's index
        if rivals:
            top = max(range(1, len(rivals) + 1), key=lambda i: scores[i])
            won = _beats(scores[top], scores[0])
            at = top if won else 0
            verdict = (f"{contenders[top].row.backend} won, by {_factor(scores[top], scores[0]):.2f}x" if won else
                       f"{best.row.backend} kept (a rival must win by {MIN_WIN:.2f}x)")
        winner = contenders[at]
        versus_eager = _factor(scores[at], scores[-1]) if eager is not None else None
        if versus_eager is not None:
            verdict += ("; " if verdict else "") + f"{winner.row.backend} {versus_eager:.2f}x eager in turns"
        per_call = "; ".join(f"{e.row.backend} {_per_size(t, own)} at batch {'/'.join(map(str, own))}"
                             for e, t, own in zip(contenders, times, sizes, strict=True))
        note = (f"; timed in turns with {names} (up to {ROUNDS} rounds, p50 ms per call at the batch sizes the sweeps "
                f"judged them by: {per_call}): {verdict}")
        logger.info("%s: head-to-head%s", describe_task(task), note[1:])
        return winner, note, versus_eager

    def _time_in_turns(self: Any, task: GraphTask, contenders: list[Evaluation], sizes: list[list[int]], plan: Plan,
                       executor: Executor | None, shared: Shared | None, what: str, decides: Outcome,
                       ahead: BuildsAhead | None = None) -> Times | str:
        """Per contender, the p50 ms of one call at each of its ``sizes`` timed in turns (:func:`contest_times`, in
        rounds until what it ``decides`` is settled): as an earlier run on the same reused results stored them, in
        the background worker when it holds a contender's build (``ahead``), in the worker, or here; or why they were
        not timed."""
        key = json.dumps([[(_identity(e), e.role) for e in contenders], sizes])
        stored = _stored(task.probed.get(CONTEST_TIMES), key, sizes)
        if stored is not None:  # timed by an earlier run on the same reused results: it decides as that one did
            times = stored
        elif executor is not None and shared is not None:
            if any(e.template is None for e in contenders):
                return "a contender has no template to build it again in the worker"
            args, label = ([sent(None, e) for e in contenders], sizes, plan, decides), f"{describe_task(task)}: {what}"
            outcome = None
            if ahead is not None and ahead.holds([_identity(e) for e in contenders]):
                outcome = ahead.run(time_contest, args, label)
                if isinstance(outcome, Failure):
                    logger.info("%s: timing the %s in the background worker failed (%s); the worker times it",
                                describe_task(task), what, outcome.message)
                    outcome = None
            if outcome is None:
                outcome = executor.submit(shared, time_contest, args, time_limit_s=self.candidate_time_limit_s,
                                          label=label).result()
            if isinstance(outcome, Failure):
                return f"timing it failed: {outcome.message}"
            times = outcome.value
        else:
            for evaluation in contenders:
                if evaluation.backend is None and not self._rebuild(task, evaluation):
                    return f"building {evaluation.row.backend} again failed"
                evaluation.backend.ensure_active()  # type: ignore[union-attr]  # released once it fell behind
            times = contest_times([e.backend for e in contenders], task.graph_spec, task.device, plan, sizes,
                                  self.profiling, decides.rule(self._contest_score))
        if not isinstance(task.probed.get(CONTEST_TIMES), dict):
            task.probed[CONTEST_TIMES] = {}
        task.probed[CONTEST_TIMES][key] = times
        return times

    def _confirm_routes(self: Any, task: GraphTask, chosen: Evaluation, evaluations: list[Evaluation],
                        routes: Routes | None, plan: Plan, executor: Executor | None,
                        shared: Shared | None) -> tuple[Routes | None, str]:
        """``routes`` (same runtime) with each rival confirmed in turns against ``chosen`` at every measured batch size
        it would serve where its sweep led by less than :data:`CONTEST_WITHIN` (a larger lead stands as measured),
        size by size: a size where the rival's call does not take :data:`MIN_WIN` times less is
        refused to it, and the routes are worked out again without it (a sum over the sizes would let a loss at one
        size hide behind a gain at another: OpenVINO's LATENCY IR of a BERT-base took 15.8 against 21.4 ms at batch 1
        and 25.1 against 21.9 ms at batch 2, where its THROUGHPUT twin splits the batch over two streams). Returns
        the routes and what the graph's reason adds."""
        if routes is None or not self._contested:
            return routes, ""
        checked: list[Evaluation] = []
        refused: set[tuple[int, int]] = set()
        notes: list[str] = []
        while routes is not None:
            rival, sizes = _unchecked_rival(routes, chosen, checked)
            if rival is None:
                break
            checked.append(rival)
            sizes, clear = _close_sizes(rival, chosen, sizes)
            if clear:
                notes.append(f"{rival.row.backend} led by {CONTEST_WITHIN:g}x or more in the sweeps at batch "
                             f"{'/'.join(map(str, clear))}: route kept there without timing in turns")
            if not sizes:
                continue
            times = self._time_in_turns(task, [chosen, rival], [sizes, sizes], plan, executor, shared,
                                        f"route to {rival.row.backend} timed in turns", Outcome(pairwise=True))
            if isinstance(times, str):
                notes.append(f"the route to {rival.row.backend} was not timed in turns ({times})")
                continue
            mine, theirs = times
            lost = [size for size in sizes if not _beats(-theirs[size], -mine[size])]
            notes.append(f"batch {'/'.join(map(str, sizes))} timed in turns (up to {ROUNDS} rounds, p50 ms per call): "
                         f"{rival.row.backend} {_per_size(theirs, sizes)}, {chosen.row.backend} "
                         f"{_per_size(mine, sizes)}: route " + _verdict(sizes, lost))
            if lost:
                refused.update((id(rival), size) for size in lost)
                serving = [e for e in evaluations if e.backend is not None]
                routes = batch_routes(chosen, serving, 1.0 + self.eager_margin, refused=frozenset(refused))
        for note in notes:
            logger.info("%s: %s", describe_task(task), note)
        return routes, "".join(f"; {note}" for note in notes)


def _per_size(times: dict[int, float], sizes: list[int]) -> str:
    return "/".join(f"{times[size]:.3g}" for size in sizes)


def _verdict(sizes: list[int], lost: list[int]) -> str:
    if not lost:
        return "kept"
    rule = f"it must win by {MIN_WIN:.2f}x at each batch size"
    if len(lost) == len(sizes):
        return f"dropped ({rule})"
    kept = [size for size in sizes if size not in lost]
    return f"kept at batch {'/'.join(map(str, kept))}, dropped at batch {'/'.join(map(str, lost))} ({rule})"


def _identity(evaluation: Evaluation) -> str:
    built = evaluation.template if evaluation.template is not None else evaluation.backend
    return built.key() if built is not None else evaluation.row.backend


def _unchecked_rival(routes: Routes, chosen: Evaluation, checked: list[Evaluation]) -> tuple[Evaluation | None, list[int]]:
    """The first route's candidate other than ``chosen`` not yet in ``checked``, with the batch sizes ``chosen``
    measured in the ranges it serves."""
    assert chosen.sweep is not None
    measured = sorted(m.batch_size for m in chosen.sweep.measurements if m.batched)
    low = 1
    rival: Evaluation | None = None
    sizes: list[int] = []
    for bound, evaluation in routes:
        if rival is None and evaluation is not chosen and all(evaluation is not c for c in checked):
            rival = evaluation
        if rival is not None and evaluation is rival:
            sizes += [s for s in measured if s >= low and (bound is None or s <= bound)]
        low = (bound or 0) + 1
    return (rival, sizes) if rival is not None and sizes else (None, [])


def _close_sizes(rival: Evaluation, chosen: Evaluation, sizes: list[int]) -> tuple[list[int], list[int]]:
    """``sizes`` split into those where the sweeps put ``rival``'s throughput less than :data:`CONTEST_WITHIN` times
    ``chosen``'s (timed in turns, as the contest times close rivals only) and those where it led by more: a drift
    between two sweeps does not make up that much (a BERT-base's LATENCY IR took 10.3 ms at batch 1 against 19.3 ms
    for its THROUGHPUT twin, and timing the two in turns took 4-5 s of a 75 s tuning)."""
    close, clear = [], []
    for size in sizes:
        mine = chosen.sweep.at(size) if chosen.sweep is not None else None
        theirs = rival.sweep.at(size) if rival.sweep is not None else None
        led = mine is not None and theirs is not None and mine.throughput > 0 \
            and theirs.throughput >= CONTEST_WITHIN * mine.throughput
        (clear if led else close).append(size)
    return close, clear


def _stored(stored: Any, key: str, sizes: list[list[int]]) -> list[dict[int, float]] | None:
    """The per-size times of contenders timed at ``sizes`` (one list per contender) an earlier run kept under ``key``
    (None: none, or malformed)."""
    times = stored.get(key) if isinstance(stored, dict) else None
    if not isinstance(times, list) or len(times) != len(sizes) or not all(isinstance(t, dict) for t in times):
        return None
    try:
        parsed = [{int(size): float(ms) for size, ms in t.items()} for t in times]
    except (TypeError, ValueError):
        return None
    return parsed if all(set(t) == set(own) for t, own in zip(parsed, sizes, strict=True)) else None
