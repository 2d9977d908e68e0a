"""What a graph's ``nn.Linear`` layers do: their share of its multiply-adds, its largest call, and that call timed in
int8 against float. The stand-in rules for TorchAO (``stand_ins.py``) decide with these; they run the module's own
forward on recorded calls, so they run where the module is (the tuning process, a worker).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.module.forward import original_forward, pristine
from torch_tweak.torch.module.tree import flatten_sample
from torch_tweak.torch.tune_strategy.base import GraphTask, describe_task
from torch_tweak.utils.pause import paused

logger = logging.getLogger(__name__)

#: Calls and seconds (at least) each layer of the int8 probe is timed for.
PROBE_CALLS = 3
PROBE_S = 0.2


class _LinearCalls:
    """A forward hook adding up the multiply-adds of the calls of a module's ``nn.Linear`` layers.

    The hook is registered for the whole process (``register_module_forward_hook``) and counts these layers only,
    never on the layers themselves: a hook there is part of the module's state, and the background worker's sender
    thread pickles the module while this thread probes it. A BERT-base sent that way arrived with the hooks on;
    Dynamo compiled them into TorchInductorBackend()'s graph with a guard on the running count, recompiled at every
    call and hit its recompile limit (2 cores of an AVX2 EPYC: 155 s of building, then eager speed measured).
    """

    def __init__(self, module: nn.Module, keep_input: bool = False) -> None:
        self.layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
        self._mine = {id(layer) for layer in self.layers}
        self.total = 0
        self.largest = 0
        self.keep_input = keep_input
        #: With ``keep_input``: the layer of the largest call and a copy of that call's input.
        self.largest_call: tuple[nn.Linear, torch.Tensor] | None = None

    def count(self, layer: nn.Module, inputs: tuple[Any, ...], output: object) -> None:
        if id(layer) in self._mine and isinstance(output, torch.Tensor) and isinstance(layer, nn.Linear) \
                and layer.out_features:
            macs = layer.in_features * output.numel()
            self.total += macs
            if macs > self.largest and self.keep_input and inputs and isinstance(inputs[0], torch.Tensor):
                self.largest_call = (layer, inputs[0].detach().clone())
            self.largest = max(self.largest, macs)

    def run(self, module: nn.Module, task: GraphTask, sample: Any, counter: Any = None) -> bool:
        """Run ``sample`` through ``module``'s own forward with the counting hook on (and ``counter`` around it);
        False if the call failed (counting is an optimisation: a failure means "not countable")."""
        handle = register_module_forward_hook(self.count)
        args, kwargs = sample
        try:
            with pristine(module), torch.no_grad(), counter or contextlib.nullcontext():
                original_forward(module)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            logger.debug("%s: multiply-adds could not be counted: %s", describe_task(task), exc)
            return False
        finally:
            handle.remove()
        return True


def linear_share(module: nn.Module, task: GraphTask) -> float | None:
    """The share of one recorded call's multiply-adds done in ``nn.Linear`` layers (None: not countable)."""
    from torch.utils.flop_counter import FlopCounterMode

    calls = _LinearCalls(module)
    if not calls.layers:
        return 0.0
    counter = FlopCounterMode(display=False)
    if not calls.run(module, task, task.data()[0], counter):
        return None
    total = counter.get_total_flops()
    return min(1.0, 2 * calls.total / total) if total else None


def _largest_batch_calls(task: GraphTask, keep_input: bool = False) -> _LinearCalls | None:
    """The ``nn.Linear`` calls of the recorded call of the largest batch, counted (None: not countable).

    They are counted on the smallest recorded call that differs from it only in its batch size, when that size
    divides the largest one, and scaled up: the multiply-adds by the ratio, the kept input repeated along its first
    axis (an ``nn.Linear`` multiplies the same matrices whichever leading axis holds the batch). A BERT-base's call
    at batch 32 takes 4.4 s in eager on 2 cores, one at batch 1 0.15 s. A layer whose calls do not grow with the
    batch is counted as if they did."""
    calls = _LinearCalls(task.module, keep_input)
    if not calls.layers:
        return calls
    if not task.samples:
        return None
    sample, factor = _scaled_stand_in(task)
    if not calls.run(task.module, task, copy.deepcopy(sample)):
        return None
    if factor > 1:
        calls.total *= factor
        calls.largest *= factor
        if calls.largest_call is not None:
            layer, activation = calls.largest_call
            calls.largest_call = layer, activation.repeat(factor, *[1] * (activation.dim() - 1))
    return calls


