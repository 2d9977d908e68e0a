"""Shared by every runner script: arguments, timing with repetitions, fidelity (element-wise and task metric), the JSON record.

Imports only the standard library at module level (runners decide when torch or OpenVINO is imported,
so import times can be measured).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # so `from peers import ...` works in any environment


def parse_args(description: str) -> argparse.Namespace:
    """The arguments the driver passes to every runner."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--system", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--phase", choices=("tune", "load", "serve", "dispatch"), default="tune")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per batch size")
    parser.add_argument("--rep-time", type=float, default=1.0, help="seconds of calls per repetition (about)")
    parser.add_argument("--batches", default="", help="comma-separated batch sizes to measure")
    parser.add_argument("--tune-batches", default="1,2", help="batch sizes the tuners see")
    parser.add_argument("--artifact", type=Path, help="folder for what the tune phase saves and the load phase reads")
    return parser.parse_args()


def summary(values: list[float]) -> dict[str, float]:
    """Median and spread (min, max) of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def time_calls(fn: Callable[[], Any], batch: int, reps: int, rep_time: float, pause_s: float = 0.0) -> dict[str, Any]:
    """Time ``fn`` (one inference of ``batch`` samples) in ``reps`` repetitions of about ``rep_time`` seconds.

    Warm-up runs first (at least 3 calls, at least 0.2 s, at most 30 calls). Each repetition gives the
    p50 and p99 of its per-call latencies and its throughput (samples per second of wall time); the
    result is the median of each over the repetitions with its spread.
    """
    start = time.perf_counter()
    warm = 0
    while warm < 3 or (time.perf_counter() - start < 0.2 and warm < 30):
        fn()
        warm += 1
    per_call = (time.perf_counter() - start) / warm
    calls = int(min(2000, max(5, rep_time / max(per_call, 1e-7))))
    p50, p99, throughput = [], [], []
    for _ in range(reps):
        if pause_s:
            time.sleep(pause_s)
        times = []
        begin = time.perf_counter()
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - begin
        times.sort()
        p50.append(percentile(times, 50) * 1e3)
        p99.append(percentile(times, 99) * 1e3)
        throughput.append(batch * calls / wall)
    return {"calls_per_rep": calls, "p50_ms": summary(p50), "p99_ms": summary(p99), "throughput": summary(throughput)}


def serve_batches(record: dict[str, Any], args: argparse.Namespace, time_batch: Callable[[int], dict[str, Any]]) -> None:
    """The ``serve`` phase's timing, after the runner loaded its artifact: a pause (the load's thread pools go
    idle), then ``time_batch(b)`` for every batch size the driver asked for, into ``record["batches"]``."""
    time.sleep(0.5)
    for b in (int(b) for b in args.batches.split(",") if b):
        record["batches"][str(b)] = time_batch(b)


def compare_calls(raw: Callable[[], Any], wrapped: Callable[[], Any], reps: int, rep_time: float) -> dict[str, Any]:
    """Per-call time of ``raw`` and ``wrapped`` measured in alternating blocks (``reps`` each, same runtime).

    Alternating keeps both sides exposed to the same machine state; each block is one repetition.
    """
    blocks: dict[str, list[dict[str, Any]]] = {"raw": [], "wrapped": []}
    for _ in range(reps):
        for name, fn in (("raw", raw), ("wrapped", wrapped)):
            blocks[name].append(time_calls(fn, 1, 1, rep_time))
    return {name: {"calls_per_rep": runs[0]["calls_per_rep"],
                   **{key: summary([r[key]["median"] for r in runs]) for key in ("p50_ms", "p99_ms", "throughput")}}
            for name, runs in blocks.items()}


def fidelity(output: Any, reference: Any) -> dict[str, float]:
    """Max absolute error and the error relative to the reference's largest magnitude (torch tensors)."""
    import torch

    out = torch.as_tensor(output).detach().float().reshape(-1)
    ref = torch.as_tensor(reference).detach().float().reshape(-1)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from eager's {tuple(ref.shape)}")
    err = (out - ref).abs().max().item()
    return {"max_abs": err, "rel": err / max(ref.abs().max().item(), 1e-12)}


