"""Max-batch-size search on eager: find the batch size with the highest throughput, widen the graph to it.

Opt-in per strategy (``enable_find_max_batch_size()`` on any strategy, or ``find_max_batch_size=True`` for
the measuring ones); every built-in strategy runs it first through :func:`search_if_enabled`. Only graphs with
a batch axis are searched: running an unbatched graph "at batch 8" would just repeat the same call and
report a throughput that does not exist.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.config import config
from torch_tweak.torch.profiling import SweepResult, power_of_two_batch_sizes
from torch_tweak.torch.profiling.limit import run_with_time_limit
from torch_tweak.torch.tune_strategy.base import GraphTask, Measure, TuneStrategy, describe_task, release_quietly
from torch_tweak.torch.tune_strategy.results import Plan
from torch_tweak.utils.capture import capture_output
from torch_tweak.utils.permissions import secure_mkdir

logger = logging.getLogger(__name__)

SEARCH_DIR = "find_max_batch_size"


def search_if_enabled(strategy: TuneStrategy, task: GraphTask) -> int | None:
    """Run :func:`search_max_batch_size` with ``strategy``'s settings when it has the search enabled."""
    if not strategy.find_max_batch_size:
        return None
    return search_max_batch_size(task, strategy.batch_search_baseline(), strategy.max_batch_size_limit,
                                 strategy.candidate_time_limit_s, strategy.batch_search_measure())


def search_max_batch_size(task: GraphTask, baseline: Backend, limit: int, time_limit_s: float | None,
                          measure: Measure) -> int | None:
    """Sweep ``baseline`` (the strategy's eager baseline) over powers of two up to ``limit``, each attempt
    measured with ``measure`` and bounded by ``time_limit_s``.

    The batch size with the highest throughput becomes the graph's max batch size when it is larger than
    the recorded one (``task.graph_spec`` is widened in place, so the module keeps the wider spec). The
    outcome lands in ``task.report.batch_search``. A failure is recorded and logged, and tuning goes on
    with the recorded range. Returns the new max batch size, or None when nothing changed.
    """
    spec = task.graph_spec
    if not spec.has_batch_axis():
        task.report.batch_search = {"skipped": "the graph has no batch axis, so its batch size cannot change"}
        logger.info("%s: no batch axis, max batch size search skipped", describe_task(task))
        return None
    low, high = spec.batch_range() or (1, 1)
    sizes = power_of_two_batch_sizes(low, max(limit, low))
    record: dict[str, Any] = {"recorded_range": [low, high], "batch_sizes": sizes, "backend": baseline.describe()}
    task.report.batch_search = record
    plan = Plan(sizes, True, copy.deepcopy(task.samples[0].sample))
    cache_dir = secure_mkdir(task.cache_dir / SEARCH_DIR)

    def run(cancel: Any) -> SweepResult:
        backend = copy.deepcopy(baseline)
        with capture_output(cache_dir / "build.log", console=config.console_output):
            backend.build(task.module, spec, task.data(), task.device, cache_dir)
        try:
            return measure(backend, task, plan, cancel)
        finally:
            release_quietly(backend)

    try:
        finished, result = run_with_time_limit(run, time_limit_s)
    except Exception as exc:  # noqa: BLE001 - the search is an optimization; tuning goes on without it
        record["error"] = f"{type(exc).__name__}: {exc} (build log: {cache_dir / 'build.log'})"
        logger.warning("%s: max batch size search failed, keeping the recorded range: %s", describe_task(task),
                       record["error"])
        return None
    if not finished:
        record["error"] = f"TimeoutError: the search exceeded candidate_time_limit_s={time_limit_s:g} s"
        logger.warning("%s: max batch size search timed out, keeping the recorded range", describe_task(task))
        return None
    record["sweep"] = result.to_dict()
    best = result.best()
    if best is None:
        record["error"] = f"nothing could be measured: {result.error}"
        logger.warning("%s: max batch size search measured nothing: %s", describe_task(task), result.error)
        return None
    record["max_batch_size"] = max(best.batch_size, high)
    record["extended"] = best.batch_size > high
    logger.info("%s: max batch size %d with throughput %.1f samples/s", describe_task(task), best.batch_size,
                best.throughput)
    if best.batch_size <= high:
        return None
    widened = spec.with_max_batch_size(best.batch_size)
    spec.inputs, spec.outputs = widened.inputs, widened.outputs
    task.report.spec = spec.to_dict()
    return best.batch_size
