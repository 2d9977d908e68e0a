"""Fidelity check: a candidate's outputs compared with the eager outputs recorded for the same inputs.

Checks run in order and stop at the first failure: same output structure (tensor count, container
types, non-tensor values), same shapes, no NaN/Inf where eager was finite, then values within a
tolerance chosen by the precision the candidate actually executed:

========  ==========================================================================
fp32      every element: ``|actual - expected| <= atol + rtol * |expected|``
bf16      relative L2 error and cosine similarity of each output tensor
fp16      relative L2 error and cosine similarity (tighter than bf16)
int8/fp8  relative L2 error and cosine similarity (loosest: quantized weights)
========  ==========================================================================

Integer and bool outputs (token ids, masks) must match exactly in fp32 and may differ in at most
``max_mismatch_fraction`` of the elements otherwise.

With ``FidelityConfig(metric=...)`` the values are judged like the task instead (cosine of embeddings, top-k
agreement of logits, relative L2, or a user callable; :mod:`torch_tweak.torch.fidelity_metrics`): the
worst value over the recorded samples (for top-k, the share of agreeing rows over all of them) must meet the
threshold, and the report shows it next to the bound. :func:`check_calls` judges a candidate over many calls.

Recorded samples are finite, so they cannot show whether a candidate turns invalid input into plausible
output (OpenVINO's CPU plugin maps NaN to a finite value in ReLU, Clamp, Maximum, MaxPool and ReduceMax, so
a NaN row of an MLP or CNN comes back as finite numbers). :func:`probe_non_finite` therefore writes NaN,
then +inf, into one batch row of every floating-point input of one recorded sample, runs the module's own
forward and the candidate on it, and requires the same NaN and inf positions in every floating-point
output (:attr:`FidelityConfig.check_non_finite`). A candidate that fails them is, by default, kept behind
a :class:`~torch_tweak.torch.backend.non_finite_guard.NonFiniteGuardBackend` (calls with NaN/inf inputs
run the module's own forward) once the probes pass through the guard (:attr:`FidelityConfig.non_finite`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from torch_tweak.errors import ConfigError
from torch_tweak.torch.fidelity_metrics import TaskMetric, task_metric
from torch_tweak.torch.fidelity_probes import (  # noqa: F401 - the fidelity check's public names
    PROBE_FAILED,
    PROBE_GUARDED,
    PROBE_PASSED,
    PROBE_SKIPPED,
    PROBE_VALUES,
    SHOWN,
    THROUGH_GUARD,
    NonFiniteProbe,
    compare_non_finite,
    guarded_probes,
    judged_probe_outcome,
    poison_sample,
    probe_non_finite,
    probe_sample,
    strip_classes,
)
from torch_tweak.torch.module.tree import flatten
from torch_tweak.utils.validate import check_bool, check_choice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerance:
    """Limits for one precision. ``atol``/``rtol`` apply elementwise; the others per tensor."""

    atol: float | None = None
    rtol: float | None = None
    max_rel_l2: float | None = None
    min_cosine: float | None = None
    max_mismatch_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("atol", "rtol", "max_rel_l2", "max_mismatch_fraction"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise ConfigError(f"Tolerance.{name} must be a number >= 0, got {value!r}.")
        if self.min_cosine is not None and not -1.0 <= self.min_cosine <= 1.0:
            raise ConfigError(f"Tolerance.min_cosine must be in [-1, 1], got {self.min_cosine!r}.")
        if (self.atol is None) != (self.rtol is None):
            raise ConfigError("Tolerance.atol and Tolerance.rtol must be given together.")
        if self.atol is None and self.max_rel_l2 is None and self.min_cosine is None:
            raise ConfigError("A Tolerance needs atol/rtol, max_rel_l2 or min_cosine.")

    def describe(self) -> str:
        """Compact text such as ``atol=1e-4,rtol=1e-4``."""
        return ",".join(f"{k}={v:g}" for k, v in asdict(self).items() if v is not None and (v or k != "max_mismatch_fraction"))


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-4),
    "bf16": Tolerance(max_rel_l2=4e-2, min_cosine=0.999, max_mismatch_fraction=0.01),
    "fp16": Tolerance(max_rel_l2=1e-2, min_cosine=0.9995, max_mismatch_fraction=0.01),
    "int8": Tolerance(max_rel_l2=0.15, min_cosine=0.99, max_mismatch_fraction=0.02),
    "fp8": Tolerance(max_rel_l2=0.15, min_cosine=0.99, max_mismatch_fraction=0.02),
}


NON_FINITE_GUARD = "guard"
NON_FINITE_MODES = (NON_FINITE_GUARD, "reject")


@dataclass
class FidelityConfig:
    """How candidates are judged: strict tolerances per executed precision (the default; unknown precisions
    use the loosest, ``int8``, limits), or a task metric.

    Attributes:
        tolerances: a :class:`Tolerance` per executed precision.
        metric: None (strict: every output element within the tolerance of the executed precision), a built-in
            task metric (``"cosine"``, ``"topk"``, ``"rel_l2"``) or a callable
            ``metric(reference_outputs, candidate_outputs) -> float`` (see :mod:`torch_tweak.torch.fidelity_metrics`).
            With a metric, structure, shapes and finiteness are still checked element by element; the values are
            judged against ``threshold`` by the metric's worst value over the recorded samples (``topk``: the
            share of agreeing rows over all of them).
        threshold: the metric's bound (built-in defaults: cosine 0.99, topk 0.99, rel_l2 0.05).
        k: ``k`` of the ``"topk"`` metric.
        higher_is_better: direction of a callable metric (default True).
        check_non_finite: after the recorded samples pass, probe the candidate with NaN and +inf in one
            batch row of every floating-point input (see :func:`probe_non_finite`); a candidate whose outputs
            do not have eager's NaN/inf positions is guarded or rejected (``non_finite``). Costs one eager and
            one candidate call per probe.
        non_finite: what happens to a candidate that fails a probe: ``"guard"`` wraps it in a
            ``NonFiniteGuardBackend`` (calls whose floating-point inputs hold NaN/inf run the module's original
            code, so its weights stay in memory) and keeps it if the probes pass through the guard;
            ``"reject"`` rejects it.
    """

    tolerances: dict[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    check_non_finite: bool = True
    non_finite: str = NON_FINITE_GUARD
    metric: str | Callable[[Any, Any], float] | None = None
    threshold: float | None = None
    k: int = 1
    higher_is_better: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tolerances, dict):
            raise ConfigError(f"FidelityConfig.tolerances must be a dict of Tolerance, got "
                              f"{type(self.tolerances).__name__}.")
        for name, tol in self.tolerances.items():
            if not isinstance(tol, Tolerance):
                raise ConfigError(f"FidelityConfig.tolerances[{name!r}] must be a Tolerance, got {type(tol).__name__}.")
        check_bool(self.check_non_finite, "FidelityConfig.check_non_finite")
        check_choice(self.non_finite, "FidelityConfig.non_finite", NON_FINITE_MODES)
        self._task = None if self.metric is None else task_metric(self.metric, self.threshold, self.higher_is_better,
                                                                  self.k)
        if self.metric is None and (self.threshold is not None or self.higher_is_better is not None):
            raise ConfigError("FidelityConfig.threshold and higher_is_better apply to a metric; pass metric= too.")

    @property
    def task(self) -> TaskMetric | None:
        """The task metric with its threshold, or None in strict mode."""
        return self._task

    def tolerance_for(self, precision: str) -> Tolerance:
        """The tolerance of ``precision`` (``int8`` limits for precisions without an entry)."""
        return self.tolerances.get(precision) or self.tolerances.get("int8") or DEFAULT_TOLERANCES["int8"]


@dataclass
class FidelityResult:
    """Outcome of one comparison, with the worst measured errors over all output tensors.

    ``non_finite`` holds the non-finite probes (empty when they did not run). ``samples`` is the number of
    recorded calls judged and ``held_out_samples`` how many of them were held out from calibration (calls kept
    on disk that neither calibrated a candidate nor were among the in-memory samples); the strategy sets both.
    ``judged_with`` names the build whose check judged every call when this one confirmed it on one call (the
    same artifact, scheduled differently: :meth:`~torch_tweak.torch.backend.backend.Backend.outputs_key`).
    """

    passed: bool
    precision: str
    tolerance: str
    max_abs_error: float = 0.0
    max_rel_l2: float = 0.0
    min_cosine: float = 1.0
    message: str = ""
    non_finite: list[NonFiniteProbe] = field(default_factory=list)
    metric: str | None = None
    metric_value: float | None = None
    metric_higher_is_better: bool | None = None
    samples: int = 0
    held_out_samples: int = 0
    judged_with: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (non-finite numbers become strings)."""
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in asdict(self).items()}

    def merge(self, other: FidelityResult) -> FidelityResult:
        """Combine two results (worst errors, failure wins)."""
        return FidelityResult(
            passed=self.passed and other.passed,
            precision=self.precision,
            tolerance=self.tolerance,
            max_abs_error=max(self.max_abs_error, other.max_abs_error),
            max_rel_l2=max(self.max_rel_l2, other.max_rel_l2),
            min_cosine=min(self.min_cosine, other.min_cosine),
            message=self.message if not self.passed else other.message,
            non_finite=[*self.non_finite, *other.non_finite],
            metric=self.metric or other.metric,
            metric_value=_worse(self.metric_value, other.metric_value, self.metric_higher_is_better),
            metric_higher_is_better=self.metric_higher_is_better,
            samples=self.samples + other.samples,
            held_out_samples=self.held_out_samples + other.held_out_samples,
            judged_with=self.judged_with or other.judged_with,
        )

    def failed_probe(self) -> NonFiniteProbe | None:
        """The first non-finite probe that failed, if any."""
        return next((p for p in self.non_finite if p.status == PROBE_FAILED), None)

    def add_probes(self, probes: Sequence[NonFiniteProbe]) -> FidelityResult:
        """Record ``probes``; a failed probe fails this result with a what/why/fix message. Returns ``self``."""
        self.non_finite.extend(probes)
        failed = self.failed_probe()
        if failed is not None and self.passed:
            self.passed = False
            guard = "" if THROUGH_GUARD in failed.message else (
                ", keep it behind the non-finite guard with FidelityConfig(non_finite='guard')")
            self.message = (
                f"the candidate does not propagate {SHOWN.get(failed.value, failed.value)} like eager: "
                f"{failed.message}. Choose another backend{guard}, or, if the inputs are guaranteed to be finite, "
                "disable this probe with FidelityConfig(check_non_finite=False)"
            )
        return self


