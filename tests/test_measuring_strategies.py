"""The measuring strategies with a fake clock and timed test backends: choice, eager gate, caps, failures."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError, TuningError
from torch_tweak.torch.backend import TorchEagerBackend, available
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.testing import (
    FailingBuildBackend,
    FakeClock,
    HangingBackend,
    TimedBackend,
    WrongOutputBackend,
)
from torch_tweak.torch.tune_strategy import default_candidates


@pytest.fixture
def clock():
    return FakeClock()


def strategy(cls, clock, backends, eager_ms=1.0, eager_per_sample=0.0, **kwargs):
    """A strategy measuring with ``clock``, whose eager baseline costs ``eager_ms`` per call."""
    profiling = kwargs.pop("profiling", None) or ProfilingConfig(clock=clock, pause_s=0, min_time_s=0)
    baseline = kwargs.pop("baseline", None) or TimedBackend(clock, ms_per_call=eager_ms, ms_per_sample=eager_per_sample)
    return cls(backends=backends, profiling=profiling, baseline=baseline, **kwargs)


def tune(strat, batch_sizes=(1, 2, 4, 8), model=None):
    wrapped = tt.Module(model or mlp(), strategy=strat)
    report = tt.tune(wrapped, [torch.randn(8) for _ in range(8)], batch_sizes=list(batch_sizes),
                     ignore_failing_modules=False)
    return wrapped, report, report.modules[0].graphs[0]


def rows(graph):
    return {c.backend: c for c in graph.candidates}


def test_highest_throughput_picks_the_fastest_and_reports_every_measurement(clock):
    fast = TimedBackend(clock, ms_per_call=0.5, ms_per_sample=0.1)
    slow = TimedBackend(clock, ms_per_call=2.0)
    strat = strategy(tt.HighestThroughputStrategy, clock, [slow, fast], eager_ms=1.0, eager_per_sample=0.2)
    wrapped, report, graph = tune(strat)
    assert graph.chosen == fast.describe() and "2.00x eager's throughput" in graph.reason
    by_name = rows(graph)
    assert [c.role for c in graph.candidates] == ["baseline", "candidate", "candidate"]
    assert by_name[fast.describe()].status == "chosen" and by_name[slow.describe()].status == "passed"
    measured = by_name[fast.describe()].measurements
    assert measured["batch_sizes"] == [1, 2, 4, 8] and measured["best_batch_size"] == 8
    assert measured["selection"]["throughput"] == pytest.approx(8 / 1.3e-3)
    run = measured["runs"][0]
    assert run["calls"] == len(run["times_ms"]) == 10 and run["stable"] and run["p50_ms"] == pytest.approx(0.6)
    assert {"p50_ms", "p90_ms", "p99_ms", "throughput", "warmup_ms"} <= set(run)
    restored = tt.TuningReport.from_dict(json.loads(report.to_json()))
    assert restored.modules[0].graphs[0].candidates[2].measurements["runs"][3]["batch_size"] == 8
    (result,) = strat.results
    assert result.chosen == fast.describe() and result.graph_spec_name == "0"
    assert [c.batch_size for c in result.candidates] == [8, 8, 8]
    x = torch.randn(3, 8)
    assert torch.allclose(wrapped(x), mlp()(x))


@pytest.mark.parametrize("candidate_ms,margin,chosen", [
    (0.98, 0.05, "eager"), (0.9, 0.05, "candidate"), (0.98, 0.0, "candidate"), (0.9, 0.2, "eager"),
])
def test_eager_gate(clock, candidate_ms, margin, chosen):
    candidate = TimedBackend(clock, ms_per_call=candidate_ms)
    strat = strategy(tt.HighestThroughputStrategy, clock, [candidate], eager_ms=1.0, eager_margin=margin)
    _, _, graph = tune(strat)
    if chosen == "eager":
        assert graph.chosen == strat.baseline.describe()
        ratio = 1.0 / candidate_ms
        assert graph.reason.startswith("eager gate") and f"only {ratio:.2f}x" in graph.reason
        assert f"eager_margin={margin}" in graph.reason and "eager stays" in graph.reason
        assert rows(graph)[candidate.describe()].status == "passed"
    else:
        assert graph.chosen == candidate.describe()


def test_lowest_latency_and_highest_throughput_disagree(clock):
    low_latency = TimedBackend(clock, ms_per_call=0.3, ms_per_sample=0.5)   # b1 0.8 ms, b8 4.3 ms
    high_throughput = TimedBackend(clock, ms_per_call=1.2, ms_per_sample=0.01)  # b1 1.21 ms, b8 1.28 ms
    kwargs = {"eager_ms": 1.5, "eager_per_sample": 0.2}
    latency = strategy(tt.LowestLatencyStrategy, clock, [high_throughput, low_latency], **kwargs)
    _, _, graph = tune(latency)
    assert graph.chosen == low_latency.describe() and "p50 0.800 ms at batch 1" in graph.reason
    assert all(c.measurements["batch_sizes"] == [1] for c in graph.candidates)
    throughput = strategy(tt.HighestThroughputStrategy, clock, [high_throughput, low_latency], batch_routing=False,
                          **kwargs)
    _, _, graph = tune(throughput)
    assert graph.chosen == high_throughput.describe()


def test_latency_budget_takes_the_highest_throughput_that_fits(clock):
    a = TimedBackend(clock, ms_per_call=0.3, ms_per_sample=0.5)     # p99: 0.8, 1.3, 2.3, 4.3 ms
    b = TimedBackend(clock, ms_per_call=1.2, ms_per_sample=0.01)    # p99: 1.21, 1.22, 1.24, 1.28 ms
    kwargs = {"eager_ms": 1.5, "eager_per_sample": 0.2}             # p99: 1.7, 1.9, 2.3, 3.1 ms
    strat = strategy(tt.LatencyBudgetStrategy, clock, [a, b], latency_budget_ms=1.25, **kwargs)
    _, _, graph = tune(strat)
    assert graph.chosen == b.describe()
    chosen = rows(graph)[b.describe()].measurements
    assert chosen["selection"]["batch_size"] == 4 and chosen["stop_reason"] == "limit"
    assert "eager does not qualify" in graph.reason and "latency_budget_ms=1.25" in graph.strategy
    only_a = strategy(tt.LatencyBudgetStrategy, clock, [a, b], latency_budget_ms=1.0, **kwargs)
    assert tune(only_a)[2].chosen == a.describe()


def test_latency_budget_that_nothing_meets_lists_every_p99(clock):
    a = TimedBackend(clock, ms_per_call=0.3, ms_per_sample=0.5)
    strat = strategy(tt.LatencyBudgetStrategy, clock, [a, FailingBuildBackend()], latency_budget_ms=0.1)
    with pytest.raises(TuningError) as info:
        tune(strat)
    message = str(info.value)
    assert "latency budget of 0.1 ms" in message and "Raise latency_budget_ms" in message
    assert f"{a.describe()}: p99 0.800 ms at batch 1" in message
    assert f"{strat.baseline.describe()}: p99 1.000 ms at batch 1" in message
    assert "FailingBuildBackend(): build_failed" in message


@pytest.mark.parametrize("kwargs,match", [
    ({"latency_budget_ms": 0}, "latency_budget_ms"), ({"latency_budget_ms": -5}, "latency_budget_ms"),
    ({"latency_budget_ms": math.nan}, "latency_budget_ms"), ({"latency_budget_ms": "5"}, "latency_budget_ms"),
    ({"latency_budget_ms": True}, "latency_budget_ms"),
    ({"latency_budget_ms": 5, "backends": []}, "empty list"),
    ({"latency_budget_ms": 5, "eager_margin": -0.1}, "eager_margin"),
    ({"latency_budget_ms": 5, "candidate_time_limit_s": 0}, "candidate_time_limit_s"),
    ({"latency_budget_ms": 5, "max_batch_size_limit": 0}, "max_batch_size_limit"),
    ({"latency_budget_ms": 5, "profiling": {"max_time_s": 1}}, "ProfilingConfig"),
    ({"latency_budget_ms": 5, "baseline": "eager"}, "Backend instances"),
    ({"latency_budget_ms": 5, "find_max_batch_size": "yes"}, "find_max_batch_size"),
])
def test_bad_configuration_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        tt.LatencyBudgetStrategy(**kwargs)


def test_empty_candidate_list_is_refused_by_every_strategy():
    for cls in (tt.HighestThroughputStrategy, tt.LowestLatencyStrategy):
        with pytest.raises(ConfigError, match="empty list"):
            cls(backends=[])


def test_unstable_measurements_are_capped_marked_and_still_used(clock):
    jittery = TimedBackend(clock, ms_per_call=0.5, jitter_ms=0.3)
    profiling = ProfilingConfig(clock=clock, pause_s=0, min_time_s=0, max_calls=50)
    strat = strategy(tt.HighestThroughputStrategy, clock, [jittery], profiling=profiling)
    _, _, graph = tune(strat, batch_sizes=(1, 2))
    measured = rows(graph)[jittery.describe()].measurements
    assert graph.chosen == jittery.describe()
    for run in measured["runs"]:
        assert run["stable"] is False and run["stop_reason"] == "max_calls" and run["calls"] == 50
    assert measured["selection"]["stable"] is False
    assert all(run["stable"] for run in rows(graph)[strat.baseline.describe()].measurements["runs"])


def test_broken_candidates_are_reported_and_the_rest_still_measured(clock):
    fast = TimedBackend(clock, ms_per_call=0.5)
    strat = strategy(tt.HighestThroughputStrategy, clock, [WrongOutputBackend(), FailingBuildBackend(), fast])
    _, _, graph = tune(strat)
    by_name = rows(graph)
    assert by_name["WrongOutputBackend()"].status == "rejected"
    assert by_name["FailingBuildBackend()"].status == "build_failed"
    assert by_name["WrongOutputBackend()"].measurements is None
    assert graph.chosen == fast.describe()


def test_out_of_memory_at_a_larger_batch_keeps_the_smaller_ones(clock):
    # Recorded at batches 1 and 2 (the fidelity check passes); the batch search widens the graph to 8.
    limited = TimedBackend(clock, ms_per_call=0.2, oom_above_batch=2)
    strat = strategy(tt.HighestThroughputStrategy, clock, [limited], eager_ms=10.0, find_max_batch_size=True,
                     max_batch_size_limit=8)
    _, _, graph = tune(strat, batch_sizes=(1, 2))
    assert graph.batch_search["max_batch_size"] == 8
    measured = rows(graph)[limited.describe()].measurements
    assert measured["batch_sizes"] == [1, 2] and measured["stop_reason"] == "out_of_memory"
    assert measured["error_batch_size"] == 4 and "OutOfMemoryError" in measured["error"]
    assert graph.chosen == limited.describe()


def test_eager_baseline_failure_skips_the_gate_and_total_failure_raises(clock):
    fast = TimedBackend(clock, ms_per_call=0.5)
    strat = strategy(tt.HighestThroughputStrategy, clock, [fast], baseline=FailingBuildBackend())
    _, _, graph = tune(strat)
    assert graph.chosen == fast.describe() and "eager baseline failed" in graph.reason
    broken = strategy(tt.HighestThroughputStrategy, clock, [WrongOutputBackend()], baseline=FailingBuildBackend())
    with pytest.raises(TuningError, match="could be built, checked and measured.*FailingBuildBackend"):
        tune(broken)


def test_hanging_candidate_is_abandoned_within_its_time_limit(clock):
    hanging = HangingBackend(max_wait_s=20)
    fast = TimedBackend(clock, ms_per_call=0.5)
    strat = strategy(tt.HighestThroughputStrategy, clock, [hanging, fast], candidate_time_limit_s=0.5)
    start = time.perf_counter()
    try:
        _, _, graph = tune(strat)
    finally:
        hanging.unblock()
    assert time.perf_counter() - start < 10.0  # not the 20 s it hangs for (a loaded CI machine took 3.2 s)
    row = rows(graph)["HangingBackend()"]
    assert row.status == "timeout" and "candidate_time_limit_s=0.5" in row.error
    assert graph.chosen == fast.describe()


def test_graph_without_batch_axis_is_measured_at_its_own_batch_only(clock):
    fast = TimedBackend(clock, ms_per_call=0.5)
    strat = strategy(tt.HighestThroughputStrategy, clock, [fast], find_max_batch_size=True)
    _, _, graph = tune(strat, batch_sizes=(4,))
    assert "no batch axis" in graph.batch_search["skipped"]
    for row in graph.candidates:
        (run,) = row.measurements["runs"]
        assert run["batch_size"] == 4 and run["batched"] is False
    assert rows(graph)[fast.describe()].measurements["selection"]["throughput"] == pytest.approx(4 / 0.5e-3)


def test_max_batch_size_search_extends_the_graph(clock):
    # Throughput b / (1 + b^2/64 ms) peaks at batch 8; tuning only recorded batches 1 and 2.
    curve = {"ms_per_call": 1.0, "ms_per_sample_squared": 1 / 64}
    candidate = TimedBackend(clock, ms_per_call=0.5, ms_per_sample_squared=1 / 64)
    strat = strategy(tt.HighestThroughputStrategy, clock, [candidate], max_batch_size_limit=64,
                     baseline=TimedBackend(clock, **curve))
    assert strat.find_max_batch_size is False and strat.enable_find_max_batch_size() is strat
    wrapped, _, graph = tune(strat, batch_sizes=(1, 2))
    search = graph.batch_search
    assert search["sweep"]["batch_sizes"] == [1, 2, 4, 8, 16] and search["max_batch_size"] == 8 and search["extended"]
    assert wrapped.graph_specs[0].batch_range() == (1, 8)
    assert graph.spec["inputs"][0]["max_shape"][0] == 8
    assert rows(graph)[candidate.describe()].measurements["batch_sizes"] == [1, 2, 4, 8]
    assert graph.chosen == candidate.describe()


def test_default_candidates_cover_every_available_backend():
    names = [b.describe() for b in default_candidates()]
    assert "TorchInductorBackend()" in names and names[-1] == "TorchEagerBackend()"
    if available("OpenVINOBackend"):
        assert names[:2] == ["OpenVINOBackend()", "OpenVINOBackend(performance_hint=THROUGHPUT)"]
    if available("TorchAOBackend"):
        assert "TorchAOBackend()" in names
    assert [b.describe() for b in tt.HighestThroughputStrategy().candidates()] == names


def test_tune_defaults_to_highest_throughput():
    report = tt.tune(tt.Module(mlp()), [torch.randn(8)] * 2, dry_run=True)
    assert report.modules[0].graphs[0].strategy.startswith("HighestThroughputStrategy(")


def test_real_clock_eager_only_run_is_short():
    profiling = ProfilingConfig(max_time_s=0.05, min_time_s=0.01, warmup_calls=1, pause_s=0)
    strat = tt.HighestThroughputStrategy([TorchEagerBackend()], profiling=profiling, candidate_time_limit_s=None)
    wrapped, _, graph = tune(strat, batch_sizes=(1, 2))
    (row,) = graph.candidates
    assert row.role == "baseline" and row.status == "chosen" and graph.reason.startswith("eager was the only")
    assert row.measurements["selection"]["throughput"] > 0
    x = torch.randn(2, 8)
    assert torch.equal(wrapped(x), mlp()(x))


class _LowPrecision(TimedBackend):
    """Fast, but its outputs are off (as bf16 can be on a deep random network); has an exact variant."""

    @property
    def executed_precision(self) -> str:
        return "bf16"

    def _infer(self, *args, **kwargs):
        return super()._infer(*args, **kwargs) + 1.0

    def precision_fallback(self):
        return TimedBackend(self.clock, ms_per_call=self.timing.ms_per_call * 2, label="exact")


def test_rejected_reduced_precision_candidate_gets_a_higher_precision_retry(clock):
    low = _LowPrecision(clock, ms_per_call=0.2)
    strat = strategy(tt.HighestThroughputStrategy, clock, [low], eager_ms=1.0)
    _, _, graph = tune(strat)
    statuses = [(c.backend, c.status) for c in graph.candidates]
    assert statuses[1] == (low.describe(), "rejected") and "FidelityError" in graph.candidates[1].error
    assert statuses[2] == ("TimedBackend(ms_per_call=0.4,label=exact)", "chosen")
    assert graph.chosen == "TimedBackend(ms_per_call=0.4,label=exact)"


def test_openvino_default_precision_has_an_f32_fallback():
    pytest.importorskip("openvino")
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    retry = OpenVINOBackend(OpenVINOBackendConfig(performance_hint="THROUGHPUT")).precision_fallback()
    assert retry.describe() == "OpenVINOBackend(performance_hint=THROUGHPUT,inference_precision=f32)"
    assert OpenVINOBackend(OpenVINOBackendConfig(inference_precision="bf16")).precision_fallback() is None


def test_a_size_the_check_ran_in_a_call_as_long_as_a_warm_up_is_measured_without_one(clock):
    """The fidelity check runs every recorded call right before the sweep; a warm-up call at a size the check ran
    (in a call at least ``warmup_max_s`` long) would repeat it: a BERT-base at batch 32 spent 2.6-4.8 s per candidate
    on it. The eager baseline's confirming check runs its smallest call only: its other sizes are warmed up."""
    fast = TimedBackend(clock, ms_per_call=0.5)
    quick = ProfilingConfig(clock=clock, pause_s=0, min_time_s=0, warmup_max_s=0.0)  # every checked call is long
    _, _, graph = tune(strategy(tt.HighestThroughputStrategy, clock, [fast], profiling=quick))
    warm_ups = {c.role: {r["batch_size"]: r["warmup_calls"] for r in c.measurements["runs"]} for c in graph.candidates}
    assert warm_ups == {"candidate": {1: 0, 2: 0, 4: 0, 8: 0}, "baseline": {1: 0, 2: 1, 4: 1, 8: 1}}
    _, _, graph = tune(strategy(tt.HighestThroughputStrategy, clock, [TimedBackend(clock, ms_per_call=0.5)]))
    assert all(r["warmup_calls"] >= 1 for c in graph.candidates for r in c.measurements["runs"])  # calls of µs


