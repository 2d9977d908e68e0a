"""Batch-size sweeps: measure at growing batch sizes until throughput saturates or a call fails."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_tweak.errors import ConfigError
from torch_tweak.torch.profiling.config import ProfilingConfig
from torch_tweak.torch.profiling.measure import Measurement, ProfilingCancelledError, measure

logger = logging.getLogger(__name__)

# Why a sweep stopped
COMPLETED = "completed"
SATURATED = "saturated"
OUT_OF_MEMORY = "out_of_memory"
ERROR = "error"
LIMIT = "limit"


def power_of_two_batch_sizes(low: int, high: int) -> list[int]:
    """Every power of two in ``[low, high]``; ``[low]`` when the range holds none."""
    if isinstance(low, bool) or isinstance(high, bool) or not isinstance(low, int) or not isinstance(high, int):
        raise ConfigError(f"Batch size bounds must be integers, got {low!r} and {high!r}.")
    if low < 1 or high < low:
        raise ConfigError(f"Batch size bounds must satisfy 1 <= low <= high, got low={low}, high={high}.")
    sizes = []
    size = 1
    while size <= high:
        if size >= low:
            sizes.append(size)
        size *= 2
    return sizes or [low]


def is_out_of_memory(exc: BaseException) -> bool:
    """True for PyTorch's out-of-memory errors, ``MemoryError`` and allocation failures reported as text."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "failed to allocate" in text or "bad_alloc" in text


@dataclass
class SweepResult:
    """The measurements of one candidate across batch sizes, and why the sweep stopped.

    Attributes:
        measurements: one per batch size reached, in sweep order.
        stop_reason: ``completed``, ``saturated``, ``out_of_memory``, ``error`` or ``limit`` (the
            caller's ``keep_going`` said stop).
        error: ``"ExceptionType: message"`` of the call that ended the sweep, if any.
        error_batch_size: the batch size at which that call failed.
    """

    measurements: list[Measurement] = field(default_factory=list)
    stop_reason: str = COMPLETED
    error: str | None = None
    error_batch_size: int | None = None

    def best(self) -> Measurement | None:
        """The measurement with the highest throughput (None if nothing was measured)."""
        return max(self.measurements, key=lambda m: m.throughput, default=None)

    def at(self, batch_size: int) -> Measurement | None:
        """The measurement at ``batch_size``, if that batch size was reached."""
        return next((m for m in self.measurements if m.batch_size == batch_size), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: the best batch size and throughput, the stop reason, and every run with raw times."""
        best = self.best()
        return {
            "best_batch_size": best.batch_size if best else None,
            "best_throughput": best.throughput if best else None,
            "unit": "samples/s",
            "batch_sizes": [m.batch_size for m in self.measurements],
            "stop_reason": self.stop_reason,
            "error": self.error,
            "error_batch_size": self.error_batch_size,
            "runs": [m.to_dict() for m in self.measurements],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepResult:
        """Rebuild a sweep from :meth:`to_dict` (reused tuning results); ValueError if malformed."""
        try:
            runs = [Measurement.from_dict(run) for run in data["runs"]]
            error, at = data["error"], data["error_batch_size"]
            if (error is not None and not isinstance(error, str)) or (at is not None and not isinstance(at, int)):
                raise ValueError("bad error fields")
            return cls(runs, str(data["stop_reason"]), error, at)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a stored sweep: {exc}") from exc


def sweep(
    prepare: Callable[[int], Callable[[], Any]],
    batch_sizes: list[int],
    config: ProfilingConfig | None = None,
    *,
    sync: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
    keep_going: Callable[[Measurement], bool] | None = None,
    batched: bool = True,
    known: Iterable[Measurement] = (),
    warmed: Callable[[int], bool] | None = None,
) -> SweepResult:
    """Measure at each batch size in order until throughput saturates, a call fails, or the list ends.

    Args:
        prepare: ``prepare(batch_size)`` builds the inputs once and returns a zero-argument callable that
            runs one inference call on them (inputs are not copied per call).
        batch_sizes: increasing batch sizes to try.
        config: stop rules and caps.
        sync: device synchronization after each call (see ``device_sync``).
        cancel: cancels the sweep from outside (raises :class:`ProfilingCancelledError`).
        keep_going: called after each measurement; returning False ends the sweep (reason ``limit``).
        batched: False for graphs without a batch axis (recorded in each measurement).
        known: measurements taken earlier with the same rules (a screening's): a batch size that has one is
            not measured again, and one the sweep stops before is kept in the result (it was measured).
        warmed: ``warmed(batch_size)``, asked after ``prepare(batch_size)``: True skips that size's warm-up
            (see :func:`measure`).

    Out-of-memory and any other error while preparing or calling end the sweep gracefully: the error is
    recorded and the measurements made so far are kept.
    """
    config = config or ProfilingConfig()
    if not batch_sizes:
        raise ConfigError("sweep needs at least one batch size.")
    result = SweepResult()
    earlier = {m.batch_size: m for m in known}
    best_throughput: float | None = None
    misses = 0
    for batch_size in batch_sizes:
        try:
            measurement = earlier.pop(batch_size, None)
            if measurement is None:
                call = prepare(batch_size)
                measurement = measure(call, batch_size, config, sync=sync, cancel=cancel, batched=batched,
                                      warmed=warmed is not None and warmed(batch_size))
        except ProfilingCancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure ends the sweep; the error is recorded
            result.stop_reason = OUT_OF_MEMORY if is_out_of_memory(exc) else ERROR
            result.error = f"{type(exc).__name__}: {exc}"
            result.error_batch_size = batch_size
            logger.warning("Measuring at batch size %d failed, the sweep stops here: %s", batch_size, result.error)
            break
        result.measurements.append(measurement)
        if keep_going is not None and not keep_going(measurement):
            result.stop_reason = LIMIT
            break
        if best_throughput is None or measurement.throughput > best_throughput * (1.0 + config.saturation_threshold):
            best_throughput = measurement.throughput
            misses = 0
            continue
        misses += 1
        if misses >= config.saturation_patience:
            result.stop_reason = SATURATED
            break
    if earlier and result.error is None and result.stop_reason != LIMIT:  # measured before, past where this sweep stopped: still a measurement
        result.measurements = sorted([*result.measurements, *earlier.values()], key=lambda m: m.batch_size)
    return result