def check_calls(calls: Iterable[tuple[Any, Any, bool]], precision: str,
                config: FidelityConfig | None = None) -> FidelityResult | None:
    """Judge a candidate over recorded calls, given lazily as ``(eager outputs, candidate outputs, held out)``.

    Each call is checked with :func:`check_fidelity` and the first failure ends the check; a pooled task metric
    (top-k) is judged once, over all calls. The result counts the calls judged (``samples``) and the held-out
    ones among them. None when there is no call.
    """
    config = config or FidelityConfig()
    task = config.task
    pooled = task is not None and task.pooled
    result: FidelityResult | None = None
    total = rows = 0.0
    for expected, actual, held_out in calls:
        current = check_fidelity(expected, actual, precision, config, judge_task=not pooled)
        current.samples, current.held_out_samples = 1, int(held_out)
        if pooled and current.metric_value is not None and task is not None and task.weight is not None:
            weight = task.weight(expected)
            total, rows = total + current.metric_value * weight, rows + weight
        result = current if result is None else result.merge(current)
        if not current.passed:
            return result
    if result is not None and pooled and task is not None:
        result.metric_value = total / rows if rows else 1.0
        value, ok = task.judge([result.metric_value])
        if not ok:
            _fail(result, f"task metric {task.name} = {value:.5g} over {rows:g} rows of {result.samples} call(s), needs "
                          f"{task.describe()}")
    return result


