"""``tt.tune``: record the wrapped modules over a dataset, then tune them one at a time."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from torch_tweak.errors import ConfigError, TorchTweakError, TuningError, WorkerError
from torch_tweak.torch import progress
from torch_tweak.torch._device import get_device
from torch_tweak.torch.cache import cache_folder, cache_root
from torch_tweak.torch.cache import clear_cache as _clear_cache
from torch_tweak.torch.cache_limit import RECORDED_SHAPES, enforce_size_limit, touch
from torch_tweak.torch.config import config
from torch_tweak.torch.dataset import dataset_items, iter_batches
from torch_tweak.torch.executor import Executor, resolve_executor
from torch_tweak.torch.executor.base import WORKER_ENV
from torch_tweak.torch.module.known_shapes import KnownShapes
from torch_tweak.torch.module.sample_store import SampleStore
from torch_tweak.torch.module.session import RecordingSession, recording
from torch_tweak.torch.module.state import TunedGraph, internals
from torch_tweak.torch.module.wrapper import Module, ModuleState, set_tuner
from torch_tweak.torch.report.report import GraphReport, ModuleReport, ModuleStatus, TuningReport
from torch_tweak.torch.reporting import reporting
from torch_tweak.torch.tune_strategy.base import GraphTask, TuneStrategy
from torch_tweak.torch.tune_strategy.measuring import HighestThroughputStrategy
from torch_tweak.torch.tune_strategy.screening import TimeBudget
from torch_tweak.utils.quiet import external_logging_disabled
from torch_tweak.utils.trace import annotate
from torch_tweak.utils.validate import check_bool, check_int

logger = logging.getLogger(__name__)


@annotate(domain="Torch Tweak")
@reporting
def tune(
    func: Callable[..., Any],
    dataset: Any,
    batch_sizes: list[int] | None = None,
    max_num_batches_per_batch_size: int | None = None,
    device: str | torch.device | None = None,
    dry_run: bool = False,
    clear_cache: bool = False,
    ignore_failing_modules: bool = True,
    disable_external_logging: bool = False,
    time_budget_s: float | None = None,
    executor: str | Executor | None = None,
) -> TuningReport:
    """Record every ``tt.Module`` that ``func`` calls over ``dataset``, then tune each of them.

    Args:
        func: a ``tt.Module``, a model containing wrapped modules, a pipeline, or any callable.
        dataset: a tensor, a list of items or a ``torch.utils.data.Dataset`` (see ``torch_tweak.torch.dataset``).
        batch_sizes: batch sizes to run the dataset at (default ``[1, 2]``; two or more reveal batch axes).
        max_num_batches_per_batch_size: cap on calls per batch size. None: the whole dataset at the first
            size, then ``tt.config.max_num_batches_after_first_size`` batches (1) at each later one (the same
            items again; None in the config runs them all).
        device: ``"cpu"`` (default, ``tt.config.default_device``), ``"xpu"`` or ``"xpu:N"``.
        dry_run: record and detect graphs only; nothing is built.
        clear_cache: first delete what torch_tweak wrote in its cache folder (files it did not write stay;
            see ``torch_tweak.torch.cache.clear_cache``).
        ignore_failing_modules: a module whose tuning fails runs its original code (the error is in the
            report); with False the error propagates.
        disable_external_logging: while tuning, log records of other libraries (compilers, converters) are
            dropped; only torch_tweak's reach the handlers.
        time_budget_s: seconds the whole run (recording included) should take; each graph gets a share of
            what is left when it starts, and the measuring strategies skip candidates (cheapest builds come
            first) that would not fit, with a ``skipped`` row in the report. None: no budget.
        executor: where candidates are built, checked and measured: ``"process"`` (a worker process: a
            candidate that crashes, runs out of memory or hangs becomes a ``crashed``/``timeout`` row and the
            chosen one is built again here), ``"inline"`` (this process, for debugging), or an
            :class:`~torch_tweak.torch.executor.Executor` such as ``ProcessExecutor(memory_limit_gb=8)`` or
            ``RayExecutor(...)``. None: ``tt.config.executor`` (``"process"``). Applies to the measuring
            strategies; ``OneBackendStrategy`` and ``FirstWinsStrategy`` build in this process.

    Returns:
        The :class:`TuningReport` of every module, graph and candidate.
    """
    if os.environ.get(WORKER_ENV):
        raise WorkerError(
            "tt.tune was called in a torch_tweak worker process while it imported the main script: worker processes "
            "import it again, so a script must call tt.tune under `if __name__ == '__main__':`. Add that guard, or "
            "pass executor='inline' to tune without worker processes."
        )
    start, started_at = time.perf_counter(), time.time()
    target = get_device(device if device is not None else config.default_device)
    if device is None and target.type == "cpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        logger.info("Tuning on cpu, torch_tweak's default device (the reference Torch Tweak defaulted to xpu:0); "
                    "pass device='xpu' or set TORCH_TWEAK_DEVICE=xpu to tune on the GPU")
    sizes = _batch_sizes(batch_sizes)
    check_int(max_num_batches_per_batch_size, "max_num_batches_per_batch_size", minimum=1, allow_none=True)
    if not callable(func):
        raise ConfigError(f"func must be callable (a module, pipeline or function), got {type(func).__name__}.")
    budget = None
    if time_budget_s is not None:
        ok = isinstance(time_budget_s, (int, float)) and not isinstance(time_budget_s, bool)
        if not ok or not math.isfinite(time_budget_s) or time_budget_s <= 0:
            raise ConfigError(f"time_budget_s must be a positive number of seconds or None, got {time_budget_s!r}.")
        budget = TimeBudget(float(time_budget_s), 0, start)
    items = dataset_items(dataset)
    if clear_cache:
        _clear_cache()
    if not dry_run:
        cache_root()  # refuse an unusable cache folder before recording, not once per module

    runner, owned = resolve_executor(config.executor if executor is None else executor)
    session = RecordingSession()
    stores = None if dry_run else CallStores(config.max_num_calibration_samples)
    session.stores = None if stores is None else stores.create
    if isinstance(func, Module) and config.lazy_recording and not dry_run and func.state is not ModuleState.TUNED:
        session.top, session.known = func, KnownShapes.open(cache_folder(RECORDED_SHAPES), func.wrapped)
        if session.known.path is not None:
            touch(session.known.path)  # used now: the cache size limit deletes least recently used files first
    try:
        with external_logging_disabled(check_bool(disable_external_logging, "disable_external_logging")):
            report = _record_and_tune(func, items, sizes, max_num_batches_per_batch_size, target, dry_run,
                                      ignore_failing_modules, session, start, budget, runner)
            report.environment["executor"] = {"name": runner.describe(), "nodes": runner.nodes()}
            return report
    finally:
        if owned:
            runner.close()
        if stores is not None:
            stores.remove()
        if not dry_run:
            enforce_size_limit(keep_since=started_at)


def _record_and_tune(func: Callable[..., Any], items: Any, sizes: list[int], max_batches: int | None,
                     target: torch.device, dry_run: bool, ignore_failing_modules: bool, session: RecordingSession,
                     start: float, budget: TimeBudget | None, executor: Executor) -> TuningReport:
    progress.update(phase="record")
    with recording(session), torch.no_grad():
        for position, batch_size in enumerate(sizes):
            session.batch_size = batch_size
            limit = max_batches
            if limit is None and position > 0:
                limit = config.max_num_batches_after_first_size
            for count, (args, kwargs) in enumerate(iter_batches(items, batch_size)):
                if limit is not None and count >= limit:
                    if max_batches is None:
                        logger.info("Batch size %d: ran %d batch(es) of the items batch size %d ran in full "
                                    "(tt.config.max_num_batches_after_first_size=None runs them all)", batch_size,
                                    count, sizes[0])
                    break
                func(*args, **kwargs)
    modules: list[Module] = list(session.modules.values())
    if not modules:
        raise TuningError(
            "No tt.Module was called while running func over the dataset, so there is nothing to tune. Wrap the "
            "modules first (tt.Module(model) or tt.wrap(pipeline, modules)) and make sure func calls them; "
            "modules that are already tuned are not recorded again."
        )
    if config.probe_sequence_lengths:  # every module before any is tuned (and may release its weights)
        for module in modules:
            internals(module).probe_sequence_lengths()
    if session.known is not None:
        internals(session.top).remember_shapes()
    report = TuningReport(device=str(target), batch_sizes=sizes, dry_run=dry_run)
    if budget is not None:
        budget.graphs_left = sum(internals(m).graph_count() for m in modules)
    for module in modules:
        module_report = ModuleReport(name=module.name)
        progress.update(module=module.name)
        report.modules.append(module_report)
        try:
            tune_module(module, target, None, dry_run, module_report, budget, executor)
        except Exception as exc:
            module_report.status = ModuleStatus.PASSTHROUGH
            module_report.error = f"{type(exc).__name__}: {exc}"
            if not ignore_failing_modules:
                raise
            # an error of ours says what and why; anything else is a bug whose traceback the user needs to report
            logger.warning("Tuning module %s failed, it will run its original code: %s", module.name,
                           module_report.error, exc_info=not isinstance(exc, TorchTweakError))
            module.enable_passthrough()
    report.duration_s = time.perf_counter() - start
    logger.info("Tuned %d module(s) in %.1fs", len(modules), report.duration_s)
    return report


def tune_module(
    module: Module,
    device: str | torch.device | None = None,
    strategy: TuneStrategy | None = None,
    dry_run: bool = False,
    report: ModuleReport | None = None,
    budget: TimeBudget | None = None,
    executor: Executor | None = None,
) -> ModuleReport:
    """Tune every recorded graph of ``module`` (each within its share of ``budget``, if given; candidates
    evaluated by ``executor``, None: in this process); on failure release what was built and raise."""
    report = report or ModuleReport(name=module.name)
    if module.state is ModuleState.TUNED:
        raise TuningError(f"Module {module.name!r} is already tuned; wrap a fresh module to tune it again.")
    state = internals(module)
    if config.probe_sequence_lengths:
        state.probe_sequence_lengths()
    recorders = state.recorded_graphs()
    target = get_device(device if device is not None else config.default_device)
    specs = [g.graph_spec() for g in recorders]
    strategies = _strategies_for(module, specs, strategy)
    if dry_run:
        report.status = ModuleStatus.DRY_RUN
        for spec, strat in zip(specs, strategies):
            report.graphs.append(GraphReport(name=spec.name, strategy=strat.describe(), spec=spec.to_dict()))
            logger.info("Module %s (dry run), strategy %s\n%s", module.name, strat.describe(), spec.describe())
        return report
    built: list[Any] = []
    try:
        for graph, spec, strat in zip(recorders, specs, strategies):
            progress.update(graph=spec.name)
            graph_report = GraphReport(name=spec.name, spec=spec.to_dict())
            report.graphs.append(graph_report)
            task = GraphTask(module.wrapped, module.name, spec, graph.samples, target,
                             cache_folder(module.name, spec.name), graph_report, graph.store,
                             budget.graph_deadline() if budget is not None else None, executor)
            built.append(strat.tune(task))
    except Exception:
        for backend in built:
            backend.release()
        raise
    state.mark_tuned([TunedGraph(spec, graph.key, backend) for spec, graph, backend in zip(specs, recorders, built)])
    report.status = ModuleStatus.TUNED
    state.offload_weights(config.device_after_tuning)
    _log_resources(module.name)
    return report


def _log_resources(name: str) -> None:
    """Peak memory and CPU time of the process (INFO with ``tt.config.system_monitor``, else DEBUG)."""
    level = logging.INFO if config.system_monitor else logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    logger.log(level, "System resources after tuning %s: peak RSS %.0f MB, CPU time %.1f s user + %.1f s system",
               name, usage.ru_maxrss / 1024, usage.ru_utime, usage.ru_stime)


def _strategies_for(module: Module, specs: list[Any], strategy: TuneStrategy | None) -> list[TuneStrategy]:
    if strategy is not None:
        return [strategy] * len(specs)
    listed = internals(module).strategies
    if isinstance(listed, (list, tuple)) and len(listed) < len(specs):
        raise TuningError(
            f"Module {module.name!r} recorded {len(specs)} graphs but got {len(listed)} strategies; pass one "
            "strategy per graph (graph creation order) or a single strategy."
        )
    if isinstance(listed, dict):
        missing = [s.name for s in specs if s.name not in listed]
        if missing:
            raise TuningError(f"Module {module.name!r}: no strategy for graph(s) {missing}; strategies has {sorted(listed)}.")
    chosen = [_strategy_of(module, index, spec.name) for index, spec in enumerate(specs)]
    if any(s is None for s in chosen):
        logger.info("Module %s has no strategy: using HighestThroughputStrategy() over every available backend, "
                    "torch_tweak's default (the reference Torch Tweak's was FirstWinsStrategy([OpenVINO, Inductor]))",
                    module.name)
    default = HighestThroughputStrategy()
    return [s or default for s in chosen]


def _strategy_of(module: Module, index: int, name: str) -> TuneStrategy | None:
    """The strategy given for ``module``'s graph ``name`` (created ``index``-th); None: the default strategy."""
    state = internals(module)
    listed = state.strategies
    if isinstance(listed, (list, tuple)):
        return listed[index] if index < len(listed) else None
    if isinstance(listed, dict):
        return listed.get(name)
    return state.strategy


