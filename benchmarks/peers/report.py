"""Turn the runners' records into the result JSON (rows with ratios) and the Markdown tables."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import time
from typing import Any

from peers import serve
from peers.systems import BY_KEY, SYSTEMS, Mode
from peers.workloads import CALIBRATION_BATCHES, TASKS, WORKLOADS


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(mode: Mode, wall_s: float, command: str) -> dict[str, Any]:
    """Machine, versions and the run's settings."""
    cpu, flags = "unknown", []
    try:
        with open("/proc/cpuinfo") as handle:
            info = handle.read().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in info if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    isa = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c", "sse4_2")]
    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": cpu, "isa": isa, "cpus": os.cpu_count(),
            "mode": mode.name, "command": command, "wall_s": wall_s, "load_avg_end": os.getloadavg(),
            "python": platform.python_version(),
            "versions": {p: _version(p) for p in ("torch", "openvino", "torchao", "transformers", "torch-tweak",
                                                  "onnxruntime", "onnx", "onnxscript", "nncf")},
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
            "fidelity": measured.get("fidelity"), "task": record.get("task"),
            "tune_s": record.get("tune_s") if key != "tt_loaded" else None,
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
                     "eval_stats": e["tune"].get("eval_stats"), "int8": e["tune"].get("int8"),
                     "ort_config": e["tune"].get("ort_config"),
                     "ort_int8": {k: e["tune"][k] for k in ("export_s", "quantize_s", "model_mb") if k in e["tune"]}
                     if "quantize_s" in e["tune"] else None, "remarks": e["tune"].get("notes") or [],
                     "load_errors": [r.get("error") for r in e.get("loads", []) if not r.get("ok")]}
                 for k, e in entries.items()} for w, entries in results.items()}
    return {"meta": meta, "dispatch": dispatch, "rows": rows, "notes": notes, "serve": serve.summarize(results, mode),
            "records": results}


def _task_value(row: dict[str, Any]) -> float | None:
    task = row.get("task") or {}
    return task.get("value")


def _within_bound(row: dict[str, Any]) -> bool:
    return bool((row.get("task") or {}).get("within"))


