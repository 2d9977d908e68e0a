"""Deliberately broken backends for testing strategies and the fidelity check (never defaults).

``WrongOutputBackend`` adds an offset to every floating output, ``NaNBackend`` fills outputs with
NaN, ``NaNToZeroBackend`` replaces NaN outputs by 0 (as OpenVINO's CPU ReLU does with a NaN input),
``FailingBuildBackend`` raises during build and ``WrongShapeBackend`` drops the last element
of the first axis. All run the module eagerly otherwise.

For the measuring strategies: :class:`FakeClock` is a manual clock to inject into ``ProfilingConfig``;
``TimedBackend`` advances it by a configured cost per call (optionally growing with the batch size,
alternating jitter, or an out-of-memory error above a batch size); ``HangingBackend`` blocks in infer
until released, to exercise the per-candidate time limit. ``OwnCopyBackend`` runs a private copy of the
module, so tuning releases the original weights.

For the executors (run them with ``executor="process"``; in process they take the interpreter down):
``AbortingBackend`` aborts the process in build (a segfault's effect), ``RunawayMemoryBackend`` allocates
memory until its worker is killed, and ``NativeSleepBackend`` sleeps in native code without returning.
"""

from __future__ import annotations

import copy
import ctypes
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import BuildError
from torch_tweak.torch.backend.backend import Backend, BackendConfig
from torch_tweak.torch.backend.torch_eager import TorchEagerBackend
from torch_tweak.torch.module.forward import pristine
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, flatten_sample, map_tensors


class WrongOutputBackend(TorchEagerBackend):
    """Eager, plus ``offset`` on every floating output element."""

    def __init__(self, offset: float = 1.0) -> None:
        super().__init__()
        self.offset = offset

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return map_tensors(super()._infer(*args, **kwargs),
                           lambda t: t + self.offset if t.is_floating_point() else t)


class NaNBackend(TorchEagerBackend):
    """Eager, with every floating output replaced by NaN."""

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return map_tensors(super()._infer(*args, **kwargs),
                           lambda t: torch.full_like(t, float("nan")) if t.is_floating_point() else t)


class NaNToZeroBackend(TorchEagerBackend):
    """Eager, with NaN in floating outputs replaced by 0: exact on finite inputs, hides NaN inputs."""

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return map_tensors(super()._infer(*args, **kwargs),
                           lambda t: torch.nan_to_num(t, nan=0.0, posinf=torch.inf, neginf=-torch.inf)
                           if t.is_floating_point() else t)


class WrongShapeBackend(TorchEagerBackend):
    """Eager, with the first axis of every output shortened by one."""

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return map_tensors(super()._infer(*args, **kwargs), lambda t: t[:-1] if t.dim() else t)


class FailingBuildBackend(TorchEagerBackend):
    """Raises :class:`BuildError` from build."""

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        sys.stdout.write("compiler output that should land in build.log\n")
        raise BuildError("deliberate build failure")


class FakeClock:
    """A manual clock: calling it returns the current time in seconds; :meth:`advance` moves it forward.

    Deep copies return the same clock, so backends deep-copied by a strategy still share it.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now += seconds

    def __deepcopy__(self, memo: dict[int, Any]) -> FakeClock:
        return self


@dataclass
class TimedBackendConfig(BackendConfig):
    """Cost model of :class:`TimedBackend`: a call at batch ``b`` takes
    ``ms_per_call + ms_per_sample * b + ms_per_sample_squared * b**2`` milliseconds, plus ``jitter_ms``
    alternately added and subtracted; batches larger than ``oom_above_batch`` raise an out-of-memory error.
    ``label`` only tells otherwise identical backends apart.
    """

    ms_per_call: float = 1.0
    ms_per_sample: float = 0.0
    ms_per_sample_squared: float = 0.0
    jitter_ms: float = 0.0
    oom_above_batch: int | None = None
    label: str = ""


class TimedBackend(TorchEagerBackend):
    """Eager outputs, but every call advances a :class:`FakeClock` by the configured cost."""

    def __init__(self, clock: FakeClock, config: TimedBackendConfig | None = None, **fields: Any) -> None:
        super().__init__()
        self.clock = clock
        self.timing = config or TimedBackendConfig(**fields)
        self.calls = 0

    @property
    def executed_precision(self) -> str:
        """Always ``fp32``."""
        return "fp32"

    def key(self) -> str:
        """Class name and the hash of the timing config."""
        return f"{self.__class__.__name__}_{self.timing.key()}"

    def describe(self) -> str:
        """``TimedBackend(<changed timing fields>)``."""
        return f"{self.__class__.__name__}({self.timing.describe()})"

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = flatten_sample(args, kwargs)
        batch = int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 1
        t = self.timing
        if t.oom_above_batch is not None and batch > t.oom_above_batch:
            raise torch.OutOfMemoryError(f"deliberate out of memory at batch {batch}")
        cost = t.ms_per_call + t.ms_per_sample * batch + t.ms_per_sample_squared * batch * batch
        cost += t.jitter_ms if self.calls % 2 else -t.jitter_ms
        self.calls += 1
        self.clock.advance(cost / 1000.0)
        with torch.no_grad():
            return self._forward(*args, **kwargs)


class _Shared:
    """Holds an object that deep copies must share (a threading.Event cannot be copied)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


class HangingBackend(TorchEagerBackend):
    """Eager, but every call blocks until :meth:`release` (or ``max_wait_s``) — a candidate that hangs."""

    def __init__(self, max_wait_s: float = 30.0) -> None:
        super().__init__()
        self.max_wait_s = max_wait_s
        self._event = _Shared(threading.Event())

    def unblock(self) -> None:
        """Let blocked and future calls finish (call it when the test ends)."""
        self._event.value.set()

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        self._event.value.wait(self.max_wait_s)
        return super()._infer(*args, **kwargs)


class OwnCopyBackend(TorchEagerBackend):
    """Eager on a private copy of the module, so the original weights are not needed after tuning (as with
    OpenVINO or ONNX Runtime, whose runtimes hold their own copy)."""

    requires_original_module = False

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        with pristine(module):
            private = copy.deepcopy(module)
        return super()._build(private, graph_spec, data, cache_dir)


class AbortingBackend(TorchEagerBackend):
    """Aborts the process (``os.abort()``, SIGABRT) in build, as a crash in native code would."""

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        sys.stdout.write("about to abort\n")
        sys.stdout.flush()
        os.abort()


class RunawayMemoryBackend(TorchEagerBackend):
    """Allocates (and touches) ``step_mb`` MiB every ``interval_s`` in build until the process is killed, or
    raises :class:`BuildError` at ``max_gb`` GiB so that, run without a memory limit, it cannot take the machine."""

    def __init__(self, step_mb: int = 64, interval_s: float = 0.005, max_gb: float = 8.0) -> None:
        super().__init__()
        self.step_mb, self.interval_s, self.max_gb = step_mb, interval_s, max_gb

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        hoard = []
        while len(hoard) * self.step_mb < self.max_gb * 1024:
            hoard.append(torch.ones(self.step_mb * 2**20, dtype=torch.uint8))
            time.sleep(self.interval_s)
        raise BuildError(f"RunawayMemoryBackend reached {self.max_gb} GiB without being stopped")


class NativeSleepBackend(TorchEagerBackend):
    """Sleeps ``seconds`` in native code (libc ``sleep``) in build: a hang that no Python signal interrupts."""

    def __init__(self, seconds: int = 3600) -> None:
        super().__init__()
        self.seconds = seconds

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        ctypes.CDLL(None).sleep(self.seconds)
        return super()._build(module, graph_spec, data, cache_dir)
