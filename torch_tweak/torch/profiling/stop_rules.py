"""The reference Torch Tweak's stop strategies, as settings of a :class:`ProfilingConfig`.

The reference configures measurements with stop-strategy objects; here they are fields of
:class:`ProfilingConfig`. Each class below is a small value object whose :meth:`apply` returns a copy of a
``ProfilingConfig`` with the equivalent fields set, so ``HighestThroughputStrategy(measurement_stop_strategy=
StableWindowMeasuringStopStrategy(window_size=20))`` keeps working (``docs/migrating.md``). Every measurement
stays bounded by ``max_time_s``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch_tweak.errors import ConfigError
from torch_tweak.torch.profiling.config import ProfilingConfig
from torch_tweak.utils.validate import check_int


@dataclass(frozen=True)
class NumStepsMeasuringStopStrategy:
    """Measure exactly ``num_steps`` timed calls per batch size (or until ``max_time_s``)."""

    num_steps: int = 10

    def __post_init__(self) -> None:
        check_int(self.num_steps, "NumStepsMeasuringStopStrategy.num_steps", minimum=2)

    def apply(self, profiling: ProfilingConfig) -> ProfilingConfig:
        """``min_calls = max_calls = num_steps``, no minimum time."""
        window = min(profiling.window_size, self.num_steps)
        return dataclasses.replace(profiling, min_calls=self.num_steps, max_calls=self.num_steps, window_size=window,
                                   min_time_s=0.0)


@dataclass(frozen=True)
class StableWindowMeasuringStopStrategy:
    """Stop once the last ``window_size`` calls are stable: their spread is within ``stability_percentage`` %.

    Mapped to ``window_size`` and ``cv_threshold = stability_percentage / 100`` (at most 0.99); the reference's
    default of 95 is a loose rule, torch_tweak's own default is a 5 % coefficient of variation.
    """

    window_size: int = 10
    stability_percentage: float = 95.0

    def __post_init__(self) -> None:
        check_int(self.window_size, "StableWindowMeasuringStopStrategy.window_size", minimum=2)
        value = self.stability_percentage
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 100:
            raise ConfigError(f"StableWindowMeasuringStopStrategy.stability_percentage must be a number in (0, 100], "
                              f"got {value!r}.")

    def apply(self, profiling: ProfilingConfig) -> ProfilingConfig:
        """Set ``window_size`` and ``cv_threshold``."""
        return dataclasses.replace(profiling, window_size=self.window_size,
                                   max_calls=max(profiling.max_calls, self.window_size),
                                   cv_threshold=min(self.stability_percentage / 100.0, 0.99))


@dataclass(frozen=True)
class ThroughputSaturatedProfilingStopStrategy:
    """End a batch-size sweep once throughput stops rising by more than ``throughput_cutoff_threshold``, after
    ``throughput_backoff_limit`` more batch sizes."""

    throughput_cutoff_threshold: float = 0.05
    throughput_backoff_limit: int = 2

    def __post_init__(self) -> None:
        value = self.throughput_cutoff_threshold
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ConfigError(f"ThroughputSaturatedProfilingStopStrategy.throughput_cutoff_threshold must be in [0, 1), "
                              f"got {value!r}.")
        check_int(self.throughput_backoff_limit, "ThroughputSaturatedProfilingStopStrategy.throughput_backoff_limit",
                  minimum=0)

    def apply(self, profiling: ProfilingConfig) -> ProfilingConfig:
        """``saturation_threshold = throughput_cutoff_threshold``, ``saturation_patience = backoff + 1``."""
        return dataclasses.replace(profiling, saturation_threshold=float(self.throughput_cutoff_threshold),
                                   saturation_patience=self.throughput_backoff_limit + 1)


@dataclass(frozen=True)
class AllSamplesProfilingStopStrategy:
    """Measure every batch size of the sweep (no early stop on saturation)."""

    def apply(self, profiling: ProfilingConfig) -> ProfilingConfig:
        """A saturation patience larger than any sweep."""
        return dataclasses.replace(profiling, saturation_patience=1 << 20)


MEASUREMENT_STOP_RULES = (NumStepsMeasuringStopStrategy, StableWindowMeasuringStopStrategy)
PROFILING_STOP_RULES = (ThroughputSaturatedProfilingStopStrategy, AllSamplesProfilingStopStrategy)


def apply_stop_rules(profiling: ProfilingConfig, measurement: object = None, sweep: object = None,
                     owner: str = "strategy") -> ProfilingConfig:
    """``profiling`` with a reference ``measurement_stop_strategy`` and ``profiling_stop_strategy`` applied."""
    for value, allowed, name in ((measurement, MEASUREMENT_STOP_RULES, "measurement_stop_strategy"),
                                 (sweep, PROFILING_STOP_RULES, "profiling_stop_strategy")):
        if value is None:
            continue
        if not isinstance(value, allowed):
            raise ConfigError(f"{owner}: {name} must be one of {[c.__name__ for c in allowed]} (from "
                              f"torch_tweak.torch.profiling.stop_rules), got {type(value).__name__}. Custom stop "
                              "strategies are not supported; set the fields of ProfilingConfig instead.")
        profiling = value.apply(profiling)  # type: ignore[attr-defined]
    return profiling
