"""Reference-compatible import path (``docs/migrating.md``); see :mod:`torch_tweak.torch.profiling.stop_rules`."""

from torch_tweak.torch.profiling.stop_rules import (
    AllSamplesProfilingStopStrategy,
    ThroughputSaturatedProfilingStopStrategy,
)

__all__ = ["AllSamplesProfilingStopStrategy", "ThroughputSaturatedProfilingStopStrategy"]
