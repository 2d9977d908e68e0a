"""Batch routes between runtimes, kept only when calls of mixed batch sizes confirm them.

Routes within one runtime follow from the candidates' own sweeps (``routing.py``). A route to another
runtime (ONNX Runtime for small batches, OpenVINO for large ones) looks faster on paper too, but calls that
alternate between runtimes pay for their competing thread pools (ONNX Runtime's threads spin after a call
while OpenVINO's start), which no single-runtime sweep shows. So such a route is measured before it serves:
the proposed router and the single-runtime choice each serve the same cycle of calls, one at every batch
size the chosen candidate was measured at, and the router is kept only when it is faster by the strategy's
``eager_margin``. The graph's reason in the report gives both numbers either way.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.batch_router import BatchRouterBackend
from torch_tweak.torch.module.spec import GraphSpec, resize_batch
from torch_tweak.torch.profiling import ProfilingConfig, device_sync, measure
from torch_tweak.torch.tune_strategy.base import GraphTask, describe_task, release_quietly
from torch_tweak.torch.tune_strategy.results import Evaluation, Plan
from torch_tweak.torch.tune_strategy.routing import Routes, batch_routes, runtime_of

logger = logging.getLogger(__name__)


def mixed_throughput(backend: Backend, spec: GraphSpec, device: torch.device, plan: Plan, sizes: list[int],
                     profiling: ProfilingConfig) -> float:
    """Samples per second of ``backend`` serving a cycle of calls, one at each of ``sizes`` in turn."""
    sample = copy.deepcopy(plan.sample)
    calls = [resize_batch(sample, spec, size) for size in sizes]

    def cycle() -> None:
        for args, kwargs in calls:
            backend.infer(*args, **kwargs)

    with torch.no_grad():
        return measure(cycle, sum(sizes), profiling, sync=device_sync(device)).throughput


def _serving(routes: Routes | None, chosen: Evaluation, spec: GraphSpec) -> Backend:
    if routes is None:
        assert chosen.backend is not None
        return chosen.backend
    return BatchRouterBackend([(bound, e.backend) for bound, e in routes], spec)  # type: ignore[misc]


class MixedRoutes:
    """Mixed into ``MeasuringStrategy``: routes to other runtimes, proposed and then measured on mixed calls."""

    eager_margin: float
    profiling: ProfilingConfig
    # From MeasuringStrategy and its mixins: ``_rebuild``.

    def _routes_across_runtimes(self: Any, task: GraphTask, chosen: Evaluation, evaluations: list[Evaluation],
                                routes: Routes | None, plan: Plan) -> tuple[Routes | None, str]:
        """``routes`` or routes that cross runtimes where mixed calls confirm them, and what the reason adds."""
        margin = 1.0 + self.eager_margin
        proposal = batch_routes(chosen, evaluations, margin, any_runtime=True)
        if proposal is None or all(runtime_of(e) == runtime_of(chosen) for _, e in proposal) or not plan.batched:
            return routes, ""
        serving = [chosen] if routes is None else [e for _, e in routes]
        built_now = [e for _, e in proposal if e.backend is None]
        for evaluation in built_now:
            if not self._rebuild(task, evaluation):
                return routes, f"; a route to {evaluation.row.backend} was not tried (building it here failed)"
        assert chosen.sweep is not None
        sizes = [m.batch_size for m in chosen.sweep.measurements if m.batched]
        current, proposed = _serving(routes, chosen, task.graph_spec), _serving(proposal, chosen, task.graph_spec)
        spec, device = task.graph_spec, task.device
        before = mixed_throughput(current, spec, device, plan, sizes, self.profiling)
        after = mixed_throughput(proposed, spec, device, plan, sizes, self.profiling)
        before = max(before, mixed_throughput(current, spec, device, plan, sizes, self.profiling))
        others = sorted({e.row.backend for _, e in proposal if runtime_of(e) != runtime_of(chosen)})
        cycle = f"one call at each batch size {sizes} in turn: {after:.1f} vs {before:.1f} samples/s"
        if after >= margin * before:
            logger.info("%s: routes to %s confirmed on mixed calls (%s)", describe_task(task), others, cycle)
            return proposal, f"; routes to another runtime ({', '.join(others)}) confirmed on mixed calls ({cycle})"
        for evaluation in built_now:
            if all(evaluation is not e for e in serving) and evaluation.backend is not None:
                release_quietly(evaluation.backend)
                evaluation.backend = None
        logger.info("%s: routes to %s not kept: mixed calls were not faster (%s)", describe_task(task), others, cycle)
        return routes, (f"; routes to another runtime ({', '.join(others)}) were measured on mixed calls and not "
                        f"kept ({cycle}; they need {margin:.2f}x)")
