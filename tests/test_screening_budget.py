"""Screening before sweeping, cheapest builds first, and tt.tune(time_budget_s=...)."""

from __future__ import annotations

import importlib
import re
import time
from collections import Counter

import pytest
import torch
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.testing import FakeClock, TimedBackend
from torch_tweak.torch.tune_strategy.screening import TimeBudget


@pytest.fixture
def clock():
    return FakeClock()


def strategy(clock, backends, **kwargs):
    profiling = ProfilingConfig(clock=clock, pause_s=0, min_time_s=0)
    return tt.HighestThroughputStrategy(backends=backends, profiling=profiling,
                                        baseline=TimedBackend(clock, ms_per_call=1.0), **kwargs)


def tune(strat, batch_sizes=(1, 2, 4, 8), **kwargs):
    wrapped = tt.Module(mlp(), strategy=strat)
    report = tt.tune(wrapped, [torch.randn(8) for _ in range(8)], batch_sizes=list(batch_sizes),
                     ignore_failing_modules=False, **kwargs)
    graph = report.modules[0].graphs[0]
    return graph, {c.backend: c for c in graph.candidates}


def test_a_candidate_far_behind_at_both_ends_is_screened_out(clock):
    fast = TimedBackend(clock, ms_per_call=0.5, ms_per_sample=0.05)
    close = TimedBackend(clock, ms_per_call=0.6, ms_per_sample=0.05)
    slow = TimedBackend(clock, ms_per_call=5.0, ms_per_sample=0.5)
    graph, rows = tune(strategy(clock, [slow, close, fast]))
    assert graph.chosen == fast.describe()
    assert rows[slow.describe()].status == "screened_out"
    assert rows[slow.describe()].measurements["batch_sizes"] == [1, 8]  # the two ends only
    assert re.match(r"screened out: 0\.1\dx at batch 1, 0\.1\dx at batch 8 of the best", rows[slow.describe()].error)
    assert rows[close.describe()].status == "passed"
    assert rows[close.describe()].measurements["batch_sizes"] == [1, 2, 4, 8]  # within the margin: swept
    assert rows[fast.describe()].measurements["batch_sizes"] == [1, 2, 4, 8]
    assert rows[TimedBackend(clock, ms_per_call=1.0).describe()].measurements["batch_sizes"] == [1, 2, 4, 8]


