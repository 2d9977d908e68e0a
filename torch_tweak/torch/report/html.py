"""The HTML tuning report: ONE self-contained file (styles inline, plots as data-URI SVG images, no scripts).

Nothing in the page refers to the network, so it opens the same offline, attached to a mail or in a
notebook (``TuningReport._repr_html_``). matplotlib is needed (``pip install torch-tweak[report]``).
"""

from __future__ import annotations

import base64
import html
import logging
from typing import Any

from torch_tweak.errors import ConfigError
from torch_tweak.torch.report.environment import describe_environment
from torch_tweak.torch.report.metrics import (
    format_fidelity,
    format_ms,
    format_speedup,
    format_throughput,
    graph_metrics,
)
from torch_tweak.torch.report.status import ModuleStatus

logger = logging.getLogger(__name__)

_STYLE = """
.tt-report{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#111827;
  max-width:1180px;margin:0 auto;padding:16px;line-height:1.4}
.tt-report h1{font-size:1.6em;margin:0 0 4px}.tt-report h2{border-bottom:2px solid #e5e7eb;padding-bottom:4px;margin-top:32px}
.tt-report h3{margin:20px 0 6px}.tt-report .muted{color:#6b7280;font-size:.9em}
.tt-report table{border-collapse:collapse;margin:8px 0;font-size:.85em;width:100%}
.tt-report th,.tt-report td{border:1px solid #e5e7eb;padding:3px 6px;text-align:left;vertical-align:top}
.tt-report th,.tt-report td.num{white-space:nowrap}.tt-report td.muted,.tt-report td.error{overflow-wrap:anywhere}
.tt-report td.error{min-width:240px}.tt-report td.name{overflow-wrap:anywhere}
.tt-report th{background:#f3f4f6}.tt-report td.num{text-align:right;font-variant-numeric:tabular-nums}
.tt-report tr.chosen td{background:#ecfdf5;font-weight:600}
.tt-report .status-rejected,.tt-report .status-build_failed,.tt-report .status-infer_failed,
.tt-report .status-timeout,.tt-report .status-crashed,.tt-report .status-passthrough{color:#b91c1c}
.tt-report .status-skipped,.tt-report .status-screened_out{color:#6b7280}
.tt-report .cards{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.tt-report .card{border:1px solid #e5e7eb;border-radius:8px;padding:8px 14px;min-width:130px;background:#f9fafb}
.tt-report .card b{display:block;font-size:1.4em}
.tt-report .plots{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:12px}
.tt-report figure{margin:0;border:1px solid #e5e7eb;border-radius:6px;padding:6px;background:#fff}
.tt-report figure img{width:100%;height:auto}.tt-report figcaption{font-size:.8em;color:#6b7280}
.tt-report .error{font-family:ui-monospace,monospace;font-size:.8em;color:#b91c1c;word-break:break-all}
.tt-report dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;font-size:.85em}
.tt-report dt{font-weight:600}.tt-report dd{margin:0}
"""

# The page may load nothing: styles are inline and images are data URIs.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

_CANDIDATE_HEADERS = ["candidate", "status", "precision", "max abs err", "throughput", "p50 ms", "p99 ms",
                      "vs eager", "build s", "error"]


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _image(svg: str, title: str) -> str:
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return (f'<figure class="plot"><img alt="{_e(title)}" src="data:image/svg+xml;base64,{data}">'
            f"<figcaption>{_e(title)}</figcaption></figure>")


def _chosen_metrics(graph: Any) -> tuple[Any, Any]:
    for candidate, metrics in zip(graph.candidates, graph_metrics(graph)):
        if candidate.status == "chosen":
            return candidate, metrics
    return None, None


