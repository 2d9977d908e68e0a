"""Non-finite probes: does a candidate keep invalid input invalid, as eager does?

Recorded samples are finite, so they cannot show whether a candidate turns invalid input into plausible
output (OpenVINO's CPU plugin maps NaN to a finite value in ReLU, Clamp, Maximum, MaxPool and ReduceMax).
:func:`probe_non_finite` writes NaN, then +inf, into one batch row of every floating-point input of one
recorded sample, runs the module's own forward and the candidate on it, and compares the NaN and inf
positions of every floating-point output. :mod:`torch_tweak.torch.fidelity` runs it after the recorded
samples pass.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torch_tweak.torch.backend._compile_helpers import clone_sample
from torch_tweak.torch.module.forward import original_forward
from torch_tweak.torch.module.recording import RecordedSample
from torch_tweak.torch.module.released import has_values
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, flatten, flatten_sample

logger = logging.getLogger(__name__)

PROBE_PASSED = "passed"
PROBE_FAILED = "failed"
PROBE_SKIPPED = "skipped"
PROBE_GUARDED = "guarded"
THROUGH_GUARD = "through the non-finite guard"
PROBE_VALUES: tuple[tuple[str, float], ...] = (("nan", math.nan), ("inf", math.inf))
SHOWN = {"nan": "NaN", "inf": "+inf"}


@dataclass
class NonFiniteProbe:
    """Outcome of one non-finite probe.

    Attributes:
        value: ``"nan"`` or ``"inf"``, the value written into the inputs.
        status: ``passed``, ``failed``, ``skipped`` or ``guarded`` (failed on the candidate, passed through
            the non-finite guard; message, output and count are the candidate's failure).
        message: what was poisoned, and why the probe failed or was skipped.
        output: locator of the first output whose NaN/inf positions differ from eager (failed probes).
        mismatched: how many elements of that output differ.
    """

    value: str
    status: str
    message: str = ""
    output: str | None = None
    mismatched: int = 0


# non-finite probes ---------------------------------------------------------------------------------


def probe_sample(samples: Sequence[RecordedSample]) -> Sample | None:
    """The recorded call to probe: the smallest batch of at least 2 rows (so clean rows stay), else the first."""
    if not samples:
        return None
    batched = [s for s in samples if (s.batch_size or 0) >= 2]
    return min(batched, key=lambda s: s.batch_size or 0).sample if batched else samples[0].sample


def poison_sample(sample: Sample, graph_spec: GraphSpec, value: float) -> tuple[Sample | None, str]:
    """A copy of ``sample`` with ``value`` in one batch row of every floating-point input tensor.

    The row is row 1 along the input's batch axis (axis 0 when the graph spec has none); a tensor with a
    single row gets ``value`` in one element. Returns ``(None, reason)`` when no input can be poisoned,
    else ``(poisoned, description)``. ``sample`` itself is never modified.
    """
    poisoned = clone_sample(sample)
    leaves, _ = flatten_sample(*poisoned)
    specs = graph_spec.inputs if len(graph_spec.inputs) == len(leaves) else [None] * len(leaves)
    shown = "NaN" if math.isnan(value) else f"{value:+}"
    rows: list[str] = []
    elements: list[str] = []
    for index, (leaf, spec) in enumerate(zip(leaves, specs, strict=True)):
        if not leaf.is_floating_point() or leaf.numel() == 0:
            continue
        locator = spec.locator if spec is not None else f"input tensor {index}"
        axis = next(iter(spec.batch_multipliers), 0) if spec is not None else 0
        try:
            with torch.no_grad():
                if leaf.dim() > axis and leaf.shape[axis] >= 2:
                    leaf.select(axis, 1).fill_(value)
                    rows.append(f"{locator} (axis {axis})")
                else:
                    leaf[(0,) * leaf.dim()] = value
                    elements.append(locator)
        except RuntimeError as exc:  # e.g. an expanded tensor whose elements share memory
            return None, f"{locator} cannot be written to ({exc})"
    if not rows and not elements:
        return None, "the graph has no floating-point input tensor"
    parts = ([f"row 1 of {', '.join(rows)}"] if rows else []) + ([f"one element of {', '.join(elements)}"]
                                                                   if elements else [])
    return poisoned, f"{shown} in {' and '.join(parts)}"


def compare_non_finite(expected: Any, actual: Any, graph_spec: GraphSpec | None = None) -> tuple[str, str | None, int]:
    """Compare the NaN and inf positions of every floating-point output of ``actual`` with ``expected``.

    Returns ``(message, output locator, differing elements)``; the message is empty when they match.
    """
    exp_leaves, exp_spec = flatten(expected)
    act_leaves, act_spec = flatten(actual)
    if len(exp_leaves) != len(act_leaves) or strip_classes(exp_spec) != strip_classes(act_spec):
        return "the output structure differs from eager", None, 0
    outputs = graph_spec.outputs if graph_spec is not None and len(graph_spec.outputs) == len(exp_leaves) else None
    for index, (exp, act) in enumerate(zip(exp_leaves, act_leaves, strict=True)):
        if not exp.is_floating_point():
            continue
        locator = outputs[index].locator if outputs is not None else f"output tensor {index}"
        if not isinstance(act, torch.Tensor) or tuple(act.shape) != tuple(exp.shape):
            return f"{locator} has another shape or type than eager's", locator, 0
        exp, act = exp.detach().cpu(), act.detach().cpu()
        exp_nan, exp_inf = torch.isnan(exp), torch.isinf(exp)
        act_nan, act_inf = (torch.isnan(act), torch.isinf(act)) if act.is_floating_point() else (
            torch.zeros_like(exp_nan), torch.zeros_like(exp_inf))
        differ = int(((exp_nan != act_nan) | (exp_inf != act_inf)).sum())
        if differ:
            exp_bad, act_bad = exp_nan | exp_inf, act_nan | act_inf
            hidden, spurious = int((exp_bad & ~act_bad).sum()), int((act_bad & ~exp_bad).sum())
            why = [f"{hidden} of them are finite where eager's are not, so invalid input comes back as plausible "
                   "output"] if hidden else []
            why += [f"{spurious} of them are NaN/inf where eager's are finite"] if spurious else []
            return (
                f"{differ} of the {exp.numel()} elements of {locator} differ in NaN/inf from eager (eager: "
                f"{int(exp_nan.sum())} NaN, {int(exp_inf.sum())} inf; candidate: {int(act_nan.sum())} NaN, "
                f"{int(act_inf.sum())} inf); {'; '.join(why) or 'the candidate has inf where eager has NaN or back'}",
                locator,
                differ,
            )
    return "", None, 0


def probe_non_finite(
    module: nn.Module, candidate: Callable[..., Any], sample: Sample, graph_spec: GraphSpec
) -> list[NonFiniteProbe]:
    """Run the NaN and +inf probes of ``candidate`` against ``module``'s own forward on a copy of ``sample``.

    A probe is skipped when no input is floating-point or when eager itself raises on the poisoned input,
    and fails when the candidate raises where eager does not, or when the NaN/inf positions of a
    floating-point output differ. The module's floating-point buffers are restored after every run, so a
    module that updates state in forward (e.g. BatchNorm in training mode) keeps no NaN.
    """
    return [_probe(module, candidate, sample, graph_spec, name, value) for name, value in PROBE_VALUES]


def _probe(module: nn.Module, candidate: Callable[..., Any], sample: Sample, graph_spec: GraphSpec, name: str,
           value: float) -> NonFiniteProbe:
    poisoned, where = poison_sample(sample, graph_spec, value)
    if poisoned is None:
        return NonFiniteProbe(name, PROBE_SKIPPED, f"nothing to probe: {where}")
    try:
        with _buffers_restored(module), torch.no_grad():
            args, kwargs = clone_sample(poisoned)
            expected = original_forward(module)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - eager rejecting invalid input is a valid outcome, not a failure
        logger.info("Non-finite probe skipped: eager raised on %s: %s", where, exc)
        return NonFiniteProbe(name, PROBE_SKIPPED, f"eager raised {type(exc).__name__}: {_first_line(exc)} with {where}")
    try:
        with _buffers_restored(module), torch.no_grad():
            args, kwargs = clone_sample(poisoned)
            actual = candidate(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the candidate's error is the probe's result
        return NonFiniteProbe(name, PROBE_FAILED, f"with {where} the candidate raised {type(exc).__name__}: "
                                                  f"{_first_line(exc)}, where eager returned outputs")
    message, output, differ = compare_non_finite(expected, actual, graph_spec)
    if message:
        return NonFiniteProbe(name, PROBE_FAILED, f"with {where}, {message}", output, differ)
    return NonFiniteProbe(name, PROBE_PASSED, f"{where}: same NaN/inf positions as eager")


def guarded_probes(bare: Sequence[NonFiniteProbe], through: Sequence[NonFiniteProbe]) -> list[NonFiniteProbe]:
    """Combine a candidate's probes with the same probes run again through the non-finite guard.

    A probe the candidate failed and the guard passed becomes ``guarded`` and keeps the candidate's failure;
    a probe that fails through the guard is ``failed`` with both outcomes; the others stay as they were.
    """
    merged: list[NonFiniteProbe] = []
    for before, after in zip(bare, through, strict=True):
        if after.status == PROBE_FAILED:
            first = f"{before.message}; " if before.status == PROBE_FAILED else ""
            merged.append(NonFiniteProbe(before.value, PROBE_FAILED, f"{first}{THROUGH_GUARD}: {after.message}",
                                         after.output, after.mismatched))
        elif before.status == PROBE_FAILED:
            merged.append(NonFiniteProbe(before.value, PROBE_GUARDED, f"{before.message}; {THROUGH_GUARD}, which "
                                         "runs such calls with the module's original code, the NaN/inf positions "
                                         "match eager's", before.output, before.mismatched))
        else:
            merged.append(before)
    return merged


def judged_probe_outcome(fidelity: Any) -> tuple[bool, str] | None:
    """What a judged build's probes decided, from its report row's ``fidelity`` dict: ``(True, reason)`` when the
    build serves behind the non-finite guard (``reason``: the first guarded probe's message), ``(False, "")``
    when every probe that ran passed or was skipped, None when the row holds no probe outcome to reuse.

    A rebuild of the same artifact (an IR, an ONNX file, a warm compiler cache) computes what the judged build
    computed, so it is confirmed on a recorded call and keeps this decision instead of probing again. The dict
    may come from the tuning cache on disk: its values are only read as text and compared, never called.
    """
    probes = fidelity.get("non_finite") if isinstance(fidelity, dict) else None
    if not isinstance(probes, list) or not probes or not all(isinstance(p, dict) for p in probes):
        return None
    statuses = [p.get("status") for p in probes]
    if PROBE_GUARDED in statuses:
        message = next(str(p.get("message", "")) for p in probes if p.get("status") == PROBE_GUARDED)
        return True, message.split(f"; {THROUGH_GUARD}")[0]  # the candidate's own failure, as the guard states it
    return (False, "") if all(s in (PROBE_PASSED, PROBE_SKIPPED) for s in statuses) else None


@contextlib.contextmanager
def _buffers_restored(module: nn.Module) -> Iterator[None]:
    """Put ``module``'s floating-point buffers back to their current values when the block ends."""
    saved = [(b, b.detach().clone()) for b in module.buffers() if b.is_floating_point() and has_values(b)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else repr(exc))[:300]


def strip_classes(spec: Any) -> Any:
    """A spec with container classes replaced by their names (tolerates equal types from reloaded modules)."""
    if isinstance(spec, tuple):
        return tuple(strip_classes(s) for s in spec)
    if isinstance(spec, type):
        return spec.__qualname__
    return spec
