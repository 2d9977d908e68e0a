"""Does HighestThroughputStrategy pick well? Tuned model vs every candidate configured by hand, and vs eager.

    python benchmarks/selection.py [--models cnn transformer] [--rounds 5]

For each model (a small CNN and a small transformer encoder):
1. one process tunes it with ``HighestThroughputStrategy()`` over every available backend (recorded at
   batch sizes 1, 2, 4, 8);
2. one more process per candidate (eager, OpenVINO LATENCY and THROUGHPUT, Inductor, TorchAO) tunes the
   same model with ``OneBackendStrategy(<that backend>)``;
3. the processes then take turns timing their tuned ``tt.Module`` at batch sizes 1, 2, 4 and 8 (one
   process at a time, a pause between turns, ``--rounds`` rounds), so no two runtimes' thread pools
   alternate calls and a drift of the machine's load hits every candidate alike. Per batch size the best
   round counts (the machine is shared: other jobs' bursts only ever slow a round down); a candidate's
   throughput is its best batch size's, as HighestThroughputStrategy defines it.
The tuned model must reach >= 0.95x the best hand-configured throughput and never fall below eager.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
HAND = ["eager", "openvino-latency", "openvino-throughput", "inductor", "torchao"]
RECORD_BATCHES = [1, 2, 4, 8]


# ---- models and backends (imported inside worker processes only) ----------------------------------------

def make_model(name: str) -> tuple[Any, list[Any]]:
    """The model (eval mode) and a list of per-item inputs without the batch axis."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(64, 10),
        ).eval()
        return model, [torch.randn(3, 64, 64) for _ in range(16)]
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
        return model, [torch.randn(32, 128) for _ in range(16)]
    raise SystemExit(f"unknown model {name!r}; choose cnn or transformer")


def make_backend(name: str) -> Any:
    """A hand-configured backend."""
    from torch_tweak.torch import backend as b

    if name == "eager":
        return b.TorchEagerBackend()
    if name.startswith("openvino-"):
        hint = name.split("-", 1)[1].upper()
        return b.OpenVINOBackend(b.OpenVINOBackendConfig(performance_hint=hint))
    if name == "inductor":
        return b.TorchInductorBackend()
    if name == "torchao":
        return b.TorchAOBackend()
    raise SystemExit(f"unknown backend {name!r}")


def backend_available(name: str) -> bool:
    from torch_tweak.torch.backend import available

    cls = {"openvino": "OpenVINOBackend", "inductor": "TorchInductorBackend", "torchao": "TorchAOBackend"}
    return available(cls.get(name.split("-")[0], "TorchEagerBackend"))


# ---- worker: tune (one way or the other), then time the tuned module --------------------------------

def time_module(wrapped: Any, example: Any, target_block_s: float = 0.1, blocks: int = 5) -> float:
    """Median per-call seconds of ``wrapped(example)`` over blocks of calls (after a warm-up)."""
    import torch
    from _timing import time_calls

    with torch.no_grad():
        for _ in range(5):
            wrapped(example)
        start = time.perf_counter()
        for _ in range(5):
            wrapped(example)
        per_call = (time.perf_counter() - start) / 5
        calls = max(5, int(target_block_s / max(per_call, 1e-6)))
        median_us, _ = time_calls(lambda: wrapped(example), calls, blocks=blocks, warmup=calls)
    return median_us * 1e-6


def worker(model_name: str, how: str) -> None:
    """Tune, report, then time the tuned module each time the parent writes ``time`` on stdin."""
    import torch

    import torch_tweak.torch as tt

    tt.config.cache_dir = tempfile.mkdtemp(prefix="tt_selection_")
    model, items = make_model(model_name)
    strategy = tt.HighestThroughputStrategy() if how == "tuned" else tt.OneBackendStrategy(make_backend(how))
    wrapped = tt.Module(model, name=f"{model_name}_{how}".replace("-", "_"), strategy=strategy)
    report = tt.tune(wrapped, items, batch_sizes=RECORD_BATCHES, ignore_failing_modules=False)
    graph = report.modules[0].graphs[0]
    examples = {bs: torch.stack(items[:bs]) for bs in RECORD_BATCHES}
    ready: dict[str, Any] = {"chosen": graph.chosen, "tuning_s": report.duration_s, "reason": graph.reason,
                             "candidates": [
                                 {"backend": c.backend, "status": c.status,
                                  "throughput": (c.measurements or {}).get("best_throughput"),
                                  "batch": (c.measurements or {}).get("best_batch_size"), "build_s": c.build_time_s}
                                 for c in graph.candidates]}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip() != "time":
            break
        print(json.dumps({"seconds": {bs: time_module(wrapped, x) for bs, x in examples.items()}}), flush=True)


