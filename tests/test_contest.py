"""The head-to-head of close contenders (tune_strategy/contest.py): timed in turns before the choice is final."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_measuring_strategies import strategy, tune
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.executor.base import CRASHED, Done, Failure
from torch_tweak.torch.module.recording import record
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.report.report import CandidateReport
from torch_tweak.torch.testing import FakeClock, TimedBackend
from torch_tweak.torch.tune_strategy import contest as contest_module
from torch_tweak.torch.tune_strategy.contest import (
    BLOCK_PAUSE_S,
    CONTEST_WITHIN,
    MIN_WIN,
    ROUNDS,
    Outcome,
    _factor,
    _stored,
    block_cycles,
    contest_times,
    median_ranges,
)
from torch_tweak.torch.tune_strategy.graph_probes import CONTEST_TIMES
from torch_tweak.torch.tune_strategy.results import Evaluation, Plan


@pytest.fixture
def clock():
    return FakeClock()


class _Machine:
    """How much slower than its nominal speed the machine runs now; shared by deep copies."""

    def __init__(self) -> None:
        self.slowdown = 1.0

    def __deepcopy__(self, memo: dict[int, Any]) -> _Machine:
        return self


class _OnMachine(TimedBackend):
    """A TimedBackend whose calls take ``machine.slowdown`` times their cost; with ``drift`` set, its first call
    slows the machine down (a neighbour starts working as this candidate's sweep begins)."""

    def __init__(self, clock: FakeClock, machine: _Machine, drift: float = 1.0, **fields: Any) -> None:
        super().__init__(clock, **fields)
        self.machine, self.drift = machine, drift

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        if self.drift != 1.0:
            self.machine.slowdown = self.drift
        before = self.clock()
        out = super()._infer(*args, **kwargs)
        self.clock.advance((self.clock() - before) * (self.machine.slowdown - 1.0))
        return out


def _contest_part(reason: str) -> str:
    return reason.split("; timed in turns with ", 1)[1] if "; timed in turns with " in reason else ""


def test_a_drift_between_two_sweeps_is_undone_by_timing_them_in_turns(clock):
    machine = _Machine()
    # "lucky" is swept while the machine runs at full speed (1.0 ms per call); "steady" is truly faster (0.8 ms),
    # but its sweep starts the drift, so its sweep sees 1.28 ms. In turns both run on the slow machine.
    lucky = _OnMachine(clock, machine, ms_per_call=1.0, label="lucky")
    steady = _OnMachine(clock, machine, drift=1.6, ms_per_call=0.8, label="steady")
    strat = strategy(tt.HighestThroughputStrategy, clock, [lucky, steady], eager_ms=5.0, screening=False,
                     batch_routing=False)
    _, _, graph = tune(strat)
    assert graph.chosen == steady.describe()
    contest = _contest_part(graph.reason)
    assert contest.startswith(f"{steady.describe()} (up to 3 rounds, p50 ms per call at the batch sizes the sweeps "
                              "judged them by: ")
    assert f"{lucky.describe()} 1.6 at batch 8; {steady.describe()} 1.28 at batch 8" in contest
    assert f"{steady.describe()} won, by 1.25x" in contest
    assert graph.reason.startswith("6250.0 samples/s at batch 8")  # the winner's own sweep, as measured


class _NoisyAt(_OnMachine):
    """Slowed ``machine.slowdown`` times at batch ``size`` only (a neighbour busy while that part of its sweep ran)."""

    def __init__(self, clock: FakeClock, machine: _Machine, size: int, **fields: Any) -> None:
        super().__init__(clock, machine, **fields)
        self.size = size

    def _infer(self, *args, **kwargs):
        if args[0].shape[0] == self.size:
            return super()._infer(*args, **kwargs)
        return TimedBackend._infer(self, *args, **kwargs)


def test_contenders_judged_at_different_batch_sizes_are_timed_at_each_others_too(clock, monkeypatch):
    machine = _Machine()
    machine.slowdown = 1.6
    # "two" is faster at every size (1.4 against 1.8 ms at batch 8), but its sweep at batch 8 was slowed to 2.24 ms,
    # so the sweeps judge it at batch 4 (4000/s) and "one" at batch 8 (4444/s). Compared that way, one stays.
    one = TimedBackend(clock, ms_per_call=1.0, ms_per_sample=0.1, label="one")
    two = _NoisyAt(clock, machine, 8, ms_per_call=0.6, ms_per_sample=0.1, label="two")
    timed = contest_module.contest_times

    def quiet_machine(*args, **kwargs):
        machine.slowdown = 1.0
        return timed(*args, **kwargs)

    monkeypatch.setattr(contest_module, "contest_times", quiet_machine)
    strat = strategy(tt.HighestThroughputStrategy, clock, [one, two], eager_ms=5.0, screening=False,
                     batch_routing=False)
    _, _, graph = tune(strat)
    contest = _contest_part(graph.reason)
    assert f"{one.describe()} 1.4/1.8 at batch 4/8; {two.describe()} 1/1.4 at batch 4/8" in contest
    assert f"{two.describe()} won, by 1.29x" in contest and graph.chosen == two.describe()


def test_a_rival_level_in_turns_does_not_replace_the_best(clock):
    machine = _Machine()
    best = _OnMachine(clock, machine, ms_per_call=1.0, label="best")
    level = _OnMachine(clock, machine, ms_per_call=1.01, label="level")  # 1 % slower: swept and timed in turns
    strat = strategy(tt.HighestThroughputStrategy, clock, [best, level], eager_ms=5.0, screening=False,
                     batch_routing=False)
    _, _, graph = tune(strat)
    assert graph.chosen == best.describe()
    assert f"{best.describe()} kept (a rival must win by {MIN_WIN:.2f}x)" in _contest_part(graph.reason)


def _against_eager(clock, eager_ms: float, ms_per_call: float, drift: float,
                   slow_at_first: float = 1.0) -> tuple[_OnMachine, _OnMachine, Any]:
    """Tune one candidate (``ms_per_call``; its calls set the machine's slowdown to ``drift``) against an eager
    baseline of ``eager_ms`` per call, swept first, on the machine running ``slow_at_first`` times slower."""
    machine = _Machine()
    machine.slowdown = slow_at_first
    eager = _OnMachine(clock, machine, ms_per_call=eager_ms, label="eager")
    candidate = _OnMachine(clock, machine, drift=drift, ms_per_call=ms_per_call, label="candidate")
    strat = strategy(tt.HighestThroughputStrategy, clock, [candidate], baseline=eager, screening=False,
                     batch_routing=False)
    _, _, graph = tune(strat)
    return candidate, eager, graph


def test_the_eager_gate_decides_on_calls_timed_in_turns_when_the_sweeps_put_eager_close(clock):
    # Eager is swept on the fast machine (1.0 ms); the candidate, truly 1.25x faster (0.8 ms), starts a drift as its
    # sweep begins and looks 0.78x eager (1.28 ms). In turns both run on the slow machine: 1.6 against 1.28 ms.
    candidate, eager, graph = _against_eager(clock, eager_ms=1.0, ms_per_call=0.8, drift=1.6)
    assert graph.chosen == candidate.describe()
    assert f"{candidate.describe()} 1.28 at batch 8; {eager.describe()} 1.6 at batch 8" in graph.reason
    assert f"{candidate.describe()} 1.25x eager in turns" in graph.reason
    assert "1.25x eager's throughput timed in turns (the eager gate needs >= 1.05x)" in graph.reason


def test_a_lead_over_eager_the_sweeps_owe_to_a_drift_does_not_pass_the_eager_gate(clock):
    # The machine runs 1.2x slow while eager is swept (1.2 ms); the candidate's first call ends that (0.999), so
    # its sweep looks 1.2x eager although the two are level, as they are in turns.
    candidate, eager, graph = _against_eager(clock, eager_ms=1.0, ms_per_call=1.0, drift=0.999, slow_at_first=1.2)
    assert graph.chosen == eager.describe()
    assert graph.reason.startswith(f"eager gate: the best candidate {candidate.describe()} reached only 1.00x "
                                   "eager's throughput timed in turns (sweeps: ")


def test_only_rivals_close_to_the_best_are_timed_again(clock):
    fast = TimedBackend(clock, ms_per_call=1.0, label="fast")
    close = TimedBackend(clock, ms_per_call=1.2, label="close")
    far = TimedBackend(clock, ms_per_call=2.0, label="far")  # the best beats it by 2x: no contest
    strat = strategy(tt.HighestThroughputStrategy, clock, [far, close, fast], eager_ms=5.0, screening=False,
                     batch_routing=False)
    _, _, graph = tune(strat)
    contest = _contest_part(graph.reason)
    assert graph.chosen == fast.describe() and contest.startswith(f"{close.describe()} (")
    assert far.describe() not in graph.reason


def test_each_contender_is_timed_at_every_size_a_sweep_judged_a_contender_by_and_scored_at_its_best(clock):
    peaked = TimedBackend(clock, ms_per_call=1.0, ms_per_sample_squared=0.25, label="peaked")  # best at b2: 1000/s
    flat = TimedBackend(clock, ms_per_call=7.0, label="flat")  # best at b8: 1143/s
    strat = strategy(tt.HighestThroughputStrategy, clock, [peaked, flat], eager_ms=50.0, screening=False,
                     batch_routing=False)
    _, _, graph = tune(strat)
    assert graph.chosen == flat.describe()
    assert f"{flat.describe()} 7/7 at batch 2/8; {peaked.describe()} 2/17 at batch 2/8)" in _contest_part(graph.reason)


def test_lowest_latency_contests_on_the_latency_of_its_batch_size(clock):
    machine = _Machine()
    lucky = _OnMachine(clock, machine, ms_per_call=1.0, label="lucky")
    steady = _OnMachine(clock, machine, drift=1.6, ms_per_call=0.8, label="steady")
    strat = strategy(tt.LowestLatencyStrategy, clock, [lucky, steady], eager_ms=5.0, screening=False)
    _, _, graph = tune(strat)
    assert graph.chosen == steady.describe()
    assert f"{steady.describe()} 1.28 at batch 1)" in graph.reason and f"{steady.describe()} won" in graph.reason


def test_a_latency_budget_is_not_contested_on_medians(clock):
    machine = _Machine()
    lucky = _OnMachine(clock, machine, ms_per_call=1.0, label="lucky")
    steady = _OnMachine(clock, machine, drift=1.6, ms_per_call=0.8, label="steady")
    strat = strategy(tt.LatencyBudgetStrategy, clock, [lucky, steady], eager_ms=5.0, screening=False,
                     latency_budget_ms=100)
    _, _, graph = tune(strat)
    assert graph.chosen == lucky.describe() and "timed in turns" not in graph.reason


@pytest.mark.parametrize(("ms_per_call", "max_calls", "timed"), [
    (0.04, 30, 30),  # short calls: the three blocks make as many calls as one sweep measurement (max_calls)
    (0.04, 31, 33),  # max_calls shared by the rounds, rounded up
    (125.0, 1000, 3 * 4),  # long calls: each block ends at max_time_s (0.5 s: 4 calls of 125 ms)
])
def test_a_contest_block_ends_at_its_share_of_max_calls_or_at_max_time(clock, tmp_path, ms_per_call, max_calls,
                                                                       timed):
    model = mlp()
    ((spec, samples),) = record(model, [(4, ((torch.randn(4, 8),), {}))])
    backends = [TimedBackend(clock, ms_per_call=ms_per_call, label=label) for label in ("a", "b")]
    for backend in backends:
        backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"), tmp_path / backend.key())
    profiling = ProfilingConfig(clock=clock, pause_s=0, min_time_s=0, max_calls=max_calls, max_time_s=0.5)
    plan = Plan(batch_sizes=[4], batched=False, sample=samples[0].sample)
    times = contest_times(backends, spec, torch.device("cpu"), plan, [[4], [4]], profiling)
    assert times == [{4: pytest.approx(ms_per_call)}] * 2
    warm = 1 + (ROUNDS if ms_per_call / 1000 < 0.05 else 0)  # the warm-up cycle, and an untimed one per short block
    assert [b.calls for b in backends] == [timed + warm] * 2
    assert block_cycles(profiling) * ROUNDS >= max_calls


class _Logged(TimedBackend):
    """A timed backend that appends its label to ``log`` at each call."""

    log: list[str] = []

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        self.log.append(self.timing.label)
        return super()._infer(*args, **kwargs)


@pytest.mark.parametrize(("pause_s", "slept"), [(0.2, BLOCK_PAUSE_S), (0.01, 0.01), (0.0, None)])
def test_each_contest_block_starts_after_the_previous_runtimes_threads_had_time_to_go_idle(
        clock, tmp_path, monkeypatch, pause_s, slept):
    log: list[str] = []
    monkeypatch.setattr(_Logged, "log", log)
    monkeypatch.setattr(contest_module, "time", SimpleNamespace(sleep=lambda s: log.append(f"pause {s}")))
    model = mlp()
    ((spec, samples),) = record(model, [(4, ((torch.randn(4, 8),), {}))])
    backends = [_Logged(clock, ms_per_call=125.0, label=label) for label in ("a", "b")]
    for backend in backends:
        backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"), tmp_path / backend.key())
    profiling = ProfilingConfig(clock=clock, pause_s=pause_s, min_time_s=0, min_calls=1, window_size=3,
                                 max_calls=3, max_time_s=0.1)
    plan = Plan(batch_sizes=[4], batched=False, sample=samples[0].sample)
    log.clear()
    contest_times(backends, spec, torch.device("cpu"), plan, [[4], [4]], profiling)
    blocks = ["a", "b", "b", "a", "a", "b"]  # after the warm-up call of each: the rounds rotate the order
    expected = ["a", "b"] + [e for label in blocks for e in ([f"pause {slept}"] if slept else []) + [label]]
    assert log == expected


def test_scores_of_either_sign_compare_as_factors():
    assert _factor(125.0, 100.0) == pytest.approx(1.25)  # throughput
    assert _factor(-0.8, -1.0) == pytest.approx(1.25)  # minus a latency: 0.8 ms beats 1.0 ms by 1.25x
    assert _factor(-1.0, -0.8) == pytest.approx(0.8)


@pytest.mark.parametrize("stored", [
    None, [], {"k": "not a list"}, {"k": [{"8": 1.0}]}, {"k": [{"8": 1.0}, {"8": "x"}]}, {"k": [{"8": 1.0}, {"4": 1.0}]},
    {"k": [{"8": 1.0}, [1.0]]},
])
def test_malformed_stored_times_are_ignored(stored):
    assert _stored(stored, "k", [[8], [8]]) is None


def test_stored_times_are_read_back_with_integer_sizes():
    assert _stored({"k": [{"8": 1.5}, {"4": 2}]}, "k", [[8], [4]]) == [{8: 1.5}, {4: 2.0}]


def _routes_part(reason: str) -> str:
    marker = "timed in turns (up to 3 rounds, p50 ms per call): "
    return reason.split(marker, 1)[1] if marker in reason else ""


def _swept_during_a_drift(clock, small: tuple[float, float], main: tuple[float, float], drift: float):
    """Tune ``small`` (swept first, on the fast machine) against ``main``, whose first call slows the machine down by
    ``drift``; each is ``(ms_per_call, ms_per_sample)``. Returns the two backends, the module and the graph report."""
    machine = _Machine()
    first = _OnMachine(clock, machine, ms_per_call=small[0], ms_per_sample=small[1], label="small")
    second = _OnMachine(clock, machine, drift=drift, ms_per_call=main[0], ms_per_sample=main[1], label="main")
    strat = strategy(tt.HighestThroughputStrategy, clock, [first, second], eager_ms=5.0, screening=False)
    wrapped, _, graph = tune(strat)
    return first, second, wrapped, graph


def test_a_route_the_sweeps_owe_to_a_drift_is_dropped_once_timed_in_turns(clock):
    # "small" is swept on the fast machine (1.2 ms at batch 1); "main" starts the drift, so its batch-1 call looks
    # 1.08x slower than small's (1.296 ms) although it is truly faster (0.81 ms). In turns small takes 1.92 ms.
    small, main, wrapped, graph = _swept_during_a_drift(clock, (1.0, 0.2), (0.8, 0.01), drift=1.6)
    assert graph.chosen == main.describe()
    assert type(next(iter(wrapped.backends.values()))) is type(main)  # no router
    assert "batch 1 timed in turns" in graph.reason
    assert _routes_part(graph.reason) == (f"{small.describe()} 1.92, {main.describe()} 1.3: route dropped (it must "
                                          f"win by {MIN_WIN:.2f}x at each batch size)")


def test_a_route_is_confirmed_batch_size_by_batch_size(clock):
    # swept on a machine that "main" slows down 1.3x from its first call on, main looks slower than small at
    # batch 1 and 2 (1.46x and 1.11x, both close enough to time); in turns (both slowed) small still wins batch 1
    # (1.17 against 1.31 ms) but loses batch 2 (1.56 against 1.33 ms), which the sum over the two would hide
    small, large, wrapped, graph = _swept_during_a_drift(clock, (0.6, 0.3), (1.0, 0.01), drift=1.3)
    assert graph.chosen.startswith("BatchRouterBackend(batch<=1: " + small.describe())
    assert _routes_part(graph.reason) == (f"{small.describe()} 1.17/1.56, {large.describe()} 1.31/1.33: route kept "
                                          f"at batch 1, dropped at batch 2 (it must win by {MIN_WIN:.2f}x at each "
                                          "batch size)")
    router = next(iter(wrapped.backends.values()))
    assert router.backend_for(2) is not router.backend_for(1)


def test_a_route_that_wins_in_turns_is_kept(clock):
    small = TimedBackend(clock, ms_per_call=0.3, ms_per_sample=0.5, label="small")  # b1 0.8 ms, b2 1.3
    large = TimedBackend(clock, ms_per_call=1.1, ms_per_sample=0.01, label="large")  # b1 1.11 ms, b2 1.12
    strat = strategy(tt.HighestThroughputStrategy, clock, [small, large], eager_ms=5.0, screening=False)
    wrapped, _, graph = tune(strat)
    assert graph.chosen.startswith("BatchRouterBackend(batch<=1: " + small.describe())
    assert _routes_part(graph.reason) == f"{small.describe()} 0.8, {large.describe()} 1.11: route kept"


def test_a_route_that_led_by_far_in_the_sweeps_is_kept_without_timing_it_in_turns(clock):
    small = TimedBackend(clock, ms_per_call=0.3, ms_per_sample=0.5, label="small")  # b1 0.8 ms, b2 1.3
    large = TimedBackend(clock, ms_per_call=1.2, ms_per_sample=0.01, label="large")  # b1 1.21 ms: 1.51x small's
    strat = strategy(tt.HighestThroughputStrategy, clock, [small, large], eager_ms=5.0, screening=False)
    wrapped, _, graph = tune(strat)
    assert graph.chosen.startswith("BatchRouterBackend(batch<=1: " + small.describe())
    assert (f"{small.describe()} led by {CONTEST_WITHIN:g}x or more in the sweeps at batch 1: route kept there "
            "without timing in turns") in graph.reason
    assert "timed in turns (up to 3 rounds" not in graph.reason
    assert wrapped(torch.randn(1, 8)).shape == (1, 4)


class _Ahead:
    """A background worker that holds ``held`` and answers every unit with ``outcome``."""

    def __init__(self, held: set[str], outcome: Any) -> None:
        self.held, self.outcome, self.ran = held, outcome, []

    def holds(self, keys: list[str]) -> bool:
        return any(key in self.held for key in keys)

    def run(self, fn: Any, args: tuple[Any, ...], label: str) -> Any:
        self.ran.append(label)
        return self.outcome


class _Executor:
    """An isolated executor whose worker answers every unit with ``times``."""

    def __init__(self, times: list[dict[int, float]]) -> None:
        self.times, self.submitted = times, []

    def submit(self, shared: Any, fn: Any, args: tuple[Any, ...], *, time_limit_s: float | None, label: str) -> Any:
        self.submitted.append(label)
        done = Done(self.times, "pid 2 on here")
        return type("Pending", (), {"result": lambda self: done})()


def _contenders() -> list[Evaluation]:
    templates = [TimedBackend(FakeClock(), ms_per_call=1.0, label=label) for label in ("built ahead", "other")]
    return [Evaluation("candidate", CandidateReport(backend=t.describe(), key=t.key()), template=t) for t in templates]


@pytest.mark.parametrize(("outcome", "worker_times"), [
    (Done([{1: 2.0}, {1: 3.0}], "pid 1 on here"), False),  # timed where the build ahead is held
    (Failure(CRASHED, "its worker died", "pid 1 on here"), True),  # that failed: the worker builds and times all
], ids=["background", "background-failed"])
def test_a_head_to_head_runs_in_the_background_worker_that_holds_a_contender(outcome, worker_times, caplog):
    contenders = _contenders()
    ahead = _Ahead({contenders[0].template.key()}, outcome)
    executor = _Executor([{1: 4.0}, {1: 5.0}])
    task = SimpleNamespace(probed={}, module_name="m", graph_spec=SimpleNamespace(name="0"))
    with caplog.at_level(logging.INFO, logger="torch_tweak"):
        times = tt.HighestThroughputStrategy([TorchEagerBackend()])._time_in_turns(
            task, contenders, [[1], [1]], None, executor, object(), "head-to-head", Outcome(), ahead)
    assert ahead.ran == ["module 'm' graph 0: head-to-head"]
    assert times == ([{1: 4.0}, {1: 5.0}] if worker_times else [{1: 2.0}, {1: 3.0}])
    assert len(executor.submitted) == int(worker_times)
    assert any("in the background worker failed (its worker died)" in r.getMessage() for r in caplog.records) \
        == worker_times
    assert list(task.probed[CONTEST_TIMES].values()) == [times]  # kept for a rerun, as any timing in turns


def test_a_head_to_head_without_a_held_contender_runs_in_the_worker():
    contenders = _contenders()
    ahead = _Ahead({"another candidate"}, Done([], "pid 1 on here"))
    executor = _Executor([{1: 4.0}, {1: 5.0}])
    task = SimpleNamespace(probed={}, module_name="m", graph_spec=SimpleNamespace(name="0"))
    assert tt.HighestThroughputStrategy([TorchEagerBackend()])._time_in_turns(
        task, contenders, [[1], [1]], None, executor, object(), "head-to-head", Outcome(), ahead) == [{1: 4.0}, {1: 5.0}]
    assert ahead.ran == [] and executor.submitted == ["module 'm' graph 0: head-to-head"]


def _timed_in_turns(clock, tmp_path, *contenders: dict[str, float], outcome: Outcome | None):
    """Time backends with these TimedBackend fields in turns at batch 4, one 125 ms-ish call per block; the calls
    each made, warm-up included."""
    model = mlp()
    ((spec, samples),) = record(model, [(4, ((torch.randn(4, 8),), {}))])
    backends = [TimedBackend(clock, label=f"c{i}", **fields) for i, fields in enumerate(contenders)]
    for backend in backends:
        backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"), tmp_path / backend.key())
    profiling = ProfilingConfig(clock=clock, pause_s=0, min_time_s=0, max_calls=1000, max_time_s=0.1)
    plan = Plan(batch_sizes=[4], batched=False, sample=samples[0].sample)
    score = tt.HighestThroughputStrategy()._contest_score
    needed = outcome.rule(score) if outcome is not None else None
    times = contest_times(backends, spec, torch.device("cpu"), plan, [[4]] * len(backends), profiling, needed)
    return times, [backend.calls for backend in backends]


@pytest.mark.parametrize(("b_ms", "outcome", "rounds"), [
    (250.0, Outcome(), 2),  # a (120-130 ms) beats b whatever a third round shows: it is left out
    (124.0, Outcome(), 3),  # b could still win by 1.03x if a's third call took 130 ms, or lose: the third round runs
    (250.0, None, 3),  # no outcome to settle: every round runs
])
def test_a_contest_leaves_out_the_rounds_that_cannot_change_its_outcome(clock, tmp_path, b_ms, outcome, rounds):
    # a's calls alternate 120 and 130 ms (jitter), so after two rounds its median can end anywhere in between
    times, calls = _timed_in_turns(clock, tmp_path, {"ms_per_call": 125.0, "jitter_ms": 5.0}, {"ms_per_call": b_ms},
                                   outcome=outcome)
    assert calls == [1 + rounds] * 2  # the warm-up call, then one call per block
    assert times[1] == {4: pytest.approx(b_ms)}


def test_a_contest_leaves_out_eager_once_the_gate_is_settled_while_the_winner_is_not(clock, tmp_path):
    # a (120-130 ms) and b (124 ms) are too close to call after two rounds; eager (400 ms) fails the gate whatever comes
    times, calls = _timed_in_turns(clock, tmp_path, {"ms_per_call": 125.0, "jitter_ms": 5.0}, {"ms_per_call": 124.0},
                                   {"ms_per_call": 400.0}, outcome=Outcome(rivals=1, gate=1.05))
    assert calls == [4, 4, 3]  # the warm-up call, then one per block: eager's third block is left out
    assert times[2] == {4: pytest.approx(400.0)}


def test_a_rival_that_cannot_win_is_left_out_while_the_others_are_timed():
    lowest = [{1: 1.0}, {1: 0.97}, {1: 2.0}]  # ms: the best, a close rival, one at half the best's speed at most
    highest = [{1: 1.05}, {1: 1.02}, {1: 2.1}]
    assert Outcome(rivals=2).needed(_THROUGHPUT, lowest, highest) == [True, True, False]
    gated = Outcome(rivals=1, gate=1.05)  # eager (last) at 3 ms: the gate passes for either possible winner
    assert gated.needed(_THROUGHPUT, [{1: 1.0}, {1: 0.97}, {1: 3.0}], [{1: 1.05}, {1: 1.02}, {1: 3.2}]) == [
        True, True, False]
    sure = [{1: 1.0}, {1: 0.5}, {1: 0.58}]  # the rival wins whatever comes; eager's verdict on it is still open
    assert gated.needed(_THROUGHPUT, sure, [{1: 1.0}, {1: 0.6}, {1: 0.7}]) == [False, True, True]


def test_later_blocks_of_a_contest_make_as_many_calls_as_the_first():
    lowest, highest = median_ranges([{4: [1.0, 2.0]}, {4: [3.0, 3.0, 3.0, 3.0]}], [1, 2])
    assert lowest == [{4: 1.0}, {4: 3.0}] and highest == [{4: 2.0}, {4: 3.0}]
    lowest, highest = median_ranges([{4: [1.0]}], [2])  # one call so far, two to come: anything
    assert lowest == [{4: 0.0}] and highest[0][4] > 1e29


_THROUGHPUT = tt.HighestThroughputStrategy()._contest_score


@pytest.mark.parametrize(("lowest", "highest", "settled"), [
    ([{1: 1.0}, {1: 1.2}], [{1: 1.0}, {1: 1.3}], True),  # 1.2x eager at worst: the gate passes whatever comes
    ([{1: 1.0}, {1: 1.0}], [{1: 1.0}, {1: 1.02}], True),  # 1.02x eager at best: it fails whatever comes
    ([{1: 1.0}, {1: 1.0}], [{1: 1.0}, {1: 1.1}], False),  # between 1.0x and 1.1x: a third round decides
])
def test_a_contest_with_eager_is_settled_only_when_the_eager_gate_is(lowest, highest, settled):
    assert Outcome(rivals=0, gate=1.05).settled(_THROUGHPUT, lowest, highest) is settled


@pytest.mark.parametrize(("lowest", "highest", "settled"), [
    ([{1: 1.0}, {1: 0.7}, {1: 0.9}], [{1: 1.0}, {1: 0.8}, {1: 0.95}], True),  # the first rival wins whatever comes
    ([{1: 1.0}, {1: 0.7}, {1: 0.75}], [{1: 1.0}, {1: 0.8}, {1: 0.95}], False),  # either rival may come out on top
    ([{1: 1.0}, {1: 0.98}, {1: 1.5}], [{1: 1.0}, {1: 1.0}, {1: 1.6}], True),  # no rival can win by 1.03x
])
def test_a_contest_between_rivals_is_settled_once_its_winner_is(lowest, highest, settled):
    assert Outcome(rivals=2).settled(_THROUGHPUT, lowest, highest) is settled


@pytest.mark.parametrize(("theirs_low", "theirs_high", "settled"), [
    (0.5, 0.6, True),  # the rival's route wins by 1.67x at worst
    (1.0, 1.1, True),  # it cannot win by 1.03x
    (0.95, 1.0, False),  # it may win by 1.05x, or not at all
])
def test_a_route_timed_in_turns_is_settled_size_by_size(theirs_low, theirs_high, settled):
    lowest, highest = [{1: 1.0, 2: 2.0}, {1: theirs_low, 2: 1.0}], [{1: 1.0, 2: 2.0}, {1: theirs_high, 2: 1.0}]
    assert Outcome(pairwise=True).settled(_THROUGHPUT, lowest, highest) is settled
