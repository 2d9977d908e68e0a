"""Where tuning work runs: the ``Executor`` interface and the in-process executor.

Why it exists: a candidate that segfaults, allocates until the machine runs out of memory or hangs in native
code must not take ``tt.tune`` with it, and a thread cannot be abandoned safely. An executor runs one unit of
work (build, check and measure one candidate) somewhere else and hands back either its value or what went
wrong as data (:class:`Failure`), which the strategies turn into report rows.

The interface is deliberately generic: an executor knows nothing about strategies or backends. It ships a
*context* (the module, its samples, the strategy settings) to its workers once per graph (:meth:`Executor.share`)
and then runs module-level functions ``fn(context, *args)`` against it (:meth:`Executor.submit`). Everything
crossing the boundary is pickled by torch_tweak in this process and unpickled in a worker it started; nothing
read from disk is unpickled.

Implementations: :class:`InlineExecutor` (this process; for debugging, and what workers themselves use),
:class:`~torch_tweak.torch.executor.process.ProcessExecutor` (the default: a spawned worker process on this
machine) and :class:`~torch_tweak.torch.executor.ray_executor.RayExecutor` (Ray tasks across machines).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

#: What a :class:`Failure` says happened.
CRASHED = "crashed"  # the worker died (a signal, an exit, a lost node)
OUT_OF_MEMORY = "out_of_memory"  # the worker's memory passed the executor's limit and it was killed
TIMED_OUT = "timed_out"  # the work did not finish within its time limit and its worker was killed
ERROR = "error"  # the function raised (the work itself handles expected errors; this is a bug or a lost value)
WRONG_HARDWARE = "wrong_hardware"  # it reached a machine of another hardware class than the graph's and was stopped

#: Set in the environment of a worker process while it starts (and imports the caller's main script).
WORKER_ENV = "TORCH_TWEAK_WORKER"

_tokens = itertools.count(1)


@dataclass(frozen=True)
class Shared:
    """A context shipped to an executor's workers once; ``token`` names it in later submissions."""

    token: int
    context: Any = field(repr=False, compare=False)


@dataclass
class Done:
    """Work that returned ``value`` on ``worker`` (``"pid 123 on host"``, a Ray node...)."""

    value: Any
    worker: str


@dataclass
class Failure:
    """Work that did not return: ``kind`` is one of :data:`CRASHED`, :data:`OUT_OF_MEMORY`, :data:`TIMED_OUT`,
    :data:`ERROR`, :data:`WRONG_HARDWARE`; ``message`` says what happened and, where it can, why and what to do."""

    kind: str
    message: str
    worker: str


Outcome = Done | Failure


class Background(Protocol):
    """Units of work started ahead of their turn in a background worker whose measurements-pausable process
    group is :attr:`group` (implemented by ``executor/background.py``)."""

    @property
    def group(self) -> tuple[int, int] | None: ...

    def start(self, shared: Shared, fn: Callable[..., Any], args: tuple[Any, ...], label: str,
              first: bool = False) -> int: ...

    def started(self, ticket: int) -> bool: ...

    def running(self, ticket: int) -> bool: ...

    def busy(self, ticket: int) -> bool: ...

    def drop(self, ticket: int) -> None: ...

    def wait(self, ticket: int, time_limit_s: float | None, hold: bool = False) -> Outcome: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...


class Pending(ABC):
    """A submitted unit of work; :meth:`result` waits for it (and, for lazy executors, runs it)."""

    @abstractmethod
    def result(self) -> Outcome:
        """The work's :class:`Done` or :class:`Failure`."""


class Executor(ABC):
    """Runs units of tuning work; see the module docstring.

    Subclasses set :attr:`name`, :attr:`isolated` (work runs outside this process, so a built backend cannot be
    handed back: the strategy rebuilds the winner here), :attr:`concurrent` (submissions run in parallel, so
    a strategy may submit several candidates before waiting for the first) and :attr:`keeps_state`.
    """

    name = "executor"
    isolated = True
    concurrent = False
    #: Units submitted against one context run in the same worker, one after the other, until it is replaced: a
    #: unit may leave objects in the context for the next (a built candidate for its full sweep).
    keeps_state = False

    def share(self, context: Any) -> Shared:
        """Register ``context`` (picklable) for the work submitted against it; shipped at most once per worker."""
        return Shared(next(_tokens), context)

    @abstractmethod
    def submit(self, shared: Shared, fn: Callable[..., Any], args: tuple[Any, ...], *,
               time_limit_s: float | None, label: str) -> Pending:
        """Run ``fn(shared.context, *args)`` (``fn`` a module-level function); ``label`` names the work in
        messages. Past ``time_limit_s`` the work is stopped and reported as :data:`TIMED_OUT`."""

    def release(self, shared: Shared) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """The context will not be used again (workers may drop it)."""

    def background(self) -> Background | None:
        """A new background worker for builds started ahead of their turn (``executor/background.py``), whose
        process group this machine's measurements can pause; None where the executor has none (the default)."""
        return None

    def hardware(self) -> dict[str, Any] | None:
        """The CPU the work is measured on (``{"cpu": model, "isa": flags, ...}``) when it is not this machine's,
        for the keys of stored results; None: this machine."""
        return None

    def worker_path(self, path: Path) -> Path:
        """Where ``path`` (a build folder in this process's cache) is for the workers (by default the same)."""
        return path

    def nodes(self) -> list[dict[str, Any]]:
        """The machines work ran on (``host``, ``cpu``, ``isa``...), for the report's environment block."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Stop the workers; the executor may be used again (it starts new ones)."""

    def describe(self) -> str:
        """One line for logs and the report."""
        return self.name

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Finished(Pending):
    """Work whose outcome is known already (run in this process, or by a background worker)."""

    def __init__(self, outcome: Outcome) -> None:
        self._outcome = outcome

    def result(self) -> Outcome:
        return self._outcome


class InlineExecutor(Executor):
    """Runs the work in this process, at once (the in-process path, for debugging: breakpoints and profilers
    see the builds; a crash takes the process with it). Strategies keep the backends it builds."""

    name = "inline"
    isolated = False

    def submit(self, shared: Shared, fn: Callable[..., Any], args: tuple[Any, ...], *,
               time_limit_s: float | None, label: str) -> Pending:
        return Finished(Done(fn(shared.context, *args), "this process"))
