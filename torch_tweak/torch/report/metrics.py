"""Numbers derived from a candidate's ``measurements`` (the sweep dict written by the measuring strategies).

A measured candidate's ``measurements`` is ``SweepResult.to_dict()`` plus ``selection``: the run the
strategy judged it by (``metric``, ``batch_size``, ``throughput``, ``p50_ms``, ``p99_ms``). Everything
here reads those dicts defensively, since reports may come from JSON files written by other versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LATENCY_METRIC = "p50 latency"


@dataclass
class CandidateMetrics:
    """The headline numbers of one candidate (None where it was not measured).

    Attributes:
        throughput: samples/s of the run the strategy judged it by (or its best run).
        batch_size: the batch size of that run.
        p50_ms: median latency of that run.
        p99_ms: 99th percentile latency of that run.
        speedup: how many times better than the eager baseline on the strategy's metric.
        metric: the strategy's metric (``throughput``, ``p50 latency``...).
    """

    throughput: float | None = None
    batch_size: int | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    speedup: float | None = None
    metric: str | None = None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def runs(measurements: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The per-batch-size runs of a sweep dict (only well-formed ones)."""
    if not isinstance(measurements, dict) or not isinstance(measurements.get("runs"), list):
        return []
    return [r for r in measurements["runs"] if isinstance(r, dict) and _number(r.get("throughput")) is not None
            and isinstance(r.get("batch_size"), int)]


def selected_run(measurements: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run the strategy judged the candidate by; its best-throughput run when there is no selection."""
    available = runs(measurements)
    if not available:
        return None
    selection = measurements.get("selection") if isinstance(measurements, dict) else None
    if isinstance(selection, dict):
        match = next((r for r in available if r["batch_size"] == selection.get("batch_size")), None)
        if match is not None:
            return match
    return max(available, key=lambda r: r["throughput"])


def metrics_of(candidate: Any) -> CandidateMetrics:
    """Throughput, batch size and latencies of a ``CandidateReport`` (speed-up not filled in)."""
    run = selected_run(candidate.measurements)
    if run is None:
        return CandidateMetrics()
    selection = candidate.measurements.get("selection")
    metric = selection.get("metric") if isinstance(selection, dict) else None
    return CandidateMetrics(_number(run.get("throughput")), run.get("batch_size"), _number(run.get("p50_ms")),
                            _number(run.get("p99_ms")), None, metric if isinstance(metric, str) else None)


def baseline_of(graph: Any) -> Any | None:
    """The graph's eager baseline row (role ``baseline``), if any."""
    return next((c for c in graph.candidates if getattr(c, "role", None) == "baseline"), None)


def graph_metrics(graph: Any) -> list[CandidateMetrics]:
    """Metrics of every candidate of a ``GraphReport``, in order, with speed-up vs the eager baseline."""
    result = [metrics_of(c) for c in graph.candidates]
    baseline = baseline_of(graph)
    if baseline is None:
        return result
    eager = result[graph.candidates.index(baseline)]
    for m in result:
        m.speedup = speedup(m, eager)
    return result


def speedup(candidate: CandidateMetrics, eager: CandidateMetrics) -> float | None:
    """``candidate`` over ``eager`` on the strategy's metric (latency ratio for latency strategies)."""
    if candidate.metric == LATENCY_METRIC or eager.metric == LATENCY_METRIC:
        if candidate.p50_ms and eager.p50_ms:
            return eager.p50_ms / candidate.p50_ms
        return None
    if candidate.throughput and eager.throughput:
        return candidate.throughput / eager.throughput
    return None


def fidelity_error(candidate: Any) -> float | None:
    """The candidate's max absolute error against eager (None when unchecked or non-finite)."""
    fid = candidate.fidelity
    if not isinstance(fid, dict):
        return None
    return _number(fid.get("max_abs_error"))


def format_fidelity(candidate: Any) -> str:
    """``1.2e-06`` / ``nan`` / empty for an unchecked candidate; with a task metric also its worst value and
    bound, how many of the judged calls were held out from calibration when some were, e.g.
    ``3.1e-02 (cosine 0.9987 vs >= 0.99; 32 of 36 calls held out)``, and the build that judged every call for
    one confirmed on a call, e.g. ``4.8e-06 (1 call like OpenVINOBackend())``."""
    fid = candidate.fidelity
    if not isinstance(fid, dict) or "max_abs_error" not in fid:
        return ""
    value = fid["max_abs_error"]
    number = _number(value)
    text = f"{number:.1e}" if number is not None else str(value)
    metric, measured = fid.get("metric"), _number(fid.get("metric_value"))
    notes = []
    if isinstance(metric, str) and measured is not None:
        name, _, bound = metric.partition(" ")
        notes.append(f"{name} {measured:.4g} vs {bound}")
    held_out, samples = fid.get("held_out_samples"), fid.get("samples")
    if isinstance(held_out, int) and held_out > 0:
        notes.append(f"{held_out} of {samples} calls held out")
    if isinstance(fid.get("judged_with"), str):
        notes.append(f"{samples} call like {fid['judged_with']}")
    return f"{text} ({'; '.join(notes)})" if notes else text


def format_throughput(m: CandidateMetrics) -> str:
    """``1234/s @8`` (samples per second at batch size)."""
    if m.throughput is None:
        return ""
    value = f"{m.throughput:,.0f}" if m.throughput >= 100 else f"{m.throughput:.3g}"
    return f"{value}/s @{m.batch_size}"


def format_ms(value: float | None) -> str:
    """Milliseconds with three significant digits."""
    if value is None:
        return ""
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def format_speedup(value: float | None) -> str:
    """``1.85x``."""
    return "" if value is None else f"{value:.2f}x"