class Worker:
    """A worker process: tunes on start, then times its module on request."""

    def __init__(self, model_name: str, how: str) -> None:
        self.how = how
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", model_name, how]
        self.log = tempfile.TemporaryFile("w+")  # closed in close()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=HERE, env={**os.environ, "PYTHONPATH": HERE})
        self.info: dict[str, Any] = self._read() or {}
        self.times: list[dict[int, float]] = []

    def _read(self) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.proc.wait()
        self.log.seek(0)
        tail = "\n".join(self.log.read().strip().splitlines()[-5:])
        self.error = f"exit {self.proc.returncode}: {tail}"
        return None

    @property
    def ok(self) -> bool:
        return bool(self.info) and self.proc.poll() is None

    def time_once(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("time\n")
        self.proc.stdin.flush()
        result = self._read()
        if result is not None:
            self.times.append({int(bs): t for bs, t in result["seconds"].items()})

    def best_seconds(self, batch: int) -> float:
        """The fastest round's per-call seconds at ``batch``."""
        return min(t[batch] for t in self.times)

    @property
    def batch(self) -> int | None:
        """The batch size with the highest throughput."""
        return max(RECORD_BATCHES, key=lambda bs: bs / self.best_seconds(bs)) if self.times else None

    @property
    def throughput(self) -> float | None:
        """Samples/s at the best batch size (best round)."""
        return self.batch / self.best_seconds(self.batch) if self.batch else None

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        self.log.close()


# ---- parent: run everything and print the tables ------------------------------------------------------

def fmt_rate(value: float | None) -> str:
    return f"{value:,.0f}" if value else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "transformer"])
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (processes take turns)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "HOW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1])
        return

    sys.path.insert(0, HERE)
    from _timing import load_average

    start = time.perf_counter()
    summary, details = [], []
    for model_name in args.models:
        workers = [Worker(model_name, "tuned")]
        workers += [Worker(model_name, name) for name in HAND if backend_available(name)]
        for _ in range(args.rounds):
            for w in workers:
                if w.ok:
                    time.sleep(0.3)
                    w.time_once()
        for w in workers:
            w.close()
        tuned, hand = workers[0], workers[1:]
        details.append((model_name, tuned, hand))
        measured = [h for h in hand if h.throughput]
        best = max(measured, key=lambda h: h.throughput, default=None)
        eager = next((h for h in measured if h.how == "eager"), None)
        if not tuned.throughput or best is None or eager is None:
            summary.append([model_name, getattr(tuned, "error", "failed"), "", "", "", "", "", "", ""])
            continue
        vs_best = tuned.throughput / best.throughput
        vs_eager = tuned.throughput / eager.throughput
        summary.append([model_name, tuned.info["chosen"], f"{fmt_rate(tuned.throughput)} ({tuned.batch})",
                        f"{best.how} {fmt_rate(best.throughput)} ({best.batch})", f"{vs_best:.2f}x",
                        f"{fmt_rate(eager.throughput)} ({eager.batch})", f"{vs_eager:.2f}x", f"{tuned.info['tuning_s']:.1f}s",
                        "PASS" if vs_best >= 0.95 and vs_eager >= 1.0 else "FAIL"])
    total = time.perf_counter() - start

    print(f"load average: {load_average():.2f}; samples/s at the best batch size (in brackets), best of "
          f"{args.rounds} rounds, each the median of 5 blocks of calls")
    print()
    for model_name, tuned, hand in details:
        print(f"### {model_name}: what HighestThroughputStrategy measured while tuning")
        print("| candidate | status | best samples/s (batch) | build s |")
        print("|---|---|---|---|")
        for c in tuned.info.get("candidates", []):
            build = f"{c['build_s']:.1f}" if c["build_s"] is not None else "-"
            print(f"| {c['backend']} | {c['status']} | {fmt_rate(c['throughput'])} ({c['batch']}) | {build} |")
        print(f"reason: {tuned.info.get('reason', getattr(tuned, 'error', ''))}")
        print()
        print(f"### {model_name}: timed after tuning, each in its own process")
        sizes = " | ".join(f"ms/call b{bs}" for bs in RECORD_BATCHES)
        print(f"| candidate | samples/s (batch) | {sizes} | tuning s |")
        print("|---|---|" + "---|" * len(RECORD_BATCHES) + "---|")
        for w in [tuned, *hand]:
            name = "tuned: " + w.info["chosen"] if w is tuned and w.info else w.how
            if w.throughput:
                per_batch = " | ".join(f"{w.best_seconds(bs) * 1e3:.3f}" for bs in RECORD_BATCHES)
                print(f"| {name} | {fmt_rate(w.throughput)} ({w.batch}) | {per_batch} | {w.info['tuning_s']:.1f} |")
            else:
                print(f"| {name} | error: {getattr(w, 'error', 'no timing').splitlines()[-1][:80]} | | |")
        print()
    print("### Tuned (HighestThroughputStrategy) vs best hand-configured candidate and vs eager")
    print("| model | tuned choice | tuned samples/s | best hand samples/s | tuned/best | eager samples/s | "
          "tuned/eager | tuning time | >=0.95x best and >=1x eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in summary:
        print("| " + " | ".join(str(v) for v in row) + " |")
    tuning_total = sum(t.info.get("tuning_s", 0.0) for _, t, _ in details)
    print(f"\ntotal tuning time (HighestThroughputStrategy, all models): {tuning_total:.1f}s; "
          f"whole benchmark: {total:.0f}s")


if __name__ == "__main__":
    main()