def test_warm_shapes_hold_through_a_non_finite_guard_and_go_when_the_scratch_buffers_do():
    from torch_tweak.torch.backend.non_finite_guard import NonFiniteGuardBackend
    from torch_tweak.torch.tune_strategy import warm_calls
    from torch_tweak.torch.tune_strategy.base import release_scratch

    model = mlp()
    wrapped = tt.Module(model, strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(2)], batch_sizes=[1, 2])
    inner = next(iter(wrapped.backends.values()))
    guard = NonFiniteGuardBackend(inner, model, wrapped.graph_specs[0], "test")
    x = torch.randn(4, 8)
    warm_calls.note(inner, (x,), {}, 0.5)
    assert warm_calls.warm(inner, (torch.zeros(4, 8),), {}, 0.25) and warm_calls.warm(guard, (x,), {}, 0.25)
    assert not warm_calls.warm(inner, (x,), {}, 1.0)  # a shorter call than asked for
    assert not warm_calls.warm(inner, (torch.randn(2, 8),), {}, 0.25)  # another shape
    assert not warm_calls.warm(inner, (x.double(),), {}, 0.25)  # another dtype
    release_scratch(guard)
    assert not warm_calls.warm(guard, (x,), {}, 0.25) and not warm_calls.warm(inner, (x,), {}, 0.25)
