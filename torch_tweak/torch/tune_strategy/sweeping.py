"""Measuring a built backend over a plan's batch sizes (used by the measuring strategies and the batch search)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.module.spec import GraphSpec, resize_batch
from torch_tweak.torch.profiling import Measurement, ProfilingConfig, SweepResult, device_sync, sweep
from torch_tweak.torch.tune_strategy import warm_calls
from torch_tweak.torch.tune_strategy.results import Plan, out_of_reach


def sweep_backend(backend: Backend, spec: GraphSpec, device: torch.device, plan: Plan, profiling: ProfilingConfig,
                  cancel: threading.Event | None,
                  keep_going: Callable[[Measurement], bool] | None = None) -> SweepResult:
    """Sweep ``backend`` over ``plan``'s batch sizes with ``profiling``'s rules, after its pause between candidates.

    The plan's sample is copied once, so a backend that writes to its inputs does not change the next candidate's.
    A screening plan's sweep also stops once the candidate is :func:`~.results.out_of_reach` of what it needs.
    """
    if profiling.pause_s > 0:
        time.sleep(profiling.pause_s)
    sample = copy.deepcopy(plan.sample)
    warm: set[int] = set()  # sizes the backend ran already in a call at least as long as a warm-up (warm_calls.py)

    def prepare(batch_size: int) -> Callable[[], Any]:
        args, kwargs = resize_batch(sample, spec, batch_size) if plan.batched else sample
        if warm_calls.warm(backend, args, kwargs, profiling.warmup_max_s):
            warm.add(batch_size)
        serve = backend.serving()  # what a tuned module calls: a guard's check on its runtime's input view, not infer's
        return lambda: serve(*args, **kwargs)

    def go_on(measurement: Measurement) -> bool:
        return (keep_going is None or keep_going(measurement)) and not out_of_reach(measurement, plan)

    with torch.no_grad():
        return sweep(prepare, plan.batch_sizes, profiling, sync=device_sync(device), cancel=cancel,
                     keep_going=go_on, batched=plan.batched, known=plan.known, warmed=warm.__contains__)
