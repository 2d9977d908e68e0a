"""RayExecutor: candidates built, checked and measured as Ray tasks on a cluster of identical inference hosts.

Why: teams that tune many models, or pipelines whose modules take minutes each, already run Ray; tuning uses
their cluster instead of a scheduler of its own (``tt.tune(..., executor=RayExecutor(address=...))``).

What moves: a graph's context (module weights, recorded samples, strategy settings), pickled by torch_tweak
(with Ray's cloudpickle, so classes defined in the tuning script travel too), goes into Ray's object store once (:meth:`RayExecutor.share`); every candidate task gets a reference to it, and
each worker process unpickles it once (:mod:`~torch_tweak.torch.executor._ray_task`). A task sends back the
candidate's report row and measurements; the built backend stays on the worker, and the winner is built again
in the caller (with ``shared_cache_dir`` its converted files are on shared storage and are reused).

Hardware classes: measurements compare only on identical hardware. Each node's CPU model and ISA flags form
its class. With ``hardware_class="label"`` tasks ask for a custom resource of that name (nodes started with
``ray start --resources='{"label": 1}'``); without, the class with the most CPUs is used and, when the cluster
has several, tasks are pinned to its nodes. A task that starts on a node of another class is stopped before it
measures and becomes a ``skipped`` row saying so. Ray ships ``ray`` itself only with the extra ``ray``; it is
imported here only when an executor connects, never by ``import torch_tweak.torch``.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_tweak.errors import ConfigError, WorkerError
from torch_tweak.torch.executor import _ray_task
from torch_tweak.torch.executor._ray_cluster import choose_class, probe_nodes
from torch_tweak.torch.executor._ray_watch import RayTask, Watcher
from torch_tweak.torch.executor.base import (
    WRONG_HARDWARE,
    Executor,
    Failure,
    Outcome,
    Pending,
    Shared,
)

logger = logging.getLogger(__name__)

LABEL_AMOUNT = 0.001  # of the user's resource per task: any number of tasks fit; the label only picks nodes


class RayExecutor(Executor):
    """Runs each candidate as a Ray task (see the module docstring).

    Args:
        address: the Ray cluster (``"ray://head:10001"``, ``"auto"``...), used when this process has not called
            ``ray.init`` itself; None: the session already started here, else Ray's default (``RAY_ADDRESS`` or
            a new local cluster).
        hardware_class: a custom resource that the nodes of one hardware class carry; None: the CPU fingerprint.
        num_threads: torch threads per candidate, and the CPUs each task asks Ray for (so candidates measured at
            once on a node do not share cores). None: this process's ``torch.get_num_threads()``, capped to the
            CPUs of the class's smallest node.
        shared_cache_dir: the torch_tweak cache folder (``tt.config.cache_dir``) as the nodes mount it, when it is
            shared storage: workers build there, so build logs and converted files are where the caller looks.
            None: workers build in the caller's cache path on their own disk.
        init_kwargs: more arguments for ``ray.init`` when this executor starts the connection.
    """

    name = "ray"
    isolated = True
    concurrent = True

    def __init__(self, address: str | None = None, *, hardware_class: str | None = None,
                 num_threads: int | None = None, shared_cache_dir: str | Path | None = None,
                 init_kwargs: dict[str, Any] | None = None) -> None:
        if address is not None and (not isinstance(address, str) or not address):
            raise ConfigError(f"RayExecutor: address must be a non-empty string or None, got {address!r}.")
        if hardware_class is not None and (not isinstance(hardware_class, str) or not hardware_class.strip()):
            raise ConfigError(f"RayExecutor: hardware_class must be the name of a custom Ray resource (e.g. "
                              f"'spr-8480') or None, got {hardware_class!r}.")
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ConfigError(f"RayExecutor: num_threads must be a positive int or None, got {num_threads!r}.")
        if shared_cache_dir is not None and not isinstance(shared_cache_dir, (str, Path)):
            raise ConfigError(f"RayExecutor: shared_cache_dir must be a path or None, got {shared_cache_dir!r}.")
        if init_kwargs is not None and not isinstance(init_kwargs, dict):
            raise ConfigError(f"RayExecutor: init_kwargs must be a dict or None, got {type(init_kwargs).__name__}.")
        if importlib.util.find_spec("ray") is None:
            raise WorkerError("RayExecutor needs Ray, which is not installed: pip install 'torch-tweak[ray]'.")
        self.address, self.hardware_class, self.num_threads = address, hardware_class, num_threads
        self.shared_cache_dir = Path(shared_cache_dir) if shared_cache_dir is not None else None
        self.init_kwargs = dict(init_kwargs or {})
        self._caller = uuid.uuid4().hex[:12]  # names this executor's contexts in the workers' caches
        self._reset()

    def _reset(self) -> None:
        self._connected, self._owns_ray, self._error = False, False, None
        self._refs: dict[int, Any] = {}
        self._nodes: dict[str, dict[str, Any]] = {}  # Ray node id -> what the probe or a task said
        self._class: str | None = None
        self._pinned: list[str] | None = None  # node ids to place tasks on (several classes, no label)
        self._threads = 1
        self._counts: Counter[str] = Counter()
        self._turn = itertools.count()
        self._remote: Any = None
        self._watcher = Watcher(self._refuse, self._started)

    # the Executor interface ---------------------------------------------------------------------------

    def describe(self) -> str:
        where = self.address or "this process's Ray session"
        if self._class is None:
            return f"ray ({where})"
        members = [n for n in self._nodes.values() if n["class"] == self._class]
        label = f" '{self.hardware_class}'" if self.hardware_class else ""
        return (f"ray ({where}; hardware class{label} {self._class}: {members[0]['cpu']}, {len(members)} node(s), "
                f"{self._threads} thread(s) per candidate, {self._watcher.capacity} at a time)")

    def hardware(self) -> dict[str, Any] | None:
        self._connect()
        info = next(n for n in self._nodes.values() if n["class"] == self._class)
        return {"cpu": info["cpu"], "isa": info["isa"], "label": self.hardware_class}

    def worker_path(self, path: Path) -> Path:
        if self.shared_cache_dir is None:
            return path
        from torch_tweak.torch.cache import cache_root

        try:
            return self.shared_cache_dir / path.relative_to(cache_root())
        except ValueError:
            return path

    def share(self, context: Any) -> Shared:
        """Put ``context`` into Ray's object store once; raises :class:`WorkerError` (Ray unreachable, or the
        context cannot be pickled)."""
        self._connect()
        shared = super().share(context)
        self._put(shared)
        return shared

    def _put(self, shared: Shared) -> Any:
        import pickle

        import ray
        from ray import cloudpickle  # classes of the tuning script travel by value: Ray workers never import it

        try:
            blob = cloudpickle.dumps(shared.context, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise WorkerError(
                f"The module cannot be sent to Ray workers: pickling it failed ({type(exc).__name__}: {exc}). "
                "Make the module picklable, or tune it with executor='inline'.") from exc
        self._refs[shared.token] = ray.put(blob)
        return self._refs[shared.token]

    def release(self, shared: Shared) -> None:
        if self._connected:
            self._watcher.cancel(shared.token)  # tasks whose results will not be read
        self._refs.pop(shared.token, None)  # Ray frees the object once no task holds it

    def submit(self, shared: Shared, fn: Callable[..., Any], args: tuple[Any, ...], *,
               time_limit_s: float | None, label: str) -> Pending:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._connect()
        ref = self._refs.get(shared.token)
        if ref is None:  # released, or shared before a close(): send it again
            ref = self._put(shared)
        options: dict[str, Any] = {"num_cpus": self._threads}
        if self.hardware_class:
            options["resources"] = {self.hardware_class: LABEL_AMOUNT}
        if self._pinned:
            node = self._pinned[next(self._turn) % len(self._pinned)]
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        remote, key, threads = self._remote.options(**options), f"{self._caller}:{ref.hex()}", self._threads
        task = RayTask(lambda: remote.remote([ref], key, fn, args, threads), time_limit_s, label, shared.token)
        self._watcher.add(task)
        return _RayPending(self._watcher, task)

    def nodes(self) -> list[dict[str, Any]]:
        """The class's nodes and any other node that ran work: host, IP, CPU, ISA, class, candidates run."""
        chosen = [n for n in self._nodes.values() if n["class"] == self._class or self._counts[n["node_id"]]]
        return [{"host": n["host"], "ip": n["ip"], "cpu": n["cpu"], "isa": n["isa"], "hardware_class": n["class"],
                 "candidates": self._counts[n["node_id"]]} for n in sorted(chosen, key=lambda n: n["host"])]

    def close(self) -> None:
        """Drop this executor's objects; shut Ray down if this executor started it."""
        owns = self._owns_ray
        if self._connected:
            for token in {task.token for task in [*self._watcher.running, *self._watcher.queued]}:
                self._watcher.cancel(token)
        self._reset()
        if owns:
            import ray

            ray.shutdown()

    # internals -----------------------------------------------------------------------------------------

    def _connect(self) -> None:
        if self._connected:
            return
        if self._error is not None:
            raise self._error
        try:
            import ray

            if not ray.is_initialized():
                ray.init(address=self.address, **self.init_kwargs)
                self._owns_ray = True
            self._remote = ray.remote(max_retries=0, num_returns="streaming")(_ray_task.run_unit)
            self._probe(ray)
        except WorkerError as exc:
            self._error = exc
            raise
        except Exception as exc:  # noqa: BLE001 - whatever Ray raises, the message says what to do
            self._error = WorkerError(
                f"RayExecutor could not connect to the Ray cluster at {self.address or 'the default address'} "
                f"({type(exc).__name__}: {exc}). Start it (`ray start --head` on the head node, `ray start "
                "--address=HEAD:6379` on the others) and pass its address, or tune with executor='process'.")
            raise self._error from exc
        self._connected = True

    def _probe(self, ray: Any) -> None:
        """Learn every usable node's CPU and choose the hardware class to run on."""
        import torch

        self._nodes = probe_nodes(ray, self.hardware_class)
        self._class, self._pinned = choose_class(self._nodes, self.hardware_class)
        members = [n for n in self._nodes.values() if n["class"] == self._class]
        smallest = min(n["cpus"] for n in members) or 1
        wanted = self.num_threads or torch.get_num_threads()
        if wanted > smallest and self.num_threads is not None:
            raise WorkerError(f"RayExecutor(num_threads={wanted}): the nodes of hardware class {self._class} have as "
                              f"few as {smallest} CPUs, so no task could be placed; pass num_threads <= {smallest}.")
        self._threads = min(wanted, smallest)
        self._watcher.capacity = max(1, sum(n["cpus"] // self._threads for n in members))

    def _refuse(self, node: dict[str, Any], task: RayTask) -> Failure | None:
        """A :data:`WRONG_HARDWARE` failure when ``task`` started on a node outside this run's hardware class."""
        if node["class"] == self._class:
            return None
        expected = next(n for n in self._nodes.values() if n["class"] == self._class)
        return Failure(WRONG_HARDWARE, (
            f"{task.label}: its task reached {task.worker}, hardware class {node['class']} ({node['cpu']}), but this "
            f"run measures on class {self._class} ({expected['cpu']}); measurements on different CPUs do not compare, "
            "so it was stopped. Label the nodes of one class with a custom resource and pass "
            "RayExecutor(hardware_class=...)"), task.worker)

    def _started(self, node: dict[str, Any]) -> None:
        self._nodes.setdefault(node["node_id"], {**node, "cpus": 0})
        self._counts[node["node_id"]] += 1


class _RayPending(Pending):
    def __init__(self, watcher: Watcher, task: RayTask) -> None:
        self._watcher, self._task = watcher, task

    def result(self) -> Outcome:
        return self._watcher.wait_for(self._task)
