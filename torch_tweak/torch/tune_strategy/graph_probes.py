"""What the stand-in rules (``stand_ins.py``) measure on a graph itself, once per tuning of it and kept for a rerun.

Why: two of the rules' inputs are measurements of the eager graph, not of a candidate: the time an eager call spends
in the kernels Inductor keeps (:func:`kernel_time`) and the share of its multiply-adds in ``nn.Linear`` layers
(:func:`~.linear_calls.linear_share`). Each is taken once per ``GraphTask`` (``task.probed``), and the result cache
keeps both, with the mixed-call timings of routes across runtimes and the head-to-head timings of close
contenders, beside the candidates' results (:data:`KEPT_PROBES`): a rerun that reuses the candidates' measurements
then decides as the first run did, without timing anything (the kernel timing is noisy near a rule's bound: the
demo CNN's second run once compiled Inductor for 13 s that the first had skipped)."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_tweak.torch.module.forward import original_forward, pristine
from torch_tweak.torch.tune_strategy.base import GraphTask, describe_task
from torch_tweak.torch.tune_strategy.linear_calls import linear_share
from torch_tweak.utils.pause import paused

logger = logging.getLogger(__name__)

#: The aten ops (as a dispatch mode sees them) whose kernels Inductor's default CPU compile calls as eager does.
HEAVY_KERNELS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "convolution", "_convolution", "mkldnn_rnn_layer",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
})
#: Eager calls timed op by op for the bound: at most this many, at least two, until they add up to
#: :data:`KERNEL_TIMING_MS` (a ResNet-50 at batch 1, 75 ms a call: two calls; the demo's CNN, 1.6 ms: twenty).
KERNEL_CALLS = 20
KERNEL_TIMING_MS = 30.0
#: The key of the kernel timing in ``GraphTask.probed``: the result cache keeps it, so that a rerun that reuses the
#: other candidates' measurements decides as the first run did.
KERNEL_TIME = "kernel_time"
#: ... and that of the graph's share of multiply-adds in ``nn.Linear`` layers.
LINEAR_SHARE_PROBE = "linear_share"
#: ... and that of the mixed-call timings of routes across runtimes (``mixed_routes.py``), by routings compared.
MIXED_CALL_TIMES = "mixed_call_times"
#: ... and that of the head-to-head timings of close contenders (``contest.py``), by contenders and batch sizes.
CONTEST_TIMES = "contest_times"
#: What the result cache keeps of a ``GraphTask.probed`` for a rerun.
KEPT_PROBES = (KERNEL_TIME, LINEAR_SHARE_PROBE, MIXED_CALL_TIMES, CONTEST_TIMES)
_MISSING = object()


def kernel_time(task: GraphTask) -> tuple[int, float, float] | None:
    """The batch size of the smallest recorded call, the milliseconds one eager call of it spends in
    :data:`HEAVY_KERNELS` and the milliseconds of that whole call (None: not a CPU graph, or the call failed).

    The kernels are timed under a dispatch mode, the whole call without one, in turns: the mode's Python overhead on
    every op made the demo CNN's 1.5 ms call take 2.4 ms, a third more than eager ever spends on what Inductor
    could remove. Both are averages over up to :data:`KERNEL_CALLS` pairs of calls (:data:`KERNEL_TIMING_MS` of
    them at least): one call of that CNN put 79 % of it in its kernels in one run and little enough in the next to
    compile Inductor for 13 s, for the 0.41x of the best that the first run's bound had foreseen."""
    sized = [s for s in task.samples if s.batch_size is not None]
    if not sized or task.device.type != "cpu":
        return None
    smallest = min(sized, key=lambda s: s.batch_size or 0)
    args, kwargs = copy.deepcopy(smallest.sample)
    timer = _KernelTimer()
    calls, call_s = 0, 0.0
    try:
        with pristine(task.module), torch.no_grad():
            with _KernelTimer():  # warm, under a mode too: the first call under a dispatch mode in a process takes
                original_forward(task.module)(*args, **kwargs)  # 20x longer (a ResNet-50 at batch 1: 1.5 s, not 75 ms)
            original_forward(task.module)(*args, **kwargs)  # and the first one after it without: 3x
            with paused():
                while calls < KERNEL_CALLS and (calls < 2 or call_s * 1000.0 < KERNEL_TIMING_MS):
                    start = time.perf_counter()  # the whole call, as eager runs it
                    original_forward(task.module)(*args, **kwargs)
                    call_s += time.perf_counter() - start
                    with timer:  # its kernels (the mode's own overhead on every op stays out of both times)
                        original_forward(task.module)(*args, **kwargs)
                    calls += 1
    except Exception as exc:  # noqa: BLE001 - the bound is an optimisation: any failure means "no bound"
        logger.debug("%s: kernel time could not be measured: %s", describe_task(task), exc)
        return None
    return smallest.batch_size or 1, timer.seconds * 1000.0 / calls, call_s * 1000.0 / calls


def probed_kernel_time(task: GraphTask) -> tuple[int, float, float] | None:
    """:func:`kernel_time`, once per task (kept in ``task.probed``, which the result cache keeps for a rerun)."""
    timed = probe(task, KERNEL_TIME, _is_timing, lambda: kernel_time(task))
    return None if timed is None else (int(timed[0]), float(timed[1]), float(timed[2]))


def probed_linear_share(task: GraphTask) -> float | None:
    """:func:`~.linear_calls.linear_share` of the task's graph, once per task and kept like the kernel time (its
    counter, the first dispatch mode of a process, imports ``torch._dynamo``: 3-5 s on 2 cores)."""
    return probe(task, LINEAR_SHARE_PROBE, _is_share, lambda: linear_share(task.module, task))


def probe(task: GraphTask, name: str, valid: Callable[[Any], bool], measure: Callable[[], Any]) -> Any:
    """``task.probed[name]``, measured first when it is missing or not a valid value (a malformed stored one): each
    probe of a graph runs once per tuning of it."""
    value = task.probed.get(name, _MISSING)
    if value is _MISSING or (value is not None and not valid(value)):
        value = task.probed[name] = measure()
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _is_timing(value: Any) -> bool:
    """Whether ``value`` is what :func:`kernel_time` returns (a JSON copy of it is a list)."""
    return isinstance(value, (tuple, list)) and len(value) == 3 and all(_is_number(v) for v in value)


def _is_share(value: Any) -> bool:
    return _is_number(value) and value <= 1.0


class _KernelTimer(TorchDispatchMode):
    """Adds up the wall time of the :data:`HEAVY_KERNELS` ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ not in HEAVY_KERNELS:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - start
        return out
