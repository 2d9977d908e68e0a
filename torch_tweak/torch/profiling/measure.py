"""Measuring one callable at one batch size: warm-up, timed calls until stable or capped, statistics."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_tweak.errors import TorchTweakError
from torch_tweak.torch._device import synchronize
from torch_tweak.torch.profiling.config import ProfilingConfig
from torch_tweak.utils.pause import paused

logger = logging.getLogger(__name__)

# Why a measurement stopped
STABLE = "stable"
MAX_CALLS = "max_calls"
MAX_TIME = "max_time"

_MIN_SECONDS = 1e-9  # a call never counts as faster than 1 ns (keeps throughput finite with coarse clocks)


class ProfilingCancelledError(TorchTweakError, RuntimeError):
    """The measurement was cancelled from outside (the candidate ran out of time)."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation between ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population standard deviation divided by the mean (0 for a zero mean)."""
    n = len(values)
    mean = sum(values) / n
    if mean <= 0:
        return 0.0
    variance = sum((v - mean) ** 2 for v in values) / n
    return math.sqrt(variance) / mean


def device_sync(device: torch.device | str | None) -> Callable[[], None] | None:
    """A function that waits for queued work on ``device``, or None where calls are synchronous (CPU)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return None
    return lambda: synchronize(device)


@dataclass
class Measurement:
    """Timings of one callable at one batch size.

    Throughput and p50 use the median call time of all timed calls, which resists the outliers that a
    shared machine produces; the warm-up calls are kept apart and never enter the statistics.

    Attributes:
        batch_size: samples processed per call.
        times_ms: every timed call, in milliseconds, in call order.
        warmup_ms: the warm-up calls, in milliseconds.
        stable: True if the last ``window_size`` calls met the coefficient-of-variation threshold.
        stop_reason: ``stable``, ``max_calls`` or ``max_time``.
        elapsed_s: wall time of the timed phase.
        batched: False for graphs without a batch axis (measured as recorded, at their own batch size).
    """

    batch_size: int
    times_ms: list[float]
    warmup_ms: list[float] = field(default_factory=list)
    stable: bool = False
    stop_reason: str = MAX_CALLS
    elapsed_s: float = 0.0
    batched: bool = True
    window_cv: float = 0.0

    @property
    def calls(self) -> int:
        """Number of timed calls."""
        return len(self.times_ms)

    @property
    def p50_ms(self) -> float:
        """Median latency (ms)."""
        return percentile(self.times_ms, 50)

    @property
    def p90_ms(self) -> float:
        """90th percentile latency (ms)."""
        return percentile(self.times_ms, 90)

    @property
    def p99_ms(self) -> float:
        """99th percentile latency (ms); with fewer than 100 calls it approaches the slowest call."""
        return percentile(self.times_ms, 99)

    @property
    def mean_ms(self) -> float:
        """Mean latency (ms)."""
        return sum(self.times_ms) / len(self.times_ms)

    @property
    def throughput(self) -> float:
        """Samples per second: ``batch_size`` over the median call time."""
        return self.batch_size / max(self.p50_ms / 1000.0, _MIN_SECONDS)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary plus the raw per-call times (ms)."""
        return {
            "batch_size": self.batch_size,
            "batched": self.batched,
            "throughput": self.throughput,
            "unit": "samples/s",
            "p50_ms": self.p50_ms,
            "p90_ms": self.p90_ms,
            "p99_ms": self.p99_ms,
            "mean_ms": self.mean_ms,
            "min_ms": min(self.times_ms),
            "window_cv": self.window_cv,
            "calls": self.calls,
            "warmup_calls": len(self.warmup_ms),
            "stable": self.stable,
            "stop_reason": self.stop_reason,
            "elapsed_s": self.elapsed_s,
            "times_ms": [round(t, 6) for t in self.times_ms],
            "warmup_ms": [round(t, 6) for t in self.warmup_ms],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        """Rebuild a measurement from :meth:`to_dict` (reused tuning results); ValueError if malformed."""
        try:
            times = [float(t) for t in data["times_ms"]]
            warmup = [float(t) for t in data["warmup_ms"]]
            batch_size = data["batch_size"]
            if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1 or not times:
                raise ValueError("bad batch size or no timed calls")
            return cls(batch_size, times, warmup, bool(data["stable"]), str(data["stop_reason"]),
                       float(data["elapsed_s"]), bool(data["batched"]), float(data["window_cv"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a stored measurement: {exc}") from exc


def measure(
    fn: Callable[[], Any],
    batch_size: int,
    config: ProfilingConfig | None = None,
    *,
    sync: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
    batched: bool = True,
    warmed: bool = False,
) -> Measurement:
    """Time ``fn`` (one inference call on prepared inputs) until stable or capped.

    Args:
        fn: runs one call; its result is discarded.
        batch_size: samples per call (for throughput).
        config: stop rules and caps (defaults: :class:`ProfilingConfig`).
        sync: waits for the device after each call, inside the timed region (see :func:`device_sync`).
        cancel: when set, the next call raises :class:`ProfilingCancelledError`.
        batched: False when the graph has no batch axis (recorded in the result).
        warmed: the callable already ran a call like this one that took at least ``config.warmup_max_s``: no
            warm-up call (it would be one more call that long).

    Exceptions raised by ``fn`` propagate (a sweep turns them into its stop reason).
    """
    config = config or ProfilingConfig()
    clock = config.clock

    def timed() -> float:
        if cancel is not None and cancel.is_set():
            raise ProfilingCancelledError("the measurement was cancelled (the candidate's time limit was reached)")
        start = clock()
        fn()
        if sync is not None:
            sync()
        return (clock() - start) * 1000.0

    with paused():  # background compiles wait while this measures
        return _measure(timed, batch_size, config, batched, warmed)


def _measure(timed: Callable[[], float], batch_size: int, config: ProfilingConfig, batched: bool,
             warmed: bool = False) -> Measurement:
    clock = config.clock
    warmup: list[float] = []
    warm_start = clock()
    for _ in range(0 if warmed else config.warmup_calls):
        warmup.append(timed())
        if clock() - warm_start >= config.warmup_max_s:
            break

    times: list[float] = []
    window = config.window_size
    begin = clock()
    cv = float("nan")
    while True:
        times.append(timed())
        n = len(times)
        spent = clock() - begin
        if n >= window:
            cv = coefficient_of_variation(times[-window:])
            if n >= config.min_calls and spent >= config.min_time_s and cv <= config.cv_threshold:
                reason = STABLE
                break
        if n >= config.max_calls:
            reason = MAX_CALLS
            break
        if spent >= config.max_time_s:
            reason = MAX_TIME
            break
    elapsed = clock() - begin
    if n < window:
        cv = coefficient_of_variation(times)
    result = Measurement(batch_size, times, warmup, reason == STABLE, reason, elapsed, batched, cv)
    logger.debug("batch %d: %d calls, p50 %.3f ms, %.1f samples/s, %s", batch_size, n, result.p50_ms,
                 result.throughput, reason)
    return result
