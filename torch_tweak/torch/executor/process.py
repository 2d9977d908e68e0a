"""ProcessExecutor: tuning work in a spawned worker process on this machine (the default executor).

Why a process: a candidate that segfaults, allocates until it is killed or hangs in native code becomes a
report row (``crashed`` / ``timeout``) and tuning goes on with the others; the builds' memory (compiled
kernels, converted models, allocator caches) goes away with the worker, so the tuning process stays small;
and a thread cannot be abandoned safely, a process can be killed.

How: one worker at a time (on a few cores, measurements need the machine to themselves), started with the
``spawn`` method with the caller's torch thread count, and reused for the next unit of work. A worker that
dies, passes the memory limit or overruns a time limit is killed and replaced when the next unit starts. The
module and its samples go to a worker once per graph (a second time only after a replacement). While a unit
runs, this process watches the worker: its exit, its resident memory (``/proc``) and the clock.

Spawned workers import the main script of the caller like ``multiprocessing`` always does: a script that calls
``tt.tune`` at import time must do so under ``if __name__ == "__main__":`` (or use ``executor="inline"``).
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import os
import pickle
import signal
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torch_tweak.errors import ConfigError, WorkerError
from torch_tweak.torch.executor import _worker
from torch_tweak.torch.executor._sendable import check_sendable
from torch_tweak.torch.executor._stream import send_pickle
from torch_tweak.torch.executor.base import (
    CRASHED,
    ERROR,
    OUT_OF_MEMORY,
    TIMED_OUT,
    WORKER_ENV,
    Done,
    Executor,
    Failure,
    Outcome,
    Pending,
    Shared,
)

logger = logging.getLogger(__name__)

POLL_S = 0.05
START_TIMEOUT_S = 300.0
DEFAULT_MEMORY_FRACTION = 0.8  # of physical memory, when no limit is given
_live: weakref.WeakSet[ProcessExecutor] = weakref.WeakSet()


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None


def _resident_bytes(pid: int) -> int | None:
    """The process's resident memory (``VmRSS``), or None where ``/proc`` does not tell."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown exit"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class _Worker:
    """One spawned worker and the pipe to it."""

    def __init__(self, num_threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe(duplex=True)
        level = logging.getLogger("torch_tweak").getEffectiveLevel()
        self.process = context.Process(target=_worker.main, args=(child, num_threads, level),
                                       name="torch_tweak-worker", daemon=False)
        self.contexts: set[int] = set()
        os.environ[WORKER_ENV] = "1"  # inherited by the worker: tt.tune refuses to run while it imports main
        try:
            self.process.start()
        finally:
            os.environ.pop(WORKER_ENV, None)
        child.close()
        self.name = f"pid {self.process.pid}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            message = self.receive(POLL_S)
            if message is None:
                if not self.process.is_alive():
                    break
                continue
            if message[0] == "ready":
                self.name = f"pid {message[1]['pid']} on {message[1]['host']}"
                return
        code = self.process.exitcode
        self.kill()
        raise WorkerError(
            f"The torch_tweak worker process did not start ({_describe_exit(code)}). A worker imports the main script "
            "again; a script that calls tt.tune at import time must do so under `if __name__ == '__main__':`. "
            "Pass executor='inline' to tune in this process instead."
        )

    def receive(self, timeout: float) -> tuple[Any, ...] | None:
        """The next reply (log records are passed to this process's loggers), or None after ``timeout``."""
        while True:
            try:
                if not self.conn.poll(timeout):
                    return None
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return None
            if message[0] != "log":
                return message
            record = logging.makeLogRecord(message[1])
            record.msg = f"[worker {self.name}] {record.msg}"
            logging.getLogger(record.name).handle(record)
            timeout = 0  # a log record is not the reply: look at what else has arrived

    def send(self, message: tuple[Any, ...]) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.send(("stop",))
        except OSError:
            pass
        self.process.join(5)
        self.kill()


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
    """

    name = "process"
    isolated = True
    keeps_state = True

    def __init__(self, *, memory_limit_gb: float | None = None, num_threads: int | None = None) -> None:
        if memory_limit_gb is not None:
            ok = isinstance(memory_limit_gb, (int, float)) and not isinstance(memory_limit_gb, bool)
            if not ok or math.isnan(memory_limit_gb) or memory_limit_gb <= 0:
                raise ConfigError(f"ProcessExecutor: memory_limit_gb must be a positive number of GiB or None (80 % "
                                  f"of physical memory), got {memory_limit_gb!r}.")
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ConfigError(f"ProcessExecutor: num_threads must be a positive int or None, got {num_threads!r}.")
        physical = _physical_memory_bytes()
        if memory_limit_gb is not None:
            self.memory_limit = memory_limit_gb * 2**30
        else:
            self.memory_limit = physical * DEFAULT_MEMORY_FRACTION if physical else math.inf
        self.num_threads = num_threads
        self._worker: _Worker | None = None
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

    def nodes(self) -> list[dict[str, Any]]:
        from torch_tweak.torch.environment import cpu_info, isa_flags

        return [{"host": os.uname().nodename, "cpu": cpu_info().model, "isa": isa_flags(), "workers": "local"}]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    # internals --------------------------------------------------------------------------------

    def _ensure_worker(self) -> _Worker:
        if self._worker is None or not self._worker.process.is_alive():
            if self._worker is not None:
                self._worker.kill()
            self._worker = None
            self._worker = _Worker(self.num_threads or torch.get_num_threads())
        return self._worker

    def _replace(self, worker: _Worker) -> None:
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
            message = worker.receive(POLL_S)
            if message is None and not worker.process.is_alive():
                message = worker.receive(0)  # a reply sent just before the worker went away
            if message is None and not worker.process.is_alive():
                code = worker.process.exitcode
                self._replace(worker)
                return Failure(CRASHED, f"{label}: the worker process {worker.name} died with {_describe_exit(code)}"
                                        " (a crash in native code, or killed from outside)", worker.name)
            if message is not None:
                if message[0] == "done":
                    return Done(message[1], worker.name)
                return Failure(ERROR, f"{label} raised in worker {worker.name}: {message[1]}", worker.name)
            resident = _resident_bytes(worker.process.pid) if worker.process.pid else None
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