def _summary(report: Any) -> str:
    graphs = [g for m in report.modules for g in m.graphs]
    tried = sum(len(g.candidates) for g in graphs)
    speedups = [m.speedup for g in graphs for c, m in zip(g.candidates, graph_metrics(g))
                if c.status == "chosen" and m.speedup is not None]
    tuned = sum(1 for m in report.modules if m.status == ModuleStatus.TUNED)
    cards = [("modules tuned", f"{tuned} / {len(report.modules)}"), ("graphs", str(len(graphs))),
             ("candidates tried", str(tried)),
             ("best speed-up vs eager", format_speedup(max(speedups)) if speedups else "n/a"),
             ("tuning time", f"{report.duration_s:.1f} s")]
    out = ['<h2 id="summary">Summary</h2><div class="cards">']
    out += [f'<div class="card"><b>{_e(value)}</b><span class="muted">{_e(label)}</span></div>' for label, value in cards]
    out.append("</div><table><tr><th>module</th><th>status</th><th>graph</th><th>chosen</th><th>throughput</th>"
               "<th>p50 ms</th><th>p99 ms</th><th>vs eager</th><th>reason</th></tr>")
    for module in report.modules:
        if not module.graphs:
            out.append(f"<tr><td>{_e(module.name)}</td><td class='status-{_e(module.status)}'>{_e(module.status)}"
                       f"</td><td colspan='7' class='error'>{_e(module.error)}</td></tr>")
        for graph in module.graphs:
            _, m = _chosen_metrics(graph)
            cells = [format_throughput(m), format_ms(m.p50_ms), format_ms(m.p99_ms), format_speedup(m.speedup)] \
                if m is not None else ["", "", "", ""]
            out.append(f"<tr><td><a href='#{_anchor(module.name)}'>{_e(module.name)}</a></td>"
                       f"<td class='status-{_e(module.status)}'>{_e(module.status)}</td><td>{_e(graph.name)}</td>"
                       f"<td>{_e(graph.chosen or '')}</td>" + "".join(f"<td class='num'>{_e(c)}</td>" for c in cells)
                       + f"<td class='muted'>{_e(_clip(graph.reason or module.error or ''))}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _clip(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _environment(report: Any) -> str:
    env = report.environment if isinstance(report.environment, dict) else {}
    if not env:
        return ""
    rows = "".join(f"<dt>{_e(label)}</dt><dd>{_e(value)}</dd>" for label, value in describe_environment(env))
    return f'<h2 id="environment">Environment</h2><dl>{rows}</dl>'


def _anchor(name: str) -> str:
    return "module-" + "".join(ch if ch.isalnum() else "-" for ch in name)


def _candidate_table(graph: Any) -> str:
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in _CANDIDATE_HEADERS) + "</tr>"]
    for candidate, m in zip(graph.candidates, graph_metrics(graph)):
        name = candidate.backend + (" (eager baseline)" if candidate.role == "baseline" else "")
        name += " (reused from an earlier run)" if candidate.reused else ""
        build = f"{candidate.build_time_s:.2f}" if isinstance(candidate.build_time_s, (int, float)) else ""
        numbers = [format_fidelity(candidate), format_throughput(m), format_ms(m.p50_ms), format_ms(m.p99_ms),
                   format_speedup(m.speedup), build]
        cls = " class='chosen'" if candidate.status == "chosen" else ""
        out.append(f"<tr{cls}><td class='name'>{_e(name)}</td><td class='status-{_e(candidate.status)}'>{_e(candidate.status)}</td>"
                   f"<td>{_e(candidate.precision or '')}</td>" + "".join(f"<td class='num'>{_e(n)}</td>" for n in numbers)
                   + f"<td class='error'>{_e(candidate.error or '')}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _graph_section(module: Any, graph: Any) -> str:
    from torch_tweak.torch.report.plots import PLOTS

    out = [f"<h3>{_e(module.name)} &middot; graph {_e(graph.name)}</h3>"]
    if graph.strategy:
        out.append(f"<div class='muted'>strategy: {_e(graph.strategy)}</div>")
    if graph.chosen:
        out.append(f"<p><b>chosen:</b> {_e(graph.chosen)} &mdash; {_e(graph.reason or '')}</p>")
    if graph.candidates:
        out.append(_candidate_table(graph))
    figures = []
    for title, plot in PLOTS:
        try:
            svg = plot(graph)
        except Exception as exc:  # noqa: BLE001 - one bad plot must not lose the whole report
            logger.warning("Could not draw %r for %s graph %s: %s", title, module.name, graph.name, exc)
            continue
        if svg is not None:
            figures.append(_image(svg, f"{title} ({module.name}, graph {graph.name})"))
    if figures:
        out.append("<div class='plots'>" + "".join(figures) + "</div>")
    elif graph.candidates:
        out.append("<p class='muted'>No measurements for this graph (its strategy does not measure).</p>")
    return "".join(out)


def _module_section(module: Any) -> str:
    out = [f"<h2 id='{_anchor(module.name)}'>Module {_e(module.name)} "
           f"<span class='muted status-{_e(module.status)}'>({_e(module.status)})</span></h2>"]
    if module.error:
        out.append(f"<p class='error'>{_e(module.error)}</p>")
    out += [_graph_section(module, graph) for graph in module.graphs]
    return "".join(out)


def render_html(report: Any, full_page: bool = True) -> str:
    """The report as HTML: a whole document, or (``full_page=False``) a fragment for notebooks."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError("The HTML report needs matplotlib: pip install 'torch-tweak[report]' (or matplotlib).") from exc
    created = f", {report.created}" if getattr(report, "created", None) else ""
    kind = "dry run, " if report.dry_run else ""
    body = [
        "<div class='tt-report'>",
        "<h1>torch_tweak tuning report</h1>",
        f"<div class='muted'>{_e(kind)}device {_e(report.device)}, batch sizes {_e(report.batch_sizes)}, "
        f"{report.duration_s:.1f} s{_e(created)}</div>",
        _summary(report),
        _environment(report),
        *(_module_section(module) for module in report.modules),
        "</div>",
    ]
    fragment = f"<style>{_STYLE}</style>" + "\n".join(body)
    if not full_page:
        return fragment
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            "<title>torch_tweak tuning report</title></head>\n<body>" + fragment + "</body></html>\n")