def _scaled_stand_in(task: GraphTask) -> tuple[Any, int]:
    """The recorded call to count the largest batch's ``nn.Linear`` calls on, and the factor its batch size falls
    short by (1: the largest call itself)."""
    largest = max(task.samples, key=lambda s: s.batch_size or 0)
    target = _shapes_apart_from_batch(task, largest.sample)
    if not largest.batch_size or target is None:
        return largest.sample, 1
    for recorded in sorted(task.samples, key=lambda s: s.batch_size or 0):
        size = recorded.batch_size
        if size and largest.batch_size % size == 0 and _shapes_apart_from_batch(task, recorded.sample) == target:
            return recorded.sample, largest.batch_size // size
    return largest.sample, 1


def _shapes_apart_from_batch(task: GraphTask, sample: Any) -> list[tuple[int | None, ...]] | None:
    """The shapes of a call's input tensors with their batch axes blanked (None: not the graph's inputs)."""
    leaves, _ = flatten_sample(*sample)
    specs = task.graph_spec.inputs
    if len(leaves) != len(specs) or not all(isinstance(t, torch.Tensor) for t in leaves):
        return None
    return [tuple(None if axis in spec.batch_multipliers else size for axis, size in enumerate(t.shape))
            for t, spec in zip(leaves, specs, strict=True)]


def largest_linear_call(task: GraphTask) -> int | None:
    """The multiply-adds of the largest ``nn.Linear`` call in the recorded call of the largest batch (0: the graph
    has no linear layer; None: not countable)."""
    calls = _largest_batch_calls(task)
    return None if calls is None else calls.largest


def int8_layer_slowdown(template: Backend, task: GraphTask) -> tuple[float, str] | None:
    """How many times longer the quantized call of the graph's largest ``nn.Linear`` call takes than the float one,
    both as ``template`` runs them (:meth:`Backend.int8_layer_calls`) and timed in turns on that call's recorded
    input, with the call's shape (None: no such call or probe, not a CPU graph, or it failed)."""
    calls = _largest_batch_calls(task, keep_input=True) if task.device.type == "cpu" else None
    if calls is None or calls.largest_call is None:
        return None
    layer, activation = calls.largest_call
    try:
        with pristine(task.module):
            pair = template.int8_layer_calls(layer, activation)
            if pair is None:
                return None
            wall, cpu = _timed_in_turns(*pair)
    except Exception as exc:  # noqa: BLE001 - the probe is an optimisation: any failure means "build it"
        logger.debug("%s: the int8 layer could not be timed: %s", describe_task(task), exc)
        return None
    shape = "x".join(str(d) for d in activation.shape)
    ratio = min(quantized / max(floated, 1e-9) for floated, quantized in (wall, cpu))
    return ratio, f"{shape} -> {layer.out_features}"


def _timed_in_turns(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[tuple[float, float], ...]:
    """Median wall and process CPU seconds of ``first()`` and ``second()``, called in turns (a busy machine slows
    both alike) for at least :data:`PROBE_CALLS` calls each and :data:`PROBE_S` seconds, with background builds
    paused: ``((first wall, second wall), (first CPU, second CPU))``. A background worker that probes may itself
    be paused (stopped) by a measurement elsewhere, or share a core: that stretches its wall times, not its CPU
    times, so the slowdown a rule takes is the smaller of the two ratios."""
    times: tuple[list[float], ...] = ([], [], [], [])  # wall of first, second; CPU of first, second
    with torch.no_grad(), paused():
        first(), second()  # warm-up
        start = time.perf_counter()
        while len(times[0]) < PROBE_CALLS or time.perf_counter() - start < PROBE_S:
            for index, call in enumerate((first, second)):
                wall, cpu = time.perf_counter(), time.process_time()
                call()
                times[index].append(time.perf_counter() - wall)
                times[2 + index].append(time.process_time() - cpu)
    medians = [statistics.median(spent) for spent in times]
    return (medians[0], medians[1]), (medians[2], medians[3])
