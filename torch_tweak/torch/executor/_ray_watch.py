"""Watching the Ray tasks of :class:`~torch_tweak.torch.executor.ray_executor.RayExecutor` while they run.

Why: the strategies submit a graph's candidates at once and collect them in order (storing each result as it is
collected, so that a killed run resumes), but Ray starts queued tasks in any order. So only as many tasks are
handed to Ray as the hardware class has room for (``capacity``), the rest wait here in submission order; and
while the caller waits for one, every running task is watched: when its ``("started", node)`` item arrives it
is logged, counted for its node and checked for its hardware class, and from then its time limit runs; a task
past its limit is cancelled (its worker killed). Ray is imported only inside the methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch_tweak.torch.executor._ray_failures import describe_node, failure_from
from torch_tweak.torch.executor.base import ERROR, TIMED_OUT, Done, Failure, Outcome

logger = logging.getLogger(__name__)

POLL_S = 0.2


@dataclass(eq=False)
class RayTask:
    """One submitted unit: how to start it (returns its Ray generator), limit, label, the context token, and
    what is known so far."""

    launch: Callable[[], Any]
    time_limit_s: float | None
    label: str
    token: int
    started_at: float | None = None
    worker: str = "a Ray worker"
    outcome: Outcome | None = None
    generator: Any = None


class Watcher:
    """The running tasks of one executor. ``check(node, task)`` returns a :class:`Failure` for a task that started
    on a node where it must not run (then it is cancelled), else None; ``started(node)`` is told of each start."""

    def __init__(self, check: Callable[[dict[str, Any], RayTask], Failure | None],
                 started: Callable[[dict[str, Any]], None]) -> None:
        self._check, self._started = check, started
        self.running: list[RayTask] = []
        self.queued: list[RayTask] = []
        self.capacity = 1

    def add(self, task: RayTask) -> None:
        self.queued.append(task)
        self._launch()

    def _launch(self) -> None:
        while self.queued and len(self.running) < self.capacity:
            task = self.queued.pop(0)
            task.generator = task.launch()
            self.running.append(task)

    def wait_for(self, task: RayTask) -> Outcome:
        """Watch every running task until ``task`` has its outcome."""
        import ray

        if task in self.queued:  # what the caller waits for goes to Ray next
            self.queued.remove(task)
            self.queued.insert(0, task)
        while task.outcome is None:
            self._launch()
            if not self._poll(ray):
                try:
                    ray.wait([t.generator for t in self.running], num_returns=1, timeout=POLL_S)
                except Exception:  # noqa: BLE001 - waiting is only pacing; the next poll reads the state
                    time.sleep(POLL_S)
        return task.outcome

    def cancel(self, token: int) -> None:
        """Stop the tasks still running against context ``token`` (their results will not be read)."""
        import ray

        for task in [t for t in self.queued if t.token == token]:
            self.queued.remove(task)
            task.outcome = Failure(ERROR, f"{task.label}: not needed any more", task.worker)
        for task in [t for t in self.running if t.token == token]:
            ray.cancel(task.generator, force=True)
            self._finish(task, Failure(ERROR, f"{task.label}: not needed any more", task.worker))

    def _finish(self, task: RayTask, outcome: Outcome) -> None:
        task.outcome, task.generator = outcome, None
        self.running.remove(task)

    def _poll(self, ray: Any) -> bool:
        """One look at every running task; True if anything changed."""
        changed = False
        for task in list(self.running):
            try:
                ready, _ = ray.wait([task.generator], timeout=0)
                if ready and task.started_at is None:
                    _, node = ray.get(next(task.generator))
                    task.started_at, task.worker = time.monotonic(), describe_node(node)
                    self._started(node)
                    logger.info("%s: on Ray node %s", task.label, task.worker)
                    refused = self._check(node, task)
                    if refused is not None:
                        ray.cancel(task.generator, force=True)
                        self._finish(task, refused)
                elif ready:
                    kind, value = ray.get(next(task.generator))
                    self._finish(task, Done(value, task.worker) if kind == "done" else Failure(
                        ERROR, f"{task.label} raised on {task.worker}: {value}", task.worker))
                elif task.started_at is not None and task.time_limit_s is not None and \
                        time.monotonic() - task.started_at > task.time_limit_s:
                    ray.cancel(task.generator, force=True)
                    self._finish(task, Failure(TIMED_OUT, (
                        f"{task.label}: did not finish within {task.time_limit_s:g} s; its Ray task on "
                        f"{task.worker} was cancelled (its worker process killed)"), task.worker))
                else:
                    continue
            except StopIteration:
                self._finish(task, Failure(ERROR, f"{task.label}: its Ray task on {task.worker} ended without a "
                                                  "result", task.worker))
            except ray.exceptions.RayError as exc:
                self._finish(task, failure_from(exc, task.label, task.worker))
            changed = True
        return changed
