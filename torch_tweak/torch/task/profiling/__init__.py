"""Reference-compatible import path (``docs/migrating.md``): the stop strategies, mapped onto
:class:`~torch_tweak.torch.profiling.ProfilingConfig` by :mod:`torch_tweak.torch.profiling.stop_rules`."""

from torch_tweak.torch.profiling.stop_rules import (
    AllSamplesProfilingStopStrategy,
    NumStepsMeasuringStopStrategy,
    StableWindowMeasuringStopStrategy,
    ThroughputSaturatedProfilingStopStrategy,
)

__all__ = [
    "AllSamplesProfilingStopStrategy",
    "NumStepsMeasuringStopStrategy",
    "StableWindowMeasuringStopStrategy",
    "ThroughputSaturatedProfilingStopStrategy",
]
