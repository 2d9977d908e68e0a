"""Candidates that another measured candidate stands in for: skipped before they are built.

Some candidates would measure again what another candidate of the same graph has measured, at a build cost of
tens of seconds (a ResNet-50 on 2 cores: TorchAO 39 s, Inductor 61 s, Inductor AOT 23 s):

* ``TorchAOBackend`` quantizes ``nn.Linear`` layers only and compiles the rest with Inductor's defaults. When the
  graph's linear layers do less than :data:`LINEAR_SHARE` of its multiply-adds (a CNN whose one linear layer is
  the classifier: 0.05 % of a ResNet-50's), it computes like ``TorchInductorBackend()`` and is skipped once that
  candidate was measured.
* ``TorchInductorBackend`` and ``TorchInductorAOTBackend`` compile the graph with the same compiler into the same
  kernels; they differ in per-call overhead (Dynamo's guards), which matters at small batches only. When one
  was screened out (below ``1 - screening_margin`` of the best at both screening ends, the large one included),
  the other is skipped.

A skipped candidate is a ``skipped`` row naming what stood in for it. ``skip_stand_ins=False`` on a measuring
strategy builds every candidate.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.module.forward import original_forward, pristine
from torch_tweak.torch.report.report import CandidateReport
from torch_tweak.torch.report.status import CandidateStatus
from torch_tweak.torch.tune_strategy.base import GraphTask, describe_task
from torch_tweak.torch.tune_strategy.results import Evaluation

logger = logging.getLogger(__name__)

#: Below this share of a graph's multiply-adds in ``nn.Linear`` layers, quantizing them cannot change its speed.
LINEAR_SHARE = 0.01
_INDUCTOR, _AOT, _TORCHAO = "TorchInductorBackend", "TorchInductorAOTBackend", "TorchAOBackend"


def linear_share(module: nn.Module, task: GraphTask) -> float | None:
    """The share of one recorded call's multiply-adds done in ``nn.Linear`` layers (None: not countable)."""
    from torch.utils.flop_counter import FlopCounterMode

    linear = 0

    def count(layer: nn.Module, inputs: object, output: object) -> None:
        nonlocal linear
        if isinstance(output, torch.Tensor) and isinstance(layer, nn.Linear) and layer.out_features:
            linear += 2 * layer.in_features * output.numel()

    layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not layers:
        return 0.0
    handles = [layer.register_forward_hook(count) for layer in layers]
    args, kwargs = task.data()[0]
    try:
        with pristine(module), torch.no_grad(), FlopCounterMode(display=False) as counter:
            original_forward(module)(*args, **kwargs)
        total = counter.get_total_flops()
    except Exception as exc:  # noqa: BLE001 - counting is an optimisation: any failure means "not countable"
        logger.debug("%s: multiply-adds could not be counted: %s", describe_task(task), exc)
        return None
    finally:
        for handle in handles:
            handle.remove()
    return min(1.0, linear / total) if total else None


class StandIns:
    """Mixed into ``MeasuringStrategy``: the ``skipped`` row of a candidate another one stands in for."""

    skip_stand_ins: bool

    def _stand_in_row(self, template: Backend, role: str, task: GraphTask,
                      evaluations: list[Evaluation]) -> CandidateReport | None:
        if not self.skip_stand_ins:
            return None
        name = type(template).__name__
        measured = {e.template.key(): e for e in evaluations if e.template is not None and e.sweep is not None}
        reason = None
        if name == _TORCHAO:
            inductor = measured.get(_default_key(_INDUCTOR))
            share = linear_share(task.module, task) if inductor is not None else None
            if inductor is not None and share is not None and share < LINEAR_SHARE:
                reason = (f"it quantizes nn.Linear layers only, which do {share:.2%} of this graph's multiply-adds, "
                          f"and compiles the rest like {inductor.row.backend}, measured above")
        elif name in (_INDUCTOR, _AOT) and template.key() == _default_key(name):
            sibling = measured.get(_default_key(_AOT if name == _INDUCTOR else _INDUCTOR))
            if sibling is not None and sibling.row.status == CandidateStatus.SCREENED_OUT:
                reason = (f"it compiles the graph into the same kernels as {sibling.row.backend}, which was screened "
                          "out")
        if reason is None:
            return None
        row = CandidateReport(backend=template.describe(), key=template.key(), role=role,
                              status=CandidateStatus.SKIPPED)
        row.error = f"skipped: {reason}; pass skip_stand_ins=False to the strategy to build it anyway"
        return row


def _default_key(name: str) -> str | None:
    """The key of backend ``name`` with its default config (None where it is not available here)."""
    from torch_tweak.torch.backend.registry import backend_class

    cls = backend_class(name)
    return cls().key() if cls is not None else None