def check_fidelity(expected: Any, actual: Any, precision: str, config: FidelityConfig | None = None,
                   judge_task: bool = True) -> FidelityResult:
    """Compare ``actual`` outputs with ``expected`` (eager) outputs for a candidate running ``precision``;
    ``judge_task=False`` measures a task metric without judging it (:func:`check_calls` pools it)."""
    config = config or FidelityConfig()
    tolerance, task = config.tolerance_for(precision), config.task
    result = FidelityResult(True, precision, tolerance.describe() if task is None else task.describe())
    exp_leaves, exp_spec = flatten(expected)
    act_leaves, act_spec = flatten(actual)
    if len(exp_leaves) != len(act_leaves):
        return _fail(result, f"expected {len(exp_leaves)} output tensor(s), got {len(act_leaves)}")
    if strip_classes(exp_spec) != strip_classes(act_spec):
        return _fail(result, "the output structure (containers or non-tensor values) differs from eager")
    for index, (exp, act) in enumerate(zip(exp_leaves, act_leaves)):
        message = _compare_tensor(exp, act, tolerance, precision, result, values=task is None)
        if message:
            return _fail(result, f"output tensor {index}: {message}")
    if task is not None:
        return _judge_task(task, expected, actual, result, judge_task)
    return result


def _judge_task(task: TaskMetric, expected: Any, actual: Any, result: FidelityResult, judge: bool) -> FidelityResult:
    """Judge one sample's outputs by the task metric (a user metric that raises fails the candidate); with
    ``judge=False`` only measure it."""
    result.metric, result.metric_higher_is_better = task.describe(), task.higher_is_better
    try:
        value = float(task.function(expected, actual))
    except Exception as exc:  # noqa: BLE001 - a user's metric failing is a finding about the candidate
        return _fail(result, f"the task metric {task.name} raised {type(exc).__name__}: {exc}")
    result.metric_value = value
    if not judge:
        return result
    worst, ok = task.judge([value])
    if not ok:
        return _fail(result, f"task metric {task.name} = {worst:.5g}, needs {task.describe()}")
    return result


