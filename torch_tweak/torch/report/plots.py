"""The plots of the HTML report, drawn with matplotlib (imported here only; no pyplot, no global state).

Each function takes a ``GraphReport`` and returns an SVG document as text, or None when the graph has
nothing to plot (e.g. candidates that were not measured).
"""

from __future__ import annotations

import io
import math
from typing import Any

from torch_tweak.torch.report.metrics import (
    baseline_of,
    fidelity_error,
    graph_metrics,
    runs,
    selected_run,
)

EAGER_COLOR = "#6b7280"
CHOSEN_COLOR = "#15803d"
OTHER_COLOR = "#2563eb"
FAILED_COLOR = "#dc2626"
_PALETTE = ("#2563eb", "#ea580c", "#9333ea", "#0891b2", "#ca8a04", "#db2777", "#4d7c0f", "#7c2d12")
_FLOOR = 1e-10  # errors of exactly zero are drawn at this height on log axes
_WIDTH_IN = 6.0


def _figure(height_in: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(_WIDTH_IN, height_in), dpi=100, layout="constrained")
    return fig, fig.subplots()


def _svg(fig: Any) -> str:
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "torch_tweak"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _label(candidate: Any) -> str:
    name = candidate.backend if len(candidate.backend) <= 40 else candidate.backend[:37] + "..."
    return f"{name} (eager)" if candidate.role == "baseline" else name


def colors(graph: Any) -> dict[int, str]:
    """A stable colour per candidate index: grey for eager, the palette for the others."""
    result, i = {}, 0
    for index, candidate in enumerate(graph.candidates):
        if candidate.role == "baseline":
            result[index] = EAGER_COLOR
        else:
            result[index] = _PALETTE[i % len(_PALETTE)]
            i += 1
    return result


def throughput_plot(graph: Any) -> str | None:
    """Throughput (samples/s) against batch size, one line per measured candidate; the chosen one is bold."""
    palette = colors(graph)
    series = [(i, c, runs(c.measurements)) for i, c in enumerate(graph.candidates)]
    series = [s for s in series if s[2]]
    if not series:
        return None
    fig, ax = _figure(3.4)
    for index, candidate, points in series:
        points = sorted(points, key=lambda r: r["batch_size"])
        chosen = candidate.status == "chosen"
        ax.plot([r["batch_size"] for r in points], [r["throughput"] for r in points], marker="o",
                color=palette[index], linewidth=3.0 if chosen else 1.5, label=_label(candidate) + (" *" if chosen else ""))
    sizes = sorted({r["batch_size"] for _, _, points in series for r in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples / s")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput vs batch size (* chosen)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _svg(fig)


def _latency_runs(graph: Any) -> tuple[list[tuple[int, Any, dict[str, Any]]], str]:
    measured = [(i, c) for i, c in enumerate(graph.candidates) if runs(c.measurements)]
    common = set.intersection(*({r["batch_size"] for r in runs(c.measurements)} for _, c in measured)) if measured else set()
    if common:
        size = max(common)
        picked = [(i, c, next(r for r in runs(c.measurements) if r["batch_size"] == size)) for i, c in measured]
        return picked, f"batch {size}"
    picked = [(i, c, selected_run(c.measurements)) for i, c in measured]
    return [(i, c, r) for i, c, r in picked if r is not None], "each candidate's selected batch size"


def latency_plot(graph: Any) -> str | None:
    """Box plots of the per-call latencies (raw times) of each candidate at a batch size they all reached."""
    picked, where = _latency_runs(graph)
    picked = [(i, c, r) for i, c, r in picked if isinstance(r.get("times_ms"), list) and r["times_ms"]]
    if not picked:
        return None
    palette = colors(graph)
    fig, ax = _figure(0.8 + 0.45 * len(picked))
    data = [[float(t) for t in r["times_ms"]] for _, _, r in reversed(picked)]
    labels = [_label(c) + (f" @{r['batch_size']}" if "each" in where else "") for _, c, r in reversed(picked)]
    boxes = ax.boxplot(data, orientation="horizontal", tick_labels=labels, patch_artist=True, widths=0.6,
                       showfliers=True, flierprops={"markersize": 2, "alpha": 0.4})
    for patch, (index, _, _) in zip(boxes["boxes"], reversed(picked)):
        patch.set_facecolor(palette[index])
        patch.set_alpha(0.6)
    low, high = min(min(d) for d in data), max(max(d) for d in data)
    if high > 20 * low:
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("latency per call (ms" + (", log scale)" if high > 20 * low else ")"))
    ax.set_title(f"Latency distribution at {where}")
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    return _svg(fig)


def speedup_plot(graph: Any) -> str | None:
    """Horizontal bars of each measured candidate's speed-up over eager on the strategy's metric."""
    if baseline_of(graph) is None:
        return None
    rows = [(c, m) for c, m in zip(graph.candidates, graph_metrics(graph)) if m.speedup is not None]
    if not rows:
        return None
    fig, ax = _figure(0.9 + 0.4 * len(rows))
    rows = list(reversed(rows))
    values = [m.speedup for _, m in rows]
    bar_colors = [CHOSEN_COLOR if c.status == "chosen" else EAGER_COLOR if c.role == "baseline" else OTHER_COLOR
                  for c, _ in rows]
    ax.barh([_label(c) for c, _ in rows], values, color=bar_colors, height=0.6)
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:.2f}x", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xlim(0, max(values) * 1.25)
    metric = next((m.metric for _, m in rows if m.metric), None) or "throughput"
    ax.set_xlabel(f"x eager {metric} (green: chosen)")
    ax.set_title("Speed-up vs eager")
    ax.tick_params(axis="y", labelsize=8)
    return _svg(fig)


def fidelity_plot(graph: Any) -> str | None:
    """Max absolute and relative L2 errors against eager, per checked candidate (log scale; red = rejected)."""
    rows = [c for c in graph.candidates if isinstance(c.fidelity, dict)]
    if not rows:
        return None
    fig, ax = _figure(0.9 + 0.45 * len(rows))
    rows = list(reversed(rows))
    height = 0.38
    for y, candidate in enumerate(rows):
        failed = candidate.status == "rejected"
        absolute = fidelity_error(candidate)
        relative = candidate.fidelity.get("max_rel_l2")
        relative = relative if isinstance(relative, (int, float)) and math.isfinite(relative) else None
        for offset, value, alpha in ((height / 2, absolute, 1.0), (-height / 2, relative, 0.5)):
            shown = max(value, _FLOOR) if value is not None else _FLOOR
            ax.barh(y + offset, shown, height=height, color=FAILED_COLOR if failed else CHOSEN_COLOR, alpha=alpha,
                    left=_FLOOR / 10)
            text = "n/a" if value is None else f"{value:.1e}"
            ax.text(shown, y + offset, f" {text}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [_label(c) + (" (rejected)" if c.status == "rejected" else "") for c in rows])
    ax.set_xscale("log")
    ax.set_xlim(_FLOOR / 10, None)
    ax.margins(x=0.25)
    ax.set_xlabel("error vs eager (dark: max abs, light: rel. L2)")
    ax.set_title("Fidelity error")
    ax.tick_params(axis="y", labelsize=8)
    return _svg(fig)


PLOTS = (
    ("Throughput vs batch size", throughput_plot),
    ("Latency distribution", latency_plot),
    ("Speed-up vs eager", speedup_plot),
    ("Fidelity error", fidelity_plot),
)
