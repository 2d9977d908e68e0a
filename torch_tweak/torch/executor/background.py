"""Units of work started ahead of their turn in a background worker process, so slow compiles overlap other work.

Why: on a few cores Inductor and TorchAO spend 40-100 s compiling a ResNet-50 or a BERT-base, while a second
build of the same module, graph and config in another process takes seconds: Inductor's on-disk caches hold the
compiled graphs (TorchAO on a BERT-base, 2 cores of an EPYC: 82 s with empty caches, 11 s after a build in
another process). The measuring strategies hand such builds to a :class:`BackgroundBuilds` when a graph's tuning
starts (``tune_strategy/ahead.py``); its worker runs them one after another while the executor's own worker
builds, checks and measures the other candidates.

The background worker leads a process group of its own and builds at the lowest priority (nice 19, where it can
return to its own to measure: ``utils/priority.py``), so it takes only the cores the other work leaves idle; every
timed call of the tuning pauses its group (``utils/pause.py``). Units are sent one at a time, so one that is no
longer wanted can be dropped before it starts; a running one is dropped by killing the worker, and so are the units
queued after it (one worker per graph: the measuring processes pause its group only). A unit that fails, crashes or
runs out of time only loses its head start: the strategy builds the candidate in its turn as usual. A watcher
process (``utils/group_guard.py``) kills the group when the tuning process dies, even by ``kill -9``: the
compiler's helpers do not die with the worker, and a group paused at that moment would otherwise stay stopped.
"""

from __future__ import annotations

import itertools
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch_tweak.torch.executor._spawned import POLL_S, Worker, describe_exit, resident_bytes
from torch_tweak.torch.executor._stream import send_pickle
from torch_tweak.torch.executor.base import CRASHED, ERROR, OUT_OF_MEMORY, TIMED_OUT, Done, Failure, Outcome, Shared
from torch_tweak.utils.group_guard import GroupGuard
from torch_tweak.utils.pause import signal_group, start_time

logger = logging.getLogger(__name__)


@dataclass
class _Unit:
    ticket: int
    shared: Shared
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    label: str