class CallStores:
    """The on-disk stores of the graphs whose strategy keeps more recorded calls (at most ``limit`` per graph,
    in the graph's work folder ``<cache>/<module>/<graph>``); :meth:`remove` deletes them when tuning ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stores: list[SampleStore] = []

    def create(self, module: Module, index: int, name: str) -> SampleStore | None:
        """The store of a new graph, or None when its strategy keeps no extra calls (or none can be kept)."""
        if self.limit == 0:
            return None
        strategy = _strategy_of(module, index, name) or HighestThroughputStrategy()
        if not strategy.keeps_recorded_calls():
            return None
        try:
            store = SampleStore(cache_folder(module.name, name), self.limit)
        except (ConfigError, OSError) as exc:
            logger.warning("Module %s graph %s: recorded calls cannot be kept on disk (%s); calibration and the "
                           "fidelity check use the in-memory samples only", module.name, name, exc)
            return None
        self.stores.append(store)
        logger.info("Module %s graph %s: keeping up to %d recorded calls in %s for calibration and held-out checks",
                    module.name, name, self.limit, store.folder)
        return store

    def remove(self) -> None:
        """Delete every store's folder."""
        for store in self.stores:
            store.remove()
        self.stores.clear()


def _batch_sizes(batch_sizes: list[int] | None) -> list[int]:
    if batch_sizes is None or len(batch_sizes) == 0:
        return [1, 2]
    if not isinstance(batch_sizes, (list, tuple)) or any(
        isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes
    ):
        raise ConfigError(f"batch_sizes must be a list of positive integers, got {batch_sizes!r}.")
    sizes = list(dict.fromkeys(batch_sizes))
    if len(sizes) == 1:
        logger.warning("Only one batch size (%d): batch axes cannot be detected, shapes are treated as static.", sizes[0])
    return sizes


set_tuner(tune_module)
