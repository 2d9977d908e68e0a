"""ProfilingConfig: how long and how carefully one candidate is measured.

A measurement at one batch size runs a short warm-up, then timed calls until the last ``window_size``
calls are stable (their coefficient of variation is at most ``cv_threshold``) after at least
``min_calls`` calls and ``min_time_s`` seconds, or until a cap is reached
(``max_calls`` calls or ``max_time_s`` seconds, whichever comes first). A measurement stopped by a cap
is marked unstable but still used. A batch-size sweep stops when throughput saturates: after
``saturation_patience`` batch sizes in a row that do not improve the best throughput by more than
``saturation_threshold``.

The clock is injectable (``clock``, seconds as a float) so tests can drive time deterministically.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch_tweak.errors import ConfigError
from torch_tweak.utils.validate import check_int


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    check_int(value, f"{owner}.{name}", minimum=minimum)


def _check_float(owner: str, name: str, value: Any, *, positive: bool, upper: float | None = None) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = value > 0 if positive else value >= 0
    if ok and upper is not None:
        ok = value < upper
    if not ok:
        bound = "> 0" if positive else ">= 0"
        extra = f" and < {upper}" if upper is not None else ""
        raise ConfigError(f"{owner}.{name} must be a finite number {bound}{extra}, got {value!r}.")


@dataclass
class ProfilingConfig:
    """Bounds and stop rules of a measurement (one batch size) and of a batch-size sweep.

    Attributes:
        warmup_calls: untimed calls before measuring (at least one runs, unless the caller of ``measure`` says a
            call like it ran already: ``warmed``).
        warmup_max_s: warm-up also ends once it has taken this long.
        window_size: number of most recent calls the stability test looks at.
        cv_threshold: the window is stable when stdev / mean of its call times is at most this.
        min_calls: timed calls made before the stability test may stop the measurement.
        min_time_s: seconds of timed calls before the stability test may stop the measurement (a few
            milliseconds of lucky calls on a busy machine are not a measurement).
        max_calls: cap on timed calls at one batch size.
        max_time_s: cap on seconds of timed calls at one batch size (the last call may end past it).
        saturation_threshold: a larger batch size must raise the best throughput by more than this
            fraction to count as an improvement.
        saturation_patience: the sweep stops after this many batch sizes in a row without improvement.
        pause_s: pause before measuring each candidate, so the previous runtime's worker threads go idle
            (torch and OpenVINO thread pools slow each other down when they overlap); the blocks of candidates
            timed in turns pause for at most 0.05 s of it each (0 turns both off). 0.05 s is enough: a BERT-base's
            OpenVINO call at batch 1 right after ONNX Runtime calls took 168 against 145 ms on 2 vCPUs, and 145 ms
            after a 50 ms pause; the 0.2 s of before slept about 5 s of an MLP 256-512-256's 30 s tuning.
        clock: returns the current time in seconds (``time.perf_counter`` by default).
    """

    warmup_calls: int = 5
    warmup_max_s: float = 0.25
    window_size: int = 10
    cv_threshold: float = 0.05
    min_calls: int = 10
    min_time_s: float = 0.1
    max_calls: int = 1000
    max_time_s: float = 0.5
    saturation_threshold: float = 0.05
    saturation_patience: int = 1
    pause_s: float = 0.05
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_int(owner, "warmup_calls", self.warmup_calls, 0)
        _check_float(owner, "warmup_max_s", self.warmup_max_s, positive=False)
        _check_int(owner, "window_size", self.window_size, 2)
        _check_float(owner, "cv_threshold", self.cv_threshold, positive=True, upper=1.0)
        _check_int(owner, "min_calls", self.min_calls, 1)
        _check_float(owner, "min_time_s", self.min_time_s, positive=False)
        _check_int(owner, "max_calls", self.max_calls, 1)
        _check_float(owner, "max_time_s", self.max_time_s, positive=True)
        _check_float(owner, "saturation_threshold", self.saturation_threshold, positive=False, upper=1.0)
        _check_int(owner, "saturation_patience", self.saturation_patience, 1)
        _check_float(owner, "pause_s", self.pause_s, positive=False)
        if self.max_calls < self.min_calls:
            raise ConfigError(
                f"{owner}: max_calls ({self.max_calls}) is below min_calls ({self.min_calls}); raise max_calls or "
                "lower min_calls."
            )
        if self.min_time_s > self.max_time_s:
            raise ConfigError(
                f"{owner}: min_time_s ({self.min_time_s}) is above max_time_s ({self.max_time_s}); lower min_time_s "
                "or raise max_time_s."
            )
        if self.window_size > self.max_calls:
            raise ConfigError(
                f"{owner}: window_size ({self.window_size}) is larger than max_calls ({self.max_calls}), so the "
                "measurement could never be stable; lower window_size or raise max_calls."
            )
        if not callable(self.clock):
            raise ConfigError(f"{owner}.clock must be callable and return seconds, got {self.clock!r}.")

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-able values (without the clock)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "clock"}
