"""Executors: where candidates are built, checked and measured (``tt.tune(..., executor=...)``).

``"process"`` (the default, :class:`ProcessExecutor`): a worker process on this machine, so a candidate that
crashes, runs out of memory or hangs becomes a report row. ``"inline"`` (:class:`InlineExecutor`): this
process, for debugging. :class:`RayExecutor` (extra ``ray``): Ray tasks across machines.
"""

from __future__ import annotations

from typing import Any

from torch_tweak.errors import ConfigError
from torch_tweak.torch.executor.base import Done, Executor, Failure, InlineExecutor, Pending, Shared
from torch_tweak.torch.executor.process import ProcessExecutor

EXECUTOR_NAMES = ("process", "inline")

__all__ = ["EXECUTOR_NAMES", "Done", "Executor", "Failure", "InlineExecutor", "Pending", "ProcessExecutor",
           "RayExecutor", "Shared", "resolve_executor"]


def resolve_executor(value: Any) -> tuple[Executor, bool]:
    """``(executor, owned)`` for a ``tt.tune(executor=...)`` value: a name of :data:`EXECUTOR_NAMES` gives a new
    executor that the caller owns (closes after tuning); an :class:`Executor` is used as given."""
    if isinstance(value, Executor):
        return value, False
    if value == "process":
        return ProcessExecutor(), True
    if value == "inline":
        return InlineExecutor(), True
    raise ConfigError(f"executor must be one of {EXECUTOR_NAMES} or an Executor instance (e.g. "
                      f"torch_tweak.torch.executor.ProcessExecutor(memory_limit_gb=8)), got {value!r}.")


def __getattr__(name: str) -> Any:
    if name == "RayExecutor":  # imports ray only when asked for
        from torch_tweak.torch.executor.ray_executor import RayExecutor

        return RayExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
