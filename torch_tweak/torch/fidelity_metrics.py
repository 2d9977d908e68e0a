"""Task metrics for the fidelity check: judge a candidate by what the task needs, not by every element.

The default fidelity check ("strict") bounds the error of every output element by a tolerance chosen for
the executed precision. That is the right default, and it rejects reduced precision (bf16, int8) on
networks whose outputs no user reads element by element: a sentence-embedding model is judged by the
direction of its embeddings, a classifier by its top predictions. ``FidelityConfig(metric=...)`` replaces
the tolerance with one of these, computed over all floating-point outputs of all recorded samples:

===========  ======================================================================  ==========  =========
name         value                                                                   better      threshold
===========  ======================================================================  ==========  =========
``cosine``   the smallest cosine similarity between eager's and the candidate's      higher      0.99
             vectors along the last axis (one per token, embedding or row)
``topk``     mean overlap of the top-``k`` indices along the last axis (logits),     higher      0.99
             ``k=1``: the share of rows whose arg-max agrees
``rel_l2``   relative L2 error: ``‖candidate - eager‖ / ‖eager‖`` over all outputs   lower       0.05
===========  ======================================================================  ==========  =========

A user metric is a callable ``metric(reference_outputs, candidate_outputs) -> float`` over one sample's
outputs (the module's own output structure), higher is better unless ``higher_is_better=False``.

Over several recorded calls, ``cosine``, ``rel_l2`` and user metrics are judged by their worst value (each
call must meet the threshold). ``topk`` is a share of rows, like the accuracy it stands for, so it is pooled:
the share of agreeing rows over all judged calls (each call weighted by its number of rows) must meet the
threshold. Judging it call by call would reject a classifier for one flipped arg-max among many batch-1 calls
(a call of one row agrees 0 % or 100 %), however rare the flips are.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torch_tweak.errors import ConfigError
from torch_tweak.torch.module.tree import flatten
from torch_tweak.utils.validate import check_bool, check_int, check_number


def _float_pairs(reference: Any, candidate: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    expected, _ = flatten(reference)
    actual, _ = flatten(candidate)
    return [(e.detach().double(), a.detach().double()) for e, a in zip(expected, actual)
            if e.is_floating_point() and e.numel() > 0]


def cosine(reference: Any, candidate: Any) -> float:
    """The smallest cosine similarity of eager's and the candidate's vectors along the last axis."""
    worst = 1.0
    for e, a in _float_pairs(reference, candidate):
        e2, a2 = _vectors(e), _vectors(a)
        norm_e, norm_a = e2.norm(dim=-1), a2.norm(dim=-1)
        dots = (e2 * a2).sum(dim=-1)
        values = torch.where((norm_e == 0) & (norm_a == 0), torch.ones_like(dots),
                             dots / (norm_e * norm_a).clamp_min(1e-300))
        worst = min(worst, float(values.min()))
    return worst


def _vectors(t: torch.Tensor) -> torch.Tensor:
    """``t`` as rows of its last axis (a scalar is one vector of length 1)."""
    return t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)


def topk_agreement(reference: Any, candidate: Any, k: int = 1) -> float:
    """Mean overlap of eager's and the candidate's top-``k`` indices along the last axis (1.0: identical)."""
    overlaps: list[float] = []
    for e, a in _float_pairs(reference, candidate):
        if e.dim() == 0 or e.shape[-1] < k:
            continue
        top_e, top_a = _vectors(e).topk(k, dim=-1).indices, _vectors(a).topk(k, dim=-1).indices
        shared = (top_e.unsqueeze(-1) == top_a.unsqueeze(-2)).any(dim=-1).sum(dim=-1).double() / k
        overlaps.append(float(shared.mean()))
    return min(overlaps) if overlaps else 1.0


def topk_rows(reference: Any, k: int = 1) -> float:
    """The number of rows :func:`topk_agreement` compares in ``reference`` (of its first output that has any)."""
    for e in flatten(reference)[0]:
        if e.is_floating_point() and e.numel() and e.dim() and e.shape[-1] >= k:
            return float(e.numel() // e.shape[-1])
    return 0.0


def relative_l2(reference: Any, candidate: Any) -> float:
    """``‖candidate - eager‖ / ‖eager‖`` over every floating-point output."""
    diff = ref = 0.0
    for e, a in _float_pairs(reference, candidate):
        diff += float(((a - e) ** 2).sum())
        ref += float((e**2).sum())
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return math.sqrt(diff / ref)


_BUILT_IN: dict[str, tuple[bool, float]] = {"cosine": (True, 0.99), "topk": (True, 0.99), "rel_l2": (False, 0.05)}


@dataclass(frozen=True)
class TaskMetric:
    """A task metric with its threshold (see the module docstring); built by :func:`task_metric`."""

    name: str
    function: Callable[[Any, Any], float]
    threshold: float
    higher_is_better: bool
    weight: Callable[[Any], float] | None = None  # pooled metrics: a call's weight (rows); None: judged by the worst

    @property
    def pooled(self) -> bool:
        """True when the metric is judged over all calls together (a weighted mean), not call by call."""
        return self.weight is not None

    def judge(self, values: list[float]) -> tuple[float, bool]:
        """The worst value over the samples and whether it meets the threshold."""
        if not values:
            return math.nan, False
        worst = min(values) if self.higher_is_better else max(values)
        ok = math.isfinite(worst) and (worst >= self.threshold if self.higher_is_better else worst <= self.threshold)
        return worst, ok

    def describe(self) -> str:
        """``cosine >= 0.99`` style text for the report."""
        return f"{self.name} {'>=' if self.higher_is_better else '<='} {self.threshold:g}"


def task_metric(metric: str | Callable[[Any, Any], float], threshold: float | None = None,
                higher_is_better: bool | None = None, k: int = 1) -> TaskMetric:
    """Validate a metric setting (a built-in name or a callable) and return it with its threshold."""
    check_int(k, "FidelityConfig.k", minimum=1)
    check_number(threshold, "FidelityConfig.threshold", allow_none=True)
    check_bool(higher_is_better, "FidelityConfig.higher_is_better", allow_none=True)
    if isinstance(metric, str):
        if metric not in _BUILT_IN:
            raise ConfigError(f"FidelityConfig.metric {metric!r} is not a built-in metric ({sorted(_BUILT_IN)}); pass one "
                              "of those or a callable metric(reference_outputs, candidate_outputs) -> float.")
        default_higher, default_threshold = _BUILT_IN[metric]
        if higher_is_better is not None and higher_is_better != default_higher:
            raise ConfigError(f"The {metric!r} metric is {'higher' if default_higher else 'lower'} is better; do not "
                              "set higher_is_better for it.")
        # module-level functions (partials of them), so that the config pickles to a tuning worker process
        function: Callable[[Any, Any], float] = {
            "cosine": cosine, "rel_l2": relative_l2, "topk": functools.partial(topk_agreement, k=k),
        }[metric]
        name = f"top{k}" if metric == "topk" else metric
        weight = functools.partial(topk_rows, k=k) if metric == "topk" else None
        return TaskMetric(name, function, default_threshold if threshold is None else float(threshold), default_higher,
                          weight)
    if not callable(metric):
        raise ConfigError(f"FidelityConfig.metric must be None, a built-in name or a callable, got {type(metric).__name__}.")
    if threshold is None:
        raise ConfigError("A callable FidelityConfig.metric needs a threshold: FidelityConfig(metric=f, threshold=...).")
    name = getattr(metric, "__name__", type(metric).__name__)
    return TaskMetric(name, metric, float(threshold), True if higher_is_better is None else higher_is_better)