def task_metrics(kind: str, output: Any, reference: Any) -> dict[str, Any]:
    """The task metrics of ``output`` against eager's ``reference`` (all held-out samples, concatenated).

    ``classifier`` (logits, N x classes): ``top1``, the share of rows whose arg-max equals eager's, and
    ``cosine``, the smallest cosine similarity of a row's logits with eager's. ``encoder`` (hidden states,
    N x tokens x width): ``cosine_cls``, the smallest cosine of the CLS (first-token) vectors, and
    ``cosine_tokens``, the smallest over every token vector; ``cosine`` is the smaller of the two.
    ``regression``: ``rel_l2``, ``||output - eager|| / ||eager||`` over all outputs. Computed in float64;
    a non-finite output gives NaN, which no bound accepts.
    """
    import torch

    out = torch.as_tensor(output).detach().double()
    ref = torch.as_tensor(reference).detach().double()
    if out.shape != ref.shape:
        raise ValueError(f"held-out output shape {tuple(out.shape)} differs from eager's {tuple(ref.shape)}")

    def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        return float(torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-30).min())

    finite = bool(torch.isfinite(out).all())
    result: dict[str, Any] = {"kind": kind, "n": int(out.shape[0]), "finite": finite}
    if kind == "classifier":
        result["top1"] = float((out.argmax(-1) == ref.argmax(-1)).double().mean()) if finite else float("nan")
        result["cosine"] = min_cosine(out, ref)
    elif kind == "encoder":
        result["cosine_cls"] = min_cosine(out[:, 0], ref[:, 0])
        result["cosine_tokens"] = min_cosine(out, ref)
        result["cosine"] = min(result["cosine_cls"], result["cosine_tokens"])
    elif kind == "regression":
        result["rel_l2"] = float((out - ref).norm() / ref.norm().clamp_min(1e-300))
    else:
        raise ValueError(f"unknown task kind {kind!r}")
    return {key: (float("nan") if isinstance(v, float) and not finite else v) for key, v in result.items()}


def held_out(run_dir: Path, workload: str, call: Callable[[Any], Any], numpy_io: bool = False) -> Any:
    """Run the workload's held-out samples through ``call`` in chunks of its eval batch size; the outputs
    concatenated as one float32 torch tensor. ``numpy_io``: ``call`` takes and returns numpy arrays."""
    import numpy as np
    import torch

    from peers import workloads

    spec = workloads.WORKLOADS[workload]
    samples = workloads.load_inputs(run_dir, workload)["eval"]
    outputs = []
    with torch.no_grad():
        for chunk in samples.split(spec.eval_batch):
            if numpy_io:
                outputs.append(torch.from_numpy(np.array(call(np.ascontiguousarray(chunk.numpy())), dtype=np.float32)))
            else:
                outputs.append(torch.as_tensor(call(chunk)).detach().float().clone())
    return torch.cat(outputs)


def task_check(run_dir: Path, workload: str, call: Callable[[Any], Any] | None, numpy_io: bool = False,
               outputs: Any = None) -> dict[str, Any]:
    """:func:`task_metrics` of ``call`` on the held-out samples (or of ready ``outputs``) against eager's
    outputs (``<workload>.ref.pt``), with the bound's value (``value``), whether it holds (``within``) and
    the seconds it took."""
    import torch

    from peers import workloads

    start = time.perf_counter()
    task = workloads.TASKS[workloads.WORKLOADS[workload].task]
    reference = torch.load(run_dir / f"{workload}.ref.pt", weights_only=True)["eval"]
    if outputs is None:
        outputs = held_out(run_dir, workload, call, numpy_io)
    result = task_metrics(task.kind, outputs, reference)
    result.update(value=result[task.metric], within=task.within(result[task.metric]), bound=task.describe(),
                  seconds=time.perf_counter() - start)
    return result


def reference_stats(kind: str, reference: Any) -> dict[str, Any]:
    """How decisive eager's own held-out outputs are (classifier: distinct arg-max classes, and the top-1 minus
    top-2 logit margin relative to the spread of a row's logits, median and smallest)."""
    import torch

    ref = torch.as_tensor(reference).detach().double()
    if kind != "classifier":
        return {}
    top2 = ref.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]) / ref.std(dim=-1)
    return {"distinct_top1": int(ref.argmax(-1).unique().numel()), "rows": int(ref.shape[0]),
            "margin_median": float(margin.median()), "margin_min": float(margin.min())}


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (``ru_maxrss``, KiB on Linux) in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def new_record(args: argparse.Namespace) -> dict[str, Any]:
    """The record a runner fills in and :func:`finish` writes."""
    return {"system": args.system, "workload": args.workload, "phase": args.phase, "ok": False, "error": None,
            "notes": [], "batches": {}, "load_avg_start": os.getloadavg()[0], "started": time.time()}


def finish(record: dict[str, Any], out: Path) -> None:
    """Write the record (with the peak RSS and the load average at the end) as JSON."""
    record["maxrss_mb"] = peak_rss_mb()
    record["load_avg_end"] = os.getloadavg()[0]
    record["wall_s"] = time.time() - record["started"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str))


def run_guarded(record: dict[str, Any], out: Path, body: Callable[[], None]) -> None:
    """Run ``body``; any exception becomes the record's error (type, message, traceback tail)."""
    try:
        body()
        record["ok"] = record["error"] is None
    except BaseException as exc:  # noqa: BLE001 - a failing system is a result, not a crash
        message = str(exc).strip().splitlines()
        record["error"] = f"{type(exc).__name__}: {message[0] if message else ''}"[:300]
        record["traceback"] = traceback.format_exc()[-4000:]
    finish(record, out)
