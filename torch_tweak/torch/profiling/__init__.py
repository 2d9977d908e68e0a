"""Profiling: bounded, stable measurements of a callable, and batch-size sweeps."""

from torch_tweak.torch.profiling.config import ProfilingConfig
from torch_tweak.torch.profiling.measure import (
    Measurement,
    ProfilingCancelledError,
    coefficient_of_variation,
    device_sync,
    measure,
    percentile,
)
from torch_tweak.torch.profiling.sweep import SweepResult, is_out_of_memory, power_of_two_batch_sizes, sweep

__all__ = [
    "Measurement",
    "ProfilingCancelledError",
    "ProfilingConfig",
    "SweepResult",
    "coefficient_of_variation",
    "device_sync",
    "is_out_of_memory",
    "measure",
    "percentile",
    "power_of_two_batch_sizes",
    "sweep",
]