def test_a_swept_candidate_is_not_measured_again_at_the_screening_ends(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep_module = importlib.import_module("torch_tweak.torch.profiling.sweep")

    measured: list[int] = []
    original = sweep_module.measure

    def counting(fn, batch_size, *args, **kwargs):
        measured.append(batch_size)
        return original(fn, batch_size, *args, **kwargs)

    monkeypatch.setattr(sweep_module, "measure", counting)
    fast = TimedBackend(clock, ms_per_call=0.5, ms_per_sample=0.05)
    close = TimedBackend(clock, ms_per_call=0.6, ms_per_sample=0.05)
    slow = TimedBackend(clock, ms_per_call=5.0, ms_per_sample=0.5)
    _, rows = tune(strategy(clock, [slow, close, fast]))
    assert rows[close.describe()].measurements["batch_sizes"] == [1, 2, 4, 8]
    # eager swept once in full; each candidate screened at 1 and 8; the two survivors swept at 2 and 4 only
    assert Counter(measured) == {1: 4, 8: 4, 2: 3, 4: 3}


def test_a_candidate_out_of_reach_at_the_small_end_is_not_measured_at_the_large_end(clock):
    fast = TimedBackend(clock, ms_per_call=0.5, ms_per_sample=0.05)  # 1818/s at batch 1, 8889/s at batch 8
    hopeless = TimedBackend(clock, ms_per_call=20.0)  # 50/s at 1: even 8x that at 8 is far below half of 8889/s
    behind = TimedBackend(clock, ms_per_call=1.5)  # 667/s at 1, but 8 samples per call could reach half the best
    graph, rows = tune(strategy(clock, [fast, hopeless, behind]))
    assert graph.chosen == fast.describe()
    row = rows[hopeless.describe()]
    assert row.status == "screened_out"
    assert row.measurements["batch_sizes"] == [1]
    assert re.match(r"screened out: 0\.0\dx at batch 1 of the best candidate's throughput \(batch 8 not measured",
                    row.error)
    assert row.error.endswith("its outputs were not checked") and row.fidelity is None  # measured before the check
    assert rows[behind.describe()].status == "passed"  # 5333/s at batch 8: within the margin there, swept
    assert rows[behind.describe()].measurements["batch_sizes"] == [1, 2, 4, 8]


def test_out_of_reach_bounds_only_larger_ends():
    from torch_tweak.torch.profiling import Measurement
    from torch_tweak.torch.tune_strategy.results import Plan, out_of_reach

    def measured(batch, ms):
        return Measurement(batch, [ms] * 3, [], True, "stable", 3 * ms / 1000.0)

    plan = Plan([1, 8], True, None, needs=((1, 1000.0), (8, 4000.0)))
    assert out_of_reach(measured(1, 10.0), plan)  # 100/s: 8 x 100 x 1.25 = 1000/s < 4000/s at 8
    assert not out_of_reach(measured(1, 2.0), plan)  # 500/s: 5000/s at 8 would be enough
    assert not out_of_reach(measured(1, 0.5), plan)  # 2000/s: kept at batch 1 itself
    assert not out_of_reach(measured(8, 100.0), plan)  # the large end never bounds the small one
    assert not out_of_reach(measured(1, 10.0), Plan([1, 8], True, None))  # nothing measured before it


def test_a_candidate_best_at_one_end_only_is_swept(clock):
    small = TimedBackend(clock, ms_per_call=0.2, ms_per_sample=1.0, label="small")  # wins at batch 1
    large = TimedBackend(clock, ms_per_call=3.0, ms_per_sample=0.05, label="large")  # wins at batch 8
    _, rows = tune(strategy(clock, [small, large]))
    for backend in (small, large):  # swept (the sweep itself may stop once throughput saturates)
        assert rows[backend.describe()].status in ("passed", "chosen")
        assert rows[backend.describe()].measurements["batch_sizes"][:3] == [1, 2, 4]


def test_screening_off_sweeps_everything(clock):
    fast = TimedBackend(clock, ms_per_call=0.5)
    slow = TimedBackend(clock, ms_per_call=5.0)
    _, rows = tune(strategy(clock, [slow, fast], screening=False))
    assert rows[slow.describe()].status == "passed"
    assert rows[slow.describe()].measurements["batch_sizes"] == [1, 2, 4, 8]


def test_two_batch_sizes_are_not_screened(clock):
    slow = TimedBackend(clock, ms_per_call=5.0)
    _, rows = tune(strategy(clock, [slow, TimedBackend(clock, ms_per_call=0.5)]), batch_sizes=(1, 2))
    assert rows[slow.describe()].status == "passed"


@pytest.mark.parametrize("kwargs,match", [
    ({"screening_margin": 1.0}, "screening_margin must be < 1"),
    ({"screening_margin": -0.1}, "screening_margin must be a finite number"),
    ({"screening": "yes"}, "screening"),
])
def test_bad_screening_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        tt.HighestThroughputStrategy(**kwargs)


class SlowBuild(TimedBackend):
    """A candidate whose build takes real time (the budget runs on the wall clock)."""

    def _build(self, module, graph_spec, data, cache_dir):
        time.sleep(0.4)
        return super()._build(module, graph_spec, data, cache_dir)


def test_time_budget_skips_candidates_that_would_not_fit(clock):
    first, second, third = (SlowBuild(clock, ms_per_call=0.5, label=n) for n in "abc")
    graph, rows = tune(strategy(clock, [first, second, third]), time_budget_s=1.2)
    assert rows[first.describe()].status == "chosen"
    skipped = [rows[b.describe()] for b in (second, third)]
    assert any(row.status == "skipped" for row in skipped)
    row = next(row for row in skipped if row.status == "skipped")
    assert "time_budget_s" in row.error and "raise time_budget_s to try it" in row.error
    assert rows[TimedBackend(clock, ms_per_call=1.0).describe()].status == "passed"  # the baseline is never skipped


def test_without_a_budget_nothing_is_skipped(clock):
    backends = [SlowBuild(clock, ms_per_call=0.5, label=n) for n in "ab"]
    _, rows = tune(strategy(clock, backends))
    assert all(row.status != "skipped" for row in rows.values())


@pytest.mark.parametrize("value", [0, -1, float("inf"), "10", True])
def test_bad_time_budget_is_refused(value):
    wrapped = tt.Module(mlp(), strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    with pytest.raises(ConfigError, match="time_budget_s must be a positive number"):
        tt.tune(wrapped, [torch.randn(8)], time_budget_s=value)


def test_each_graph_gets_a_share_of_what_is_left():
    budget = TimeBudget(10.0, graphs_left=2, start=time.perf_counter())
    first = budget.graph_deadline() - time.perf_counter()
    assert 4.5 < first <= 5.0
    assert 9.0 < budget.graph_deadline() - time.perf_counter() <= 10.0  # the last graph gets everything left
