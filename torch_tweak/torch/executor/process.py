"""ProcessExecutor: tuning work in a spawned worker process on this machine (the default executor).

Why a process: a candidate that segfaults, allocates until it is killed or hangs in native code becomes a
report row (``crashed`` / ``timeout``) and tuning goes on with the others; the builds' memory (compiled
kernels, converted models, allocator caches) goes away with the worker, so the tuning process stays small;
and a thread cannot be abandoned safely, a process can be killed.

How: one worker at a time (on a few cores, measurements need the machine to themselves), started with the
``spawn`` method with the caller's torch thread count, and reused for the next unit of work. A worker that
dies, passes the memory limit or overruns a time limit is killed and replaced when the next unit starts. The
module and its samples go to a worker once per graph (a second time only after a replacement). While a unit
runs, this process watches the worker: its exit, its resident memory (``/proc``) and the clock. Builds that a
strategy starts ahead of their turn run in a second, lowest-priority worker that measurements pause
(:meth:`ProcessExecutor.background`, ``executor/background.py``); it is watched in the same loop.

Spawned workers import the main script of the caller like ``multiprocessing`` always does: a script that calls
``tt.tune`` at import time must do so under ``if __name__ == "__main__":`` (or use ``executor="inline"``).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torch_tweak.errors import ConfigError
from torch_tweak.torch.executor._sendable import check_sendable
from torch_tweak.torch.executor._spawned import POLL_S, Worker, describe_exit, physical_memory_bytes, resident_bytes
from torch_tweak.torch.executor._stream import send_pickle
from torch_tweak.torch.executor.background import BackgroundBuilds
from torch_tweak.torch.executor.base import (
    CRASHED,
    ERROR,
    OUT_OF_MEMORY,
    TIMED_OUT,
    Done,
    Executor,
    Failure,
    Outcome,
    Pending,
    Shared,
)

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_FRACTION = 0.8  # of physical memory, when no limit is given
_live: weakref.WeakSet[ProcessExecutor] = weakref.WeakSet()


class _Lazy(Pending):
    def __init__(self, run: Callable[[], Outcome]) -> None:
        self._run: Callable[[], Outcome] | None = run
        self._outcome: Outcome | None = None

    def result(self) -> Outcome:
        if self._run is not None:
            self._outcome, self._run = self._run(), None
        assert self._outcome is not None
        return self._outcome


class ProcessExecutor(Executor):
    """Runs each unit of tuning work in a worker process on this machine (see the module docstring).

    Args:
        memory_limit_gb: a worker whose resident memory passes this many GiB is killed and its unit reported as
            ``out_of_memory``. None: 80 % of physical memory, so a runaway candidate is stopped before the
            system's out-of-memory killer picks a process (possibly this one).
        num_threads: torch threads of the worker (None: this process's ``torch.get_num_threads()``, the count
            the tuned module will run with).
        build_ahead: let the measuring strategies compile slow-to-build candidates (Inductor, TorchAO) ahead of
            their turn in a second, lowest-priority worker that every measurement pauses
            (``executor/background.py``); False builds each candidate in its turn only.
    """

    name = "process"
    isolated = True
    keeps_state = True

    def __init__(self, *, memory_limit_gb: float | None = None, num_threads: int | None = None,
                 build_ahead: bool = True) -> None:
        if memory_limit_gb is not None:
            ok = isinstance(memory_limit_gb, (int, float)) and not isinstance(memory_limit_gb, bool)
            if not ok or math.isnan(memory_limit_gb) or memory_limit_gb <= 0:
                raise ConfigError(f"ProcessExecutor: memory_limit_gb must be a positive number of GiB or None (80 % "
                                  f"of physical memory), got {memory_limit_gb!r}.")
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ConfigError(f"ProcessExecutor: num_threads must be a positive int or None, got {num_threads!r}.")
        if not isinstance(build_ahead, bool):
            raise ConfigError(f"ProcessExecutor: build_ahead must be True or False, got {build_ahead!r}.")
        self.build_ahead = build_ahead
        self._backgrounds: weakref.WeakSet[BackgroundBuilds] = weakref.WeakSet()
        physical = physical_memory_bytes()
        if memory_limit_gb is not None:
            self.memory_limit = memory_limit_gb * 2**30
        else:
            self.memory_limit = physical * DEFAULT_MEMORY_FRACTION if physical else math.inf
        self.num_threads = num_threads
        self._worker: Worker | None = None
        _live.add(self)

    def describe(self) -> str:
        limit = "no memory limit" if math.isinf(self.memory_limit) else \
            f"memory limit {self.memory_limit / 2**30:.1f} GiB"
        return f"process (a spawned worker, {limit})"

    def share(self, context: Any) -> Shared:
        """Check that ``context`` can be sent (pickled, into a sink that keeps nothing); raises
        :class:`WorkerError` if not. The worker starts, and the context is sent, with the first unit of work."""
        shared = super().share(context)
        check_sendable(context)
        return shared

    def release(self, shared: Shared) -> None:
        worker = self._worker
        if worker is not None and shared.token in worker.contexts:
            worker.contexts.discard(shared.token)
            try:
                worker.send(("drop", shared.token))
            except OSError:
                pass

    def submit(self, shared: Shared, fn: Callable[..., Any], args: tuple[Any, ...], *,
               time_limit_s: float | None, label: str) -> Pending:
        return _Lazy(lambda: self._run(shared, fn, args, time_limit_s, label))

    def background(self) -> BackgroundBuilds | None:
        if not self.build_ahead:
            return None
        background = BackgroundBuilds(self.num_threads or torch.get_num_threads(), self.memory_limit)
        self._backgrounds.add(background)
        return background

    def nodes(self) -> list[dict[str, Any]]:
        from torch_tweak.torch.environment import cpu_info, isa_flags

        return [{"host": os.uname().nodename, "cpu": cpu_info().model, "isa": isa_flags(), "workers": "local"}]

    def close(self) -> None:
        for background in list(self._backgrounds):
            background.close()
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    # internals --------------------------------------------------------------------------------

    def _ensure_worker(self) -> Worker:
        if self._worker is None or not self._worker.process.is_alive():
            if self._worker is not None:
                self._worker.kill()
            self._worker = None
            self._worker = Worker(self.num_threads or torch.get_num_threads())
        return self._worker

    def _replace(self, worker: Worker) -> None:
        worker.kill()
        if self._worker is worker:
            self._worker = None

    def _run(self, shared: Shared, fn: Callable[..., Any], args: tuple[Any, ...], time_limit_s: float | None,
             label: str) -> Outcome:
        worker = self._ensure_worker()
        start = time.monotonic()
        try:
            if shared.token not in worker.contexts:
                worker.send(("context", shared.token))
                send_pickle(worker.conn, shared.context)  # streamed: this process holds no copy of the weights
                worker.contexts.add(shared.token)
            worker.send(("run", shared.token, fn, args))
        except OSError as exc:
            self._replace(worker)
            return Failure(CRASHED, f"{label}: the worker process {worker.name} went away before it got the work "
                                    f"({exc}); it is replaced for the next candidate", worker.name)
        while True:
            for background in list(self._backgrounds):  # its replies, its memory, its next unit
                background.watch()
            message = worker.receive(POLL_S)
            if message is None and not worker.process.is_alive():
                message = worker.receive(0)  # a reply sent just before the worker went away
            if message is None and not worker.process.is_alive():
                code = worker.process.exitcode
                self._replace(worker)
                return Failure(CRASHED, f"{label}: the worker process {worker.name} died with {describe_exit(code)}"
                                        " (a crash in native code, or killed from outside)", worker.name)
            if message is not None:
                if message[0] == "done":
                    return Done(message[1], worker.name)
                return Failure(ERROR, f"{label} raised in worker {worker.name}: {message[1]}", worker.name)
            resident = resident_bytes(worker.process.pid) if worker.process.pid else None
            if resident is not None and resident > self.memory_limit:
                self._replace(worker)
                return Failure(OUT_OF_MEMORY, (
                    f"{label}: the worker process {worker.name} reached {resident / 2**30:.1f} GiB of resident memory, "
                    f"above the limit of {self.memory_limit / 2**30:.1f} GiB, and was killed; raise "
                    "ProcessExecutor(memory_limit_gb=...) if the candidate needs more"), worker.name)
            if time_limit_s is not None and time.monotonic() - start > time_limit_s:
                self._replace(worker)
                return Failure(TIMED_OUT, (
                    f"{label}: did not finish within {time_limit_s:g} s; its worker process {worker.name} was killed"),
                    worker.name)


@atexit.register
def _stop_workers() -> None:
    for executor in list(_live):
        try:
            executor.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
