"""Turn the runners' records into the result JSON (rows with ratios) and the Markdown tables."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import time
from typing import Any

from peers.systems import BY_KEY, SYSTEMS, Mode
from peers.workloads import WORKLOADS


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(mode: Mode, wall_s: float, command: str) -> dict[str, Any]:
    """Machine, versions and the run's settings."""
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": cpu, "cpus": os.cpu_count(), "mode": mode.name,
            "command": command, "wall_s": wall_s, "load_avg_end": os.getloadavg(), "python": platform.python_version(),
            "versions": {p: _version(p) for p in ("torch", "openvino", "torchao", "transformers", "torch-tweak")},
            "peer_versions": {"aitune": "0.6.0", "triton-model-navigator": "0.14.0"},
            "settings": {"reps": mode.reps, "rep_time_s": mode.rep_time, "load_reps": mode.load_reps,
                         "batches": mode.batches, "tune_batches": mode.tune_batches,
                         "fresh_compiler_cache": mode.fresh_compiler_cache, "skipped": mode.skipped}}


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)} if values else None


def _row(workload: str, key: str, entry: dict[str, Any], batch: int) -> dict[str, Any]:
    record = entry["tune"]
    measured = record.get("batches", {}).get(str(batch), {})
    loads = [r for r in entry.get("loads", []) if r.get("ok")]
    if key == "tt_loaded":
        loads = [record] if record.get("ok") else []
    return {"workload": workload, "batch": batch, "system": key, "title": BY_KEY[key].title,
            "ok": bool(record.get("ok")) and "throughput" in measured, "error": record.get("error"),
            "selected": record.get("selected"), "throughput": measured.get("throughput"),
            "p50_ms": measured.get("p50_ms"), "p99_ms": measured.get("p99_ms"),
            "fidelity": measured.get("fidelity"), "tune_s": record.get("tune_s") if key != "tt_loaded" else None,
            "first_output_s": _spread([r["first_output_s"] for r in loads if "first_output_s" in r]),
            "load_s": _spread([r["load_s"] for r in loads if "load_s" in r]),
            "maxrss_tune_mb": record.get("maxrss_mb") if key != "tt_loaded" else None,
            "maxrss_serve_mb": _spread([r["maxrss_mb"] for r in loads if "maxrss_mb" in r]),
            "load_avg": [record.get("load_avg_start"), record.get("load_avg_end")]}


FAITHFUL = 1e-2  # max rel err below which a peer counts as "faithful" in the summary lines
METRICS = (("throughput", max, lambda value, ref: value / ref), ("p50_ms", min, lambda value, ref: ref / value),
           ("p99_ms", min, lambda value, ref: ref / value))


def _ratios(row: dict[str, Any], eager: dict[str, Any] | None, peers: list[dict[str, Any]]) -> None:
    """Speed-ups (higher is better) of ``row`` over eager and over the best peer, per metric."""
    row["vs_eager"], row["vs_best_peer"], row["best_peer"] = {}, {}, {}
    for metric, pick, speedup in METRICS:
        value = row[metric]["median"]
        if eager:
            row["vs_eager"][metric] = speedup(value, eager[metric]["median"])
        best = pick(peers, key=lambda r, m=metric: r[m]["median"], default=None)
        if best:
            row["vs_best_peer"][metric] = speedup(value, best[metric]["median"])
            row["best_peer"][metric] = best["system"]


