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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from torch_tweak.errors import ConfigError
from torch_tweak.torch.module.tree import flatten


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


@dataclass
class FidelityConfig:
    """Tolerances per executed precision; unknown precisions use the loosest (``int8``) limits."""

    tolerances: dict[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))

    def __post_init__(self) -> None:
        for name, tol in self.tolerances.items():
            if not isinstance(tol, Tolerance):
                raise ConfigError(f"FidelityConfig.tolerances[{name!r}] must be a Tolerance, got {type(tol).__name__}.")

    def tolerance_for(self, precision: str) -> Tolerance:
        """The tolerance of ``precision`` (``int8`` limits for precisions without an entry)."""
        return self.tolerances.get(precision) or self.tolerances.get("int8") or DEFAULT_TOLERANCES["int8"]


@dataclass
class FidelityResult:
    """Outcome of one comparison, with the worst measured errors over all output tensors."""

    passed: bool
    precision: str
    tolerance: str
    max_abs_error: float = 0.0
    max_rel_l2: float = 0.0
    min_cosine: float = 1.0
    message: str = ""

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
        )


def check_fidelity(expected: Any, actual: Any, precision: str, config: FidelityConfig | None = None) -> FidelityResult:
    """Compare ``actual`` outputs with ``expected`` (eager) outputs for a candidate running ``precision``."""
    tolerance = (config or FidelityConfig()).tolerance_for(precision)
    result = FidelityResult(True, precision, tolerance.describe())
    exp_leaves, exp_spec = flatten(expected)
    act_leaves, act_spec = flatten(actual)
    if len(exp_leaves) != len(act_leaves):
        return _fail(result, f"expected {len(exp_leaves)} output tensor(s), got {len(act_leaves)}")
    if _strip(exp_spec) != _strip(act_spec):
        return _fail(result, "the output structure (containers or non-tensor values) differs from eager")
    for index, (exp, act) in enumerate(zip(exp_leaves, act_leaves)):
        message = _compare_tensor(exp, act, tolerance, precision, result)
        if message:
            return _fail(result, f"output tensor {index}: {message}")
    return result


def _strip(spec: Any) -> Any:
    """A spec with container classes replaced by their names (tolerates equal types from reloaded modules)."""
    if isinstance(spec, tuple):
        return tuple(_strip(s) for s in spec)
    if isinstance(spec, type):
        return spec.__qualname__
    return spec


def _fail(result: FidelityResult, message: str) -> FidelityResult:
    result.passed = False
    result.message = message
    return result


def _compare_tensor(exp: torch.Tensor, act: torch.Tensor, tol: Tolerance, precision: str, result: FidelityResult) -> str:
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