def _task_cell(workload: str, task: dict[str, Any] | None) -> str:
    """The task metrics of a row in a few characters (``top-1 0.99, cos 0.998``)."""
    if not task:
        return "–"
    kind = TASKS[WORKLOADS[workload].task].kind

    def num(value: float | None, digits: int = 3) -> str:
        return "–" if value is None else "NaN" if value != value else f"{value:.{digits}f}"

    if kind == "classifier":
        return f"top-1 {num(task.get('top1'), 2)}, cos {num(task.get('cosine'), 4)}"
    if kind == "encoder":
        return f"cos CLS {num(task.get('cosine_cls'), 4)}, tokens {num(task.get('cosine_tokens'), 4)}"
    value = task.get("rel_l2")
    return "–" if value is None else "NaN" if value != value else f"rel L2 {value:.1e}"


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and batch: the best peer, the best peer within 1e-2 max rel err, the best peer within the
    workload's task bound, and each torch_tweak row's throughput ratio to them."""
    out = []
    for workload, batch in dict.fromkeys((r["workload"], r["batch"]) for r in rows):
        group = [r for r in rows if (r["workload"], r["batch"]) == (workload, batch) and r["ok"]]
        peers = [r for r in group if BY_KEY[r["system"]].peer]
        pools = {"best": peers,
                 "faithful": [r for r in peers if r["fidelity"] and r["fidelity"]["rel"] <= FAITHFUL],
                 "in_bound": [r for r in peers if _within_bound(r)]}
        best = {name: max(pool, key=lambda r: r["throughput"]["median"], default=None) for name, pool in pools.items()}
        entry = {"workload": workload, "batch": batch, "bound": TASKS[WORKLOADS[workload].task].describe(),
                 **{name: _brief(r) for name, r in best.items()}, "torch_tweak": {}}
        for key in ("tt", "tt_task", "tt_loaded"):
            mine = next((r for r in group if r["system"] == key), None)
            if mine is None:
                continue
            entry["torch_tweak"][key] = {**_brief(mine), **{
                f"x_{name}": mine["throughput"]["median"] / r["throughput"]["median"] for name, r in best.items() if r}}
        out.append(entry)
    return out


def _brief(row: dict[str, Any] | None) -> dict[str, Any]:
    if row is None:
        return {}
    return {"system": row["system"], "throughput": row["throughput"]["median"], "rel": (row["fidelity"] or {}).get("rel"),
            "task": _task_value(row), "within": _within_bound(row), "selected": row["selected"]}


def _summary_table(entries: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """One line per workload and batch: the best peers (overall, within 1e-2 rel err, within the task bound) and
    torch_tweak's rows with their throughput ratio to the best peer and to the best peer within the task bound."""
    mine_keys = [k for k in ("tt", "tt_task") if any(k in e["torch_tweak"] for e in entries)] or ["tt"]
    head = ["workload, batch", "task bound", "best peer", "best peer within 1e-2 rel err",
            "best peer within the task bound"]
    for key in mine_keys:
        head += [BY_KEY[key].short, "x best peer", "x best within task bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(brief: dict[str, Any], workload: str) -> str:
        if not brief:
            return "none"
        row = next(r for r in rows if r["workload"] == workload and r["system"] == brief["system"] and r["ok"])
        return f"{BY_KEY[brief['system']].short} {_rate(brief['throughput'])} ({_task_cell(workload, row['task'])})"

    for e in entries:
        workload = e["workload"]
        cells = [f"{_short_title(workload)}, {e['batch']}", e["bound"], cell(e["best"], workload),
                 cell(e["faithful"], workload), cell(e["in_bound"], workload)]
        for key in mine_keys:
            mine = e["torch_tweak"].get(key)
            if not mine:
                cells += ["failed or not run", "–", "–"]
                continue
            row = next(r for r in rows if r["workload"] == workload and r["system"] == key and r["ok"])
            bound = ("task metric not measured" if mine["task"] is None else "within the bound" if mine["within"]
                     else "**outside the bound**")
            in_bound = _ratio(mine.get("x_in_bound"))
            cells += [f"{_rate(mine['throughput'])} ({_task_cell(workload, row['task'])}, {bound})",
                      _ratio(mine.get("x_best")), f"**{in_bound}**" if mine["within"] else f"{in_bound} (outside)"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _short_title(workload: str) -> str:
    """``ResNet-50-shaped CNN 224x224`` without the parenthesis; the worst case marked as such."""
    title = WORKLOADS[workload].title.split(" (")[0]
    return f"{title.split(',')[0]} (worst case)" if "worst case" in WORKLOADS[workload].title else title


def _rate(value: float) -> str:
    return f"{value:,.0f}/s" if value >= 100 else f"{value:.1f}/s"


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
            small = digits == 0 and r[metric]["median"] < 10  # a few samples/s: keep two significant digits
            shown = _pm(r[metric], 2 if r[metric]["median"] < 1 else 1) if small else (
                _pm(r[metric]) if digits == 0 else _ms(r[metric]))
            cells += [shown, _ratio(r["vs_eager"].get(metric)),
                      _ratio(r["vs_best_peer"].get(metric))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cost_table(rows: list[dict[str, Any]]) -> list[str]:
    workload = rows[0]["workload"]
    bound = TASKS[WORKLOADS[workload].task].describe()
    head = ["system", "runs", "max rel err vs eager", f"task metric, held-out (bound: {bound})", "tune s",
            "load→1st output s", "peak RSS MB tune / serve"]
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
        task = _task_cell(workload, first["task"])
        if first["task"]:
            task += " ✓" if first["task"].get("within") else " ✗ outside"
        lines.append("| " + " | ".join([
            first["title"], _short(_compact(first["selected"]), 90), f"{max(errors):.1e}" if errors else "–", task,
            f"{first['tune_s']:.1f}" if first["tune_s"] is not None else "–", _pm(first["first_output_s"], 2),
            f"{tune_rss} / {serve['median']:.0f}" if serve else f"{tune_rss} / –"]) + " |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    """The tables: dispatch overhead, then per workload one speed table per batch size and a cost table; notes."""
    meta, rows = data["meta"], data["rows"]
    v = meta["versions"]
    lines = [f"Run `{meta['command']}` on {meta['date']}: {meta['cpu']}, {meta['cpus']} CPUs, Python {meta['python']}, "
             f"torch {v['torch']}, OpenVINO {v['openvino']}, torchao {v['torchao']}, transformers {v['transformers']}, "
             f"ONNX Runtime {v.get('onnxruntime', '?')}, NNCF {v.get('nncf', '?')}, AITune 0.6.0, Model Navigator "
             f"0.14.0; {meta['wall_s'] / 60:.1f} min wall. Load average during the measurements {_load_range(rows)}.",
             ""]
    for added in meta.get("additions", []):
        rows_of = ", ".join(BY_KEY[k].title if k in BY_KEY else k for k in added["systems"])
        lines += [f"Added afterwards by `{added['command']}` on {added['date']} ({added['wall_s'] / 60:.1f} min wall, "
                  f"same weights, inputs and eager references): {rows_of}. Load then: "
                  + "; ".join(f"{u['when']} `{u['uptime'].split('load average: ')[-1]}`" for u in added["uptime"])
                  + ".", ""]
    if meta.get("isa"):
        lines += [f"CPU ISA flags (vector and matrix): {' '.join(meta['isa'])}.", ""]
    if meta.get("uptime"):
        lines += ["Machine load during the run (`uptime`; other jobs shared the cores, so read the speeds with it):", ""]
        lines += [f"* {u['when']}: `{u['uptime']}`" for u in meta["uptime"]] + [""]
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
    summary = ["", "**Summary** (samples/s at each batch size; in brackets the task metric on the held-out "
               "inputs; x: torch_tweak's throughput over the peer's):", ""]
    summary += _summary_table(summary_rows(rows), rows)
    summary += serve.markdown(data.get("serve") or [])
    return "\n".join(lines + summary + [""] + _notes(data)) + "\n"


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
           "reference latency / latency); the best peer is the best of torch.compile, OpenVINO (by hand, default "
           "precision or INT8, or through torch.compile), ONNX Runtime by hand (default precision or dynamic INT8), "
           "AITune and Model Navigator on that metric at that batch size, whatever its error; the summary also gives "
           "the best peer within the task bound.",
           "* max rel err: largest |output - eager| over the measured batches, divided by the largest |eager| "
           "output. OpenVINO computes in bf16 by default on CPUs that have it; TorchAO quantizes to int8.",
           "* Task metric: each system runs held-out inputs (never the tuning samples) and is compared with eager "
           "on them: " + "; ".join(f"{WORKLOADS[w].title}: {WORKLOADS[w].eval_count} "
                                   f"{'sequences' if WORKLOADS[w].inputs == 'tokens' else 'samples'} at batch "
                                   f"{WORKLOADS[w].eval_batch}, {TASKS[WORKLOADS[w].task].describe()}"
                                   for w in data["notes"]) + ". CNN: top-1 = share of rows whose arg-max equals "
           "eager's, cos = smallest cosine of a row's logits with eager's. Encoder: smallest cosine of the CLS "
           "(first-token) vectors and of all token vectors of the last hidden state; the bound applies to the "
           "smaller. MLP: ||output - eager|| / ||eager|| over all held-out outputs. ✓ within the bound, ✗ outside.",
           f"* Weights: all random (no hub). The default CNN's batch-norm statistics are averaged over "
           f"{CALIBRATION_BATCHES} batches of 8 image-like inputs (smooth random fields at six scales, normalised "
           "like ImageNet; the same generator makes its measured, tuning and held-out inputs, from other seeds); "
           "its convolutions and head keep their random initialisation. The worst-case CNN takes its statistics from "
           "one batch of white noise and runs on white noise (the CNN of earlier runs). The encoder is "
           "BertModel(BertConfig()) with BERT's own initialisation (normal, std 0.02), untrained, on random token "
           "ids.",
           "* OpenVINO INT8: `nncf.quantize` with its defaults (preset PERFORMANCE; `model_type=TRANSFORMER` for the "
           f"encoder) on the {meta['settings'].get('tune_samples', 8)} tuning samples torch_tweak tunes with, at "
           "batch 1; the layers it leaves unquantized "
           "run in OpenVINO's default precision (bf16 here). ONNX Runtime: `torch.onnx.export` (torch's default "
           "exporter) with dynamic batch (and sequence) axes, `InferenceSession` with CPUExecutionProvider, default "
           "graph optimizations, intra-op threads = cores. ONNX Runtime INT8: the same export, then "
           "`onnxruntime.quantization.quantize_dynamic` with its defaults (QInt8 weights, per tensor, every op type "
           "it quantizes, no `reduce_range`, which ORT's documentation advises on AVX2/AVX-512 CPUs without VNNI "
           "against int8 saturation; no calibration: activations are quantized at each call) and the same session.",
           "* tune s: wall time of tuning (torch.compile: compiling and the first call at each measured batch "
           "size; OpenVINO: convert, save and compile; ONNX Runtime: export, INT8 also quantize_dynamic, and session "
           "creation). load→1st output: a fresh process from interpreter start through imports, building the model "
           "(torch systems), loading the saved result and the first "
           "inference at batch 1; torch.compile has no artifact, so it compiles again with the compiler cache the "
           "tune left behind. Peak RSS: ru_maxrss of the tuning process / of the fresh load process.",
           f"* Repetitions: {meta['settings']['reps']} per batch size, about {meta['settings']['rep_time_s']} s "
           f"each; {meta['settings']['load_reps']} fresh load process(es) per system. Tuning batch sizes: "
           + "; ".join(f"{w} {b}" for w, b in meta["settings"]["tune_batches"].items()) + "."]
    out += [f"* Skipped in this mode: {s}." for s in meta["settings"]["skipped"]]
    task_row = meta.get("tt_task_metric")
    if task_row and not task_row.get("included"):
        out.append(f"* Row 'tt.tune with the task metric' not run (--tt-task-metric {task_row['flag']}): the installed "
                   + (f"torch_tweak's {task_row['signature']} takes no task metric yet." if not task_row["supported"]
                      else "torch_tweak's FidelityConfig takes metric, but it was turned off."))
    for workload, systems in data["notes"].items():
        stats = (systems.get("eager") or {}).get("eval_stats")
        if stats:
            out.append(f"* {workload} / eager's own held-out logits: {stats['distinct_top1']} distinct top-1 classes "
                       f"among {stats['rows']} inputs; top-1 minus top-2 logit, in units of the row's logit std: "
                       f"median {stats['margin_median']:.2f}, smallest {stats['margin_min']:.3f} (a trained classifier "
                       "is usually far more decisive, so top-1 agreement here is a harsh test).")
    for workload, systems in data["notes"].items():
        for key, note in systems.items():
            if note["error"]:
                out.append(f"* {workload} / {BY_KEY[key].title}: failed: `{_short(note['error'], 300)}`")
            if note["load_errors"]:
                out.append(f"* {workload} / {BY_KEY[key].title}: load failed: `{_short(note['load_errors'][0], 200)}`")
            if key == "navigator" and note["candidates"]:
                out.append(f"* {workload} / Model Navigator runners: " + "; ".join(note["candidates"])
                           + f". Measured by navigator: {', '.join(note['measured_runners'] or ['none'])}.")
            if key in ("tt", "tt_task", "aitune") and note["candidates"]:
                out.append(f"* {workload} / {BY_KEY[key].title} candidates: " + "; ".join(note["candidates"]) + ".")
            if note.get("int8") and not note["int8"].get("reused"):
                q = note["int8"]
                out.append(f"* {workload} / OpenVINO INT8: NNCF {q['nncf']}, {q['calibration']}, options "
                           f"{q['options'] or 'none'}; convert {q['convert_s']:.1f} s, quantize {q['quantize_s']:.1f} s.")
            if note.get("ort_int8"):
                q, mb = note["ort_int8"], note["ort_int8"].get("model_mb") or {}
                out.append(f"* {workload} / ONNX Runtime INT8: export {q.get('export_s', float('nan')):.1f} s, "
                           f"quantize_dynamic {q['quantize_s']:.{1 if q['quantize_s'] >= 1 else 2}f} s"
                           + (f"; model {mb['fp32']:.1f} MB float32 -> {mb['int8']:.1f} MB" if mb else "") + ".")
            for remark in note.get("remarks") or []:
                out.append(f"* {workload} / {BY_KEY[key].title}: {remark}.")
    return out