def assemble(meta: dict[str, Any], mode: Mode, dispatch: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """Rows per workload, batch size and system with speed-ups over eager and over the best peer."""
    rows = []
    for workload, entries in results.items():
        for batch in mode.batches[workload]:
            batch_rows = [_row(workload, s.key, entries[s.key], batch) for s in SYSTEMS if s.key in entries]
            eager = next((r for r in batch_rows if r["system"] == "eager" and r["ok"]), None)
            peers = [r for r in batch_rows if r["ok"] and BY_KEY[r["system"]].peer]
            for row in batch_rows:
                if row["ok"]:
                    _ratios(row, eager, peers)
            rows.extend(batch_rows)
    notes = {w: {k: {"error": e["tune"].get("error"), "candidates": e["tune"].get("candidates"),
                     "measured_runners": e["tune"].get("measured_runners"), "ov_config": e["tune"].get("ov_config"),
                     "load_errors": [r.get("error") for r in e.get("loads", []) if not r.get("ok")]}
                 for k, e in entries.items()} for w, entries in results.items()}
    return {"meta": meta, "dispatch": dispatch, "rows": rows, "notes": notes, "records": results}


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per workload and batch: the best peer, the best faithful peer and torch_tweak's ratio to each."""
    out = []
    keys = list(dict.fromkeys((r["workload"], r["batch"]) for r in rows))
    for workload, batch in keys:
        group = [r for r in rows if (r["workload"], r["batch"]) == (workload, batch) and r["ok"]]
        peers = [r for r in group if BY_KEY[r["system"]].peer]
        faithful = [r for r in peers if r["fidelity"] and r["fidelity"]["rel"] <= FAITHFUL]
        tt = next((r for r in group if r["system"] == "tt"), None)
        parts = []
        for label, pool in (("best peer", peers), (f"best peer within {FAITHFUL:.0e} rel err", faithful)):
            best = max(pool, key=lambda r: r["throughput"]["median"], default=None)
            if best is None:
                parts.append(f"{label}: none")
                continue
            ratio = f", torch_tweak {tt['throughput']['median'] / best['throughput']['median']:.2f}x" if tt else ""
            parts.append(f"{label}: {best['title']} ({best['throughput']['median']:,.0f}/s, rel err "
                         f"{best['fidelity']['rel']:.1e}{ratio})")
        out.append(f"* {WORKLOADS[workload].title}, batch {batch}: " + "; ".join(parts) + ".")
    return out


def _pm(summary: dict[str, float] | None, digits: int = 0, scale: float = 1.0) -> str:
    """``median ±x%`` where x is half the min-max range relative to the median."""
    if not summary:
        return "–"
    median = summary["median"] * scale
    half = (summary["max"] - summary["min"]) * scale / 2
    spread = f" ±{100 * half / median:.0f}%" if summary.get("n", 1) > 1 and median else ""
    return f"{median:,.{digits}f}{spread}"


def _ms(summary: dict[str, float] | None) -> str:
    if not summary:
        return "–"
    value = summary["median"]
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _ratio(value: float | None) -> str:  # noqa: D103
    return "–" if value is None else f"{value:.2f}x"


_COMPACT = (("BatchRouterBackend(", "routed("), ("OpenVINOBackend(", "OpenVINO("), ("performance_hint=", ""),
            ("inference_precision=", ""), ("Backend()", ""), ("Backend(", "("))


def _compact(text: str | None) -> str:
    """A torch_tweak backend description short enough for a table cell (``routed(batch<=1: OpenVINO(f32), ...)``)."""
    text = text or ""
    for long, short in _COMPACT:
        text = text.replace(long, short)
    return text


def _short(text: str | None, limit: int = 70) -> str:
    text = (text or "").replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _speed_table(rows: list[dict[str, Any]]) -> list[str]:
    head = ["system", "samples/s", "x eager", "x best peer", "p50 ms", "x eager", "x best peer", "p99 ms", "x eager",
            "x best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['title']} | failed |" + " – |" * (len(head) - 2))
            continue
        cells = [r["title"]]
        for metric, digits in (("throughput", 0), ("p50_ms", None), ("p99_ms", None)):
            cells += [_pm(r[metric]) if digits == 0 else _ms(r[metric]), _ratio(r["vs_eager"].get(metric)),
                      _ratio(r["vs_best_peer"].get(metric))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cost_table(rows: list[dict[str, Any]]) -> list[str]:
    head = ["system", "runs", "max rel err vs eager", "tune s", "load→1st output s", "peak RSS MB tune / serve"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in dict.fromkeys(r["system"] for r in rows):
        srows = [r for r in rows if r["system"] == key]
        first = srows[0]
        if not any(r["ok"] for r in srows):
            lines.append(f"| {first['title']} | failed: {_short(first['error'])} |" + " – |" * (len(head) - 2))
            continue
        errors = [r["fidelity"]["rel"] for r in srows if r.get("fidelity")]
        serve = first["maxrss_serve_mb"]
        tune_rss = f"{first['maxrss_tune_mb']:.0f}" if first["maxrss_tune_mb"] else "–"
        lines.append("| " + " | ".join([
            first["title"], _short(_compact(first["selected"]), 90), f"{max(errors):.1e}" if errors else "–",
            f"{first['tune_s']:.1f}" if first["tune_s"] is not None else "–", _pm(first["first_output_s"], 2),
            f"{tune_rss} / {serve['median']:.0f}" if serve else f"{tune_rss} / –"]) + " |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    """The tables: dispatch overhead, then per workload one speed table per batch size and a cost table; notes."""
    meta, rows = data["meta"], data["rows"]
    v = meta["versions"]
    lines = [f"Run `{meta['command']}` on {meta['date']}: {meta['cpu']}, {meta['cpus']} CPUs, Python {meta['python']}, "
             f"torch {v['torch']}, OpenVINO {v['openvino']}, torchao {v['torchao']}, transformers {v['transformers']}, "
             f"AITune 0.6.0, Model Navigator 0.14.0; {meta['wall_s'] / 60:.1f} min wall. Load average during the "
             f"measurements {_load_range(rows)}.", ""]
    others = {w: o for w, o in meta.get("origins", {}).items() if o["command"] != meta["command"]}
    for origin in {o["command"] + o["date"]: o for o in others.values()}.values():
        names = ", ".join(w for w, o in others.items() if o == origin)
        lines[0] = lines[0][:-1] + (f"; the {names} tables come from `{origin['command']}` on {origin['date']} "
                                    f"({origin['wall_s'] / 60:.1f} min wall).")
    lines += ["**Per-call dispatch overhead** (tiny MLP 16-16-4, batch 1, p50 per call, median of the repetitions "
              "±half their range):", "", "| wrapper | raw runtime | raw µs | through the wrapper µs | overhead µs |",
              "|---|---|---|---|---|"]
    for key, record in data["dispatch"].items():
        d = record.get("dispatch")
        if not record.get("ok") or not d:
            lines.append(f"| {BY_KEY[key].title} | – | – | – | failed: {_short(record.get('error'))} |")
            continue
        overhead = (d["wrapped"]["p50_ms"]["median"] - d["raw"]["p50_ms"]["median"]) * 1e3
        lines.append(f"| {BY_KEY[key].title} ({d['backend']}) | {d['raw_what']} | {_pm(d['raw']['p50_ms'], 1, 1e3)} | "
                     f"{_pm(d['wrapped']['p50_ms'], 1, 1e3)} | {overhead:.1f} |")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        wrows = [r for r in rows if r["workload"] == workload]
        for batch in dict.fromkeys(r["batch"] for r in wrows):
            lines += ["", f"**{WORKLOADS[workload].title}, batch {batch}**", ""]
            lines += _speed_table([r for r in wrows if r["batch"] == batch])
        lines += ["", f"**{WORKLOADS[workload].title}: what each system runs and what it costs**", ""]
        lines += _cost_table(wrows)
    return "\n".join(lines + ["", "Summary:", ""] + summary_lines(rows) + [""] + _notes(data)) + "\n"


def _load_range(rows: list[dict[str, Any]]) -> str:
    values = [x for r in rows for x in r["load_avg"] if isinstance(x, (int, float))]
    return f"{min(values):.1f}–{max(values):.1f}" if values else "n/a"


def _notes(data: dict[str, Any]) -> list[str]:
    meta = data["meta"]
    out = ["Notes:", "",
           "* samples/s: samples per second of wall time over each repetition (OpenVINO THROUGHPUT: requests "
           "kept in flight by the AsyncInferQueue; every other system: one call after another); p50 / p99: per-call "
           "latency (THROUGHPUT: submit to completion); each figure is the median over the repetitions, ±half "
           "their range. x eager and x best peer are speed-ups (higher is better: throughput / reference, "
           "reference latency / latency); the best peer is the best of torch.compile, OpenVINO (by hand or "
           "through torch.compile), AITune and Model Navigator on that metric at that batch size.",
           "* max rel err: largest |output - eager| over the measured batches, divided by the largest |eager| "
           "output. OpenVINO computes in bf16 by default on CPUs that have it; TorchAO quantizes to int8.",
           "* tune s: wall time of tuning (torch.compile: compiling and the first call at each measured batch "
           "size; OpenVINO: convert, save and compile). load→1st output: a fresh process from interpreter start "
           "through imports, building the model (torch systems), loading the saved result and the first "
           "inference at batch 1; torch.compile has no artifact, so it compiles again with the compiler cache the "
           "tune left behind. Peak RSS: ru_maxrss of the tuning process / of the fresh load process.",
           f"* Repetitions: {meta['settings']['reps']} per batch size, about {meta['settings']['rep_time_s']} s "
           f"each; {meta['settings']['load_reps']} fresh load process(es) per system. Tuning batch sizes: "
           + "; ".join(f"{w} {b}" for w, b in meta["settings"]["tune_batches"].items()) + "."]
    out += [f"* Skipped in this mode: {s}." for s in meta["settings"]["skipped"]]
    for workload, systems in data["notes"].items():
        for key, note in systems.items():
            if note["error"]:
                out.append(f"* {workload} / {BY_KEY[key].title}: failed: `{_short(note['error'], 300)}`")
            if note["load_errors"]:
                out.append(f"* {workload} / {BY_KEY[key].title}: load failed: `{_short(note['load_errors'][0], 200)}`")
            if key == "navigator" and note["candidates"]:
                out.append(f"* {workload} / Model Navigator runners: " + "; ".join(note["candidates"])
                           + f". Measured by navigator: {', '.join(note['measured_runners'] or ['none'])}.")
            if key in ("tt", "aitune") and note["candidates"]:
                out.append(f"* {workload} / {BY_KEY[key].title} candidates: " + "; ".join(note["candidates"]) + ".")
    return out