class BackgroundBuilds:
    """A background worker (started with the first unit) and the units queued for it; see the module docstring.

    Args:
        num_threads: torch threads of the worker (those the main worker has: the compiled code is the same).
        memory_limit: bytes of resident memory above which the worker is killed (its units fail).
    """

    def __init__(self, num_threads: int, memory_limit: float) -> None:
        self._num_threads = num_threads
        self._memory_limit = memory_limit
        self._worker: Worker | None = None
        self._sender: _Sender | None = None
        self._waiting: list[_Unit] = []  # not sent yet, in order
        self._running: _Unit | None = None
        self._outcomes: dict[int, Outcome] = {}
        self._tickets = itertools.count(1)
        self._gone: str | None = None  # why the one worker is gone (a replacement would not be in a paused group)
        self._holding = False  # no unit is sent until :meth:`resume`
        self._guard: GroupGuard | None = None

    @property
    def group(self) -> tuple[int, int] | None:
        """The worker's process group as ``(pgid, leader start time)`` (see ``utils/pause.py``), or None."""
        worker = self._worker
        if worker is None or worker.process.pid is None:
            return None
        start = start_time(worker.process.pid)
        return None if start is None else (worker.process.pid, start)

    def start(self, shared: Shared, fn: Callable[..., Any], args: tuple[Any, ...], label: str,
              first: bool = False) -> int:
        """Queue ``fn(context, *args)``; it starts when the units queued before it are done (``first``: before every
        queued unit, once the running one is done). Returns its ticket."""
        unit = _Unit(next(self._tickets), shared, fn, args, label)
        self._waiting.insert(0 if first else len(self._waiting), unit)
        self.watch()
        return unit.ticket

    def busy(self, ticket: int) -> bool:
        """Whether the worker runs a unit other than ``ticket``'s."""
        self.watch()
        return self._running is not None and self._running.ticket != ticket

    def resume(self) -> None:
        """Send queued units again after a :meth:`wait` with ``hold``."""
        self._holding = False
        self.watch()

    def started(self, ticket: int) -> bool:
        """Whether the unit is running or done (False: still queued, or dropped)."""
        return ticket in self._outcomes or (self._running is not None and self._running.ticket == ticket)

    def running(self, ticket: int) -> bool:
        """Whether the worker runs the unit now."""
        self.watch()
        return self._running is not None and self._running.ticket == ticket

    def drop(self, ticket: int) -> None:
        """Forget a unit: dequeue it, or kill the worker if it runs it (units still queued then fail unstarted:
        a second worker would lead a process group the measuring processes were never told to pause)."""
        self._waiting = [u for u in self._waiting if u.ticket != ticket]
        self._outcomes.pop(ticket, None)
        if self._running is not None and self._running.ticket == ticket:
            self._running = None
            self._kill()
            self.watch()

    def wait(self, ticket: int, time_limit_s: float | None, hold: bool = False) -> Outcome:
        """The unit's outcome, once it is done (its unit and those before it are run first; nothing measures
        while the caller waits, so the worker's group is continued). ``hold`` (for a unit that has started): the
        units queued after it wait for :meth:`resume`, so the caller can put one of its own first."""
        deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self._holding = hold
        self._continue()
        while ticket not in self._outcomes:
            running = self._running is not None and self._running.ticket == ticket
            if not running and all(u.ticket != ticket for u in self._waiting):
                return Failure(ERROR, f"background unit {ticket} was dropped", self._name())
            if deadline is not None and time.monotonic() > deadline:
                if not running:  # still queued behind another unit: it will not start now
                    self.drop(ticket)
                    return Failure(TIMED_OUT, f"background unit {ticket} did not start within {time_limit_s:g} s",
                                   self._name())
                self._fail_running(TIMED_OUT, f"did not finish within {time_limit_s:g} s")
                break
            self.watch(POLL_S)
        return self._outcomes.pop(ticket)

    def watch(self, timeout: float = 0.0) -> None:
        """Read the worker's replies, enforce the memory limit and send the next unit (without blocking, unless
        ``timeout``); called while the caller waits for other work too."""
        worker = self._worker
        if worker is not None and self._running is not None:
            message = worker.receive(timeout)
            while message is not None and message[0] == "ready":
                worker.name = f"pid {message[1]['pid']} on {message[1]['host']}"
                message = worker.receive(0)
            if message is not None:
                unit, self._running = self._running, None
                self._outcomes[unit.ticket] = Done(message[1], worker.name) if message[0] == "done" else \
                    Failure(ERROR, f"{unit.label} raised in the background worker {worker.name}: {message[1]}",
                            worker.name)
            elif not worker.process.is_alive():
                failure = self._sender.failure if self._sender is not None else None
                self._fail_running(CRASHED, failure or f"its worker died with {describe_exit(worker.process.exitcode)}")
            elif (resident := resident_bytes(worker.process.pid or 0)) is not None and resident > self._memory_limit:
                self._fail_running(OUT_OF_MEMORY, f"its worker reached {resident / 2**30:.1f} GiB of resident "
                                                  f"memory, above the limit of {self._memory_limit / 2**30:.1f} GiB")
        if self._running is None and self._waiting and not self._holding:
            self._send(self._waiting.pop(0))

    def close(self) -> None:
        """Kill the worker and its helper processes; queued units are dropped."""
        self._waiting.clear()
        self._running = None
        self._kill()

    # internals --------------------------------------------------------------------------------

    def _name(self) -> str:
        return self._worker.name if self._worker is not None else "none"

    def _send(self, unit: _Unit) -> None:
        if self._gone is not None:
            self._outcomes[unit.ticket] = Failure(CRASHED, f"{unit.label}: not started: {self._gone}", self._name())
            return
        if self._worker is None:
            self._worker = Worker(self._num_threads, background=True)
            self._sender = _Sender(self._worker)
            group = self.group
            self._guard = GroupGuard(group) if group is not None else None  # kills the group if this process dies
        assert self._sender is not None
        self._running = unit
        self._sender.put(unit)

    def _fail_running(self, kind: str, why: str) -> None:
        unit, self._running = self._running, None
        name = self._name()
        self._kill()
        if unit is not None:
            self._outcomes[unit.ticket] = Failure(kind, f"{unit.label}: {why} (background worker {name})", name)

    def _continue(self) -> None:
        group = self.group
        if group is not None:
            signal_group(group, signal.SIGCONT)

    def _kill(self) -> None:
        worker, sender, self._worker, self._sender = self._worker, self._sender, None, None
        guard, self._guard = self._guard, None
        if sender is not None:
            sender.put(None)  # its thread ends
        if worker is None:
            return
        self._gone = f"the background worker {worker.name} was stopped"
        pid = worker.process.pid
        start = start_time(pid) if pid else None
        if pid and start is not None:
            signal_group((pid, start), signal.SIGKILL)  # the compiler's helper processes go with it
        worker.kill()
        if guard is not None:  # and those left when the worker was gone already (it crashed, or was killed)
            guard.close()


class _Sender:
    """Sends a worker its units from a thread: the first one streams the module and samples (hundreds of MB),
    which would otherwise hold up the caller while the worker is still importing torch."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self.failure: str | None = None  # why sending failed while the worker was alive (it is killed then)
        self._queue: queue.SimpleQueue[_Unit | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="torch_tweak-background-sender", daemon=True).start()

    def put(self, unit: _Unit | None) -> None:
        """Send ``unit`` after those put before it; None ends the thread."""
        self._queue.put(unit)

    def _run(self) -> None:
        worker = self._worker
        while (unit := self._queue.get()) is not None:
            try:
                if unit.shared.token not in worker.contexts:
                    worker.send(("context", unit.shared.token))
                    send_pickle(worker.conn, unit.shared.context)
                    worker.contexts.add(unit.shared.token)
                worker.send(("run", unit.shared.token, unit.fn, unit.args))
            except (OSError, ValueError):  # the worker was killed: its units are failed by the watcher
                return
            except Exception as exc:  # noqa: BLE001 - a worker left waiting for the rest of a stream would never end
                if not worker.process.is_alive():
                    return
                self.failure = f"sending it the module failed ({type(exc).__name__}: {exc})"
                logger.warning("Background worker %s: %s; it is stopped, and its candidates are built in their turn.",
                               worker.name, self.failure)
                worker.process.kill()  # the watcher (the caller's thread) fails the running unit with self.failure
                return

