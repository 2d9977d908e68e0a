"""The profiling engine with a fake clock: stop rules, caps, statistics, sweeps, failures, cancellation."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
import torch

from torch_tweak.errors import ConfigError
from torch_tweak.torch.profiling import (
    ProfilingCancelledError,
    ProfilingConfig,
    coefficient_of_variation,
    device_sync,
    measure,
    percentile,
    power_of_two_batch_sizes,
    sweep,
)
from torch_tweak.torch.profiling.limit import run_with_time_limit
from torch_tweak.torch.testing import FakeClock


def config(clock: FakeClock, **overrides) -> ProfilingConfig:
    return ProfilingConfig(clock=clock, **{"pause_s": 0, "min_time_s": 0, **overrides})


def ticking(clock: FakeClock, costs_ms):
    """A call that advances ``clock`` by the next cost of ``costs_ms`` (cycled)."""
    costs = itertools.cycle(costs_ms)
    return lambda: clock.advance(next(costs) / 1000.0)


@pytest.mark.parametrize("field,value", [
    ("window_size", 1), ("cv_threshold", 0), ("cv_threshold", 1.5), ("max_time_s", 0), ("max_time_s", float("inf")),
    ("max_calls", 0), ("min_calls", 0), ("min_time_s", -1), ("warmup_calls", -1), ("saturation_patience", 0),
    ("saturation_threshold", -0.1), ("pause_s", -1), ("warmup_calls", True), ("clock", "now"),
])
def test_config_refuses_bad_values(field, value):
    with pytest.raises(ConfigError, match=field):
        ProfilingConfig(**{field: value})


def test_config_refuses_inconsistent_caps():
    with pytest.raises(ConfigError, match="max_calls"):
        ProfilingConfig(min_calls=20, max_calls=10)
    with pytest.raises(ConfigError, match="min_time_s"):
        ProfilingConfig(min_time_s=2, max_time_s=1)
    with pytest.raises(ConfigError, match="window_size"):
        ProfilingConfig(window_size=20, min_calls=5, max_calls=10)
    assert "clock" not in ProfilingConfig().to_dict()


def test_statistics_helpers():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert percentile(list(range(101)), 99) == pytest.approx(99)
    assert coefficient_of_variation([2, 2, 2]) == 0
    assert coefficient_of_variation([1, 3]) == pytest.approx(0.5)
    assert device_sync("cpu") is None and device_sync(None) is None


def test_steady_calls_stop_as_soon_as_the_window_is_stable():
    clock = FakeClock()
    m = measure(ticking(clock, [2.0]), 4, config(clock, warmup_calls=3))
    assert m.stable and m.stop_reason == "stable"
    assert m.calls == 10 and len(m.warmup_ms) == 3
    assert m.p50_ms == pytest.approx(2.0) and m.p99_ms == pytest.approx(2.0)
    assert m.throughput == pytest.approx(4 / 0.002)


def test_stable_calls_still_run_for_the_minimum_time():
    clock = FakeClock()
    m = measure(ticking(clock, [2.0]), 1, config(clock, min_time_s=0.1))
    assert m.stable and m.calls == 50


def test_warmup_is_excluded_from_statistics():
    clock = FakeClock()
    m = measure(ticking(clock, [50.0, 50.0] + [1.0] * 1000), 1, config(clock, warmup_calls=2))
    assert m.warmup_ms == pytest.approx([50.0, 50.0])
    assert max(m.times_ms) == pytest.approx(1.0)


def test_warmup_is_bounded_in_time():
    clock = FakeClock()
    m = measure(ticking(clock, [300.0]), 1, config(clock, warmup_calls=50, warmup_max_s=0.5, max_time_s=1.0))
    assert len(m.warmup_ms) == 2


def test_a_warmed_call_is_timed_without_a_warm_up_and_a_sweep_asks_per_size():
    clock = FakeClock()
    m = measure(ticking(clock, [300.0]), 1, config(clock, warmup_calls=5, max_time_s=1.0), warmed=True)
    assert m.warmup_ms == [] and m.calls >= 1
    prepare, prepared = timed_prepare(clock, 1.0, 1.0)
    asked = []
    result = sweep(prepare, [1, 2, 4], config(clock), warmed=lambda b: asked.append((b, list(prepared))) or b == 4)
    assert [len(m.warmup_ms) > 0 for m in result.measurements] == [True, True, False]
    assert asked == [(1, [1]), (2, [1, 2]), (4, [1, 2, 4])]  # after preparing that size


def test_never_stable_measurement_is_capped_by_calls_and_still_usable():
    clock = FakeClock()
    m = measure(ticking(clock, [1.0, 3.0]), 2, config(clock, max_calls=40))
    assert not m.stable and m.stop_reason == "max_calls" and m.calls == 40
    assert m.window_cv == pytest.approx(0.5)
    assert m.p50_ms == pytest.approx(2.0) and m.p99_ms == pytest.approx(3.0)
    assert m.throughput == pytest.approx(1000.0)
    data = json.loads(json.dumps(m.to_dict()))
    assert data["stable"] is False and len(data["times_ms"]) == 40 and data["unit"] == "samples/s"


def test_slow_calls_are_capped_by_time():
    clock = FakeClock()
    m = measure(ticking(clock, [250.0, 400.0]), 1, config(clock, max_time_s=1.0, warmup_calls=1))
    assert m.stop_reason == "max_time" and not m.stable
    assert m.times_ms == pytest.approx([400.0, 250.0, 400.0]) and m.elapsed_s == pytest.approx(1.05)


def test_device_sync_is_inside_the_timed_region():
    clock = FakeClock()
    # The call only queues work (0.1 ms); the device finishes it when synchronized (2 ms).
    m = measure(ticking(clock, [0.1]), 1, config(clock), sync=lambda: clock.advance(0.002))
    assert m.p50_ms == pytest.approx(2.1)


def test_cancel_stops_the_measurement():
    clock = FakeClock()
    cancel = threading.Event()

    def call():
        clock.advance(0.001)
        cancel.set()

    with pytest.raises(ProfilingCancelledError):
        measure(call, 1, config(clock, warmup_calls=0), cancel=cancel)


@pytest.mark.parametrize("low,high,expected", [
    (1, 1, [1]), (1, 6, [1, 2, 4]), (1, 8, [1, 2, 4, 8]), (3, 20, [4, 8, 16]), (5, 7, [5]),
])
def test_power_of_two_batch_sizes(low, high, expected):
    assert power_of_two_batch_sizes(low, high) == expected


def test_power_of_two_batch_sizes_refuses_bad_bounds():
    with pytest.raises(ConfigError):
        power_of_two_batch_sizes(0, 4)
    with pytest.raises(ConfigError):
        power_of_two_batch_sizes(8, 4)


def timed_prepare(clock: FakeClock, per_call_ms: float, per_sample_ms: float, fail_at: int | None = None,
                  error: Exception | None = None):
    prepared = []

    def prepare(batch_size: int):
        prepared.append(batch_size)
        if fail_at is not None and batch_size >= fail_at:
            def fail():
                raise error
            return fail
        return ticking(clock, [per_call_ms + per_sample_ms * batch_size])

    return prepare, prepared


def test_sweep_stops_when_throughput_saturates():
    clock = FakeClock()
    # 1 ms fixed + 1 ms per sample: 500, 667, 800, 889, 941 samples/s; the gain falls under 10 % at batch 16.
    prepare, prepared = timed_prepare(clock, 1.0, 1.0)
    result = sweep(prepare, [1, 2, 4, 8, 16, 32], config(clock, saturation_threshold=0.1))
    assert prepared == [1, 2, 4, 8, 16] and result.stop_reason == "saturated"
    assert result.best().batch_size == 16
    assert result.to_dict()["best_batch_size"] == 16


def test_sweep_patience_allows_more_batch_sizes():
    clock = FakeClock()
    prepare, prepared = timed_prepare(clock, 1.0, 1.0)
    result = sweep(prepare, [1, 2, 4, 8, 16, 32, 64], config(clock, saturation_threshold=0.1, saturation_patience=2))
    assert prepared == [1, 2, 4, 8, 16, 32] and result.stop_reason == "saturated"


def test_sweep_completes_when_throughput_keeps_growing():
    clock = FakeClock()
    prepare, prepared = timed_prepare(clock, 10.0, 0.01)
    result = sweep(prepare, [1, 2, 4], config(clock))
    assert prepared == [1, 2, 4] and result.stop_reason == "completed" and result.error is None


def test_out_of_memory_ends_the_sweep_gracefully():
    clock = FakeClock()
    prepare, _ = timed_prepare(clock, 10.0, 0.01, fail_at=8, error=torch.OutOfMemoryError("out of memory"))
    result = sweep(prepare, [1, 2, 4, 8, 16], config(clock))
    assert [m.batch_size for m in result.measurements] == [1, 2, 4]
    assert result.stop_reason == "out_of_memory" and result.error_batch_size == 8
    assert "OutOfMemoryError" in result.error and result.best().batch_size == 4


def test_backend_error_at_the_first_batch_size_leaves_nothing_measured():
    clock = FakeClock()
    prepare, _ = timed_prepare(clock, 1.0, 0.0, fail_at=1, error=ValueError("shape mismatch"))
    result = sweep(prepare, [1, 2], config(clock))
    assert result.measurements == [] and result.best() is None
    assert result.stop_reason == "error" and result.error == "ValueError: shape mismatch"


def test_keep_going_ends_the_sweep():
    clock = FakeClock()
    prepare, prepared = timed_prepare(clock, 1.0, 1.0)
    result = sweep(prepare, [1, 2, 4, 8], config(clock), keep_going=lambda m: m.p99_ms < 3.5)
    assert prepared == [1, 2, 4] and result.stop_reason == "limit"


def test_sweep_takes_known_measurements_instead_of_measuring_again():
    clock = FakeClock()
    prepare, prepared = timed_prepare(clock, 10.0, 0.01)
    ends = sweep(prepare, [1, 8], config(clock))  # what screening measured
    prepared.clear()
    result = sweep(prepare, [1, 2, 4, 8], config(clock), known=ends.measurements)
    assert prepared == [2, 4]
    assert [m.batch_size for m in result.measurements] == [1, 2, 4, 8]
    assert result.measurements[0] is ends.measurements[0] and result.measurements[-1] is ends.measurements[-1]


def test_a_known_measurement_past_a_saturated_sweep_is_kept_but_not_past_an_error():
    clock = FakeClock()
    prepare, prepared = timed_prepare(clock, 1.0, 1.0)
    ends = sweep(prepare, [1, 64], config(clock))
    prepared.clear()
    result = sweep(prepare, [1, 2, 4, 8, 16, 32, 64], config(clock, saturation_threshold=0.1), known=ends.measurements)
    assert prepared == [2, 4, 8, 16] and result.stop_reason == "saturated"
    assert [m.batch_size for m in result.measurements] == [1, 2, 4, 8, 16, 64]
    failing, _ = timed_prepare(clock, 1.0, 1.0, fail_at=4, error=ValueError("bad shape"))
    broken = sweep(failing, [1, 2, 4, 8, 16, 32, 64], config(clock), known=ends.measurements)
    assert [m.batch_size for m in broken.measurements] == [1, 2] and broken.error == "ValueError: bad shape"


def test_sweep_refuses_an_empty_batch_list():
    with pytest.raises(ConfigError):
        sweep(lambda bs: (lambda: None), [])


def test_time_limit_abandons_a_hanging_call_and_cancels_cooperative_work():
    release = threading.Event()
    start = time.perf_counter()
    finished, value = run_with_time_limit(lambda cancel: release.wait(20), 0.2)
    assert not finished and value is None
    assert time.perf_counter() - start < 2.0
    release.set()
    seen = []

    def cooperative(cancel):
        while not cancel.wait(0.01):
            pass
        seen.append("cancelled")

    assert run_with_time_limit(cooperative, 0.1) == (False, None)
    assert seen == ["cancelled"]
    assert run_with_time_limit(lambda cancel: 42, 1.0) == (True, 42)
    assert run_with_time_limit(lambda cancel: torch.is_grad_enabled(), None) == (True, True)
    with torch.no_grad():
        assert run_with_time_limit(lambda cancel: torch.is_grad_enabled(), 1.0) == (True, False)
    with pytest.raises(KeyError):
        run_with_time_limit(lambda cancel: {}["missing"], 1.0)