def _worse(a: float | None, b: float | None, higher_is_better: bool | None) -> float | None:
    """The worse of two metric values (None: not measured)."""
    if a is None or b is None:
        return a if b is None else b
    return min(a, b) if higher_is_better in (True, None) else max(a, b)


def _fail(result: FidelityResult, message: str) -> FidelityResult:
    result.passed = False
    result.message = message
    return result


def _compare_tensor(exp: torch.Tensor, act: torch.Tensor, tol: Tolerance, precision: str, result: FidelityResult,
                    values: bool = True) -> str:
    """Why ``act`` does not match ``exp`` ("" if it does); ``values=False`` measures the value errors for the report
    but leaves judging them to a task metric."""
    if not isinstance(act, torch.Tensor):
        return f"expected a tensor, got {type(act).__name__}"
    if tuple(exp.shape) != tuple(act.shape):
        return f"shape {list(act.shape)} differs from eager {list(exp.shape)}"
    exp = exp.detach().cpu()
    act = act.detach().cpu()
    if not (exp.is_floating_point() or exp.is_complex()):
        mismatch = (act.to(exp.dtype) != exp).float().mean().item() if exp.numel() else 0.0
        allowed = 0.0 if precision == "fp32" else tol.max_mismatch_fraction
        if mismatch > allowed:
            return f"{mismatch:.2%} of the {exp.dtype} elements differ from eager (allowed {allowed:.2%})"
        return ""
    exp64, act64 = exp.to(torch.float64), act.to(torch.float64)
    finite = torch.isfinite(exp64)
    if not bool(torch.isfinite(act64[finite]).all()):
        bad = int((~torch.isfinite(act64[finite])).sum())
        return f"{bad} NaN/Inf value(s) where eager is finite"
    e, a = exp64[finite], act64[finite]
    if e.numel() == 0:
        return ""
    diff = (a - e).abs()
    max_abs = float(diff.max())
    norm_e = float(e.norm())
    rel_l2 = float((a - e).norm()) / norm_e if norm_e > 0 else (0.0 if max_abs == 0 else math.inf)
    norm_a = float(a.norm())
    cosine = float((a * e).sum()) / (norm_a * norm_e) if norm_a > 0 and norm_e > 0 else (1.0 if max_abs == 0 else 0.0)
    result.max_abs_error = max(result.max_abs_error, max_abs)
    result.max_rel_l2 = max(result.max_rel_l2, rel_l2)
    result.min_cosine = min(result.min_cosine, cosine)
    if not values:
        return ""
    if tol.atol is not None and tol.rtol is not None:
        bound = tol.atol + tol.rtol * e.abs()
        if bool((diff > bound).any()):
            count = int((diff > bound).sum())
            return f"{count} element(s) exceed atol={tol.atol:g}+rtol={tol.rtol:g}*|eager| (max abs error {max_abs:.3g})"
    if tol.max_rel_l2 is not None and rel_l2 > tol.max_rel_l2:
        return f"relative L2 error {rel_l2:.3g} > {tol.max_rel_l2:g}"
    if tol.min_cosine is not None and cosine < tol.min_cosine:
        return f"cosine similarity {cosine:.5f} < {tol.min_cosine:g}"
    return ""
