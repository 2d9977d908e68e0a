"""Per-call overhead of OpenVINOBackend.infer over calling the same compiled OpenVINO model directly.

The direct call is the best-practice one: a prebuilt InferRequest fed a prebuilt numpy view of the input
with ``share_inputs=True``. Both run the same ``ov.CompiledModel``. Calls are timed one by one in
alternating *blocks* (never alternating single calls, see environment.md G19).

Run: ``.venv/bin/python benchmarks/openvino_overhead.py [--calls 4000] [--precision f32] [--hints LATENCY]``
Targets (LATENCY): <= 10 µs extra per call at batch 1, >= 0.97x throughput at batch 32. Under THROUGHPUT the
backend splits a batch across one request per stream, so batch 32 beats a single direct request.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from _timing import paired_blocks
from torch import nn

from torch_tweak.torch.backend.openvino import OpenVINOBackend, OpenVINOBackendConfig
from torch_tweak.torch.module.recording import record


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 10)).eval()


def _block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        _block(3, 32), _block(32, 32), nn.MaxPool2d(2), _block(32, 64), nn.MaxPool2d(2), _block(64, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    ).eval()


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {"mlp": (mlp, (512,)), "cnn": (cnn, (3, 32, 32))}


def build(name: str, cache: Path, config: OpenVINOBackendConfig) -> OpenVINOBackend:
    factory, shape = MODELS[name]
    model = factory()
    calls = [(b, ((torch.randn(b, *shape),), {})) for b in (1, 2, 32)]
    with torch.no_grad():
        ((spec, samples),) = record(model, calls)
    backend = OpenVINOBackend(config)
    backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"), cache / name)
    return backend


def run_hint(hint: str, precision: str | None, calls: int, block: int, tmp: Path) -> list[tuple]:
    """Rows ``(model, batch, precision, measurements)`` for one performance hint."""
    config = OpenVINOBackendConfig(performance_hint=hint, inference_precision=precision)
    rows = []
    for name, (_, shape) in MODELS.items():
        backend = build(name, tmp / hint, config)
        request = backend._compiled_model.create_infer_request()
        for batch in (1, 32):
            x = torch.randn(batch, *shape)
            feed = {0: x.numpy()}

            def direct(feed: dict = feed, request: object = request) -> object:
                return request.infer(feed, share_inputs=True)

            def tuned(x: torch.Tensor = x, backend: OpenVINOBackend = backend) -> object:
                return backend.infer(x)

            n, b = (calls, block) if batch == 1 else (max(calls // 8, 20), max(block // 5, 2))
            rows.append((name, batch, backend.executed_precision, paired_blocks(direct, tuned, n, b)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000, help="timed calls per variant at batch 1 (1/8 at batch 32)")
    parser.add_argument("--block", type=int, default=50, help="calls per block at batch 1 (1/5 at batch 32)")
    parser.add_argument("--precision", default=None, help="inference_precision (default: the device default)")
    parser.add_argument("--hints", default="LATENCY,THROUGHPUT", help="comma-separated performance hints")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="ov_overhead_") as tmp:
        tables = {hint: run_hint(hint, args.precision, args.calls, args.block, Path(tmp))
                  for hint in args.hints.split(",")}
    with open("/proc/loadavg", encoding="utf-8") as f:
        load = f.read().split()[0]
    print(f"OpenVINOBackend.infer vs direct InferRequest.infer(feed, share_inputs=True) on the same compiled model; "
          f"alternating blocks; load average {load} on {os.cpu_count()} cores")
    print("extra / throughput = median over rounds of (infer - direct) / (direct / infer) of the block medians")
    print(f"{'hint':<11}{'model':<6}{'batch':>6}{'prec':>6}{'direct µs':>11}{'infer µs':>11}{'extra µs':>10}"
          f"{'throughput':>12}")
    for hint, rows in tables.items():
        for name, batch, precision, m in rows:
            print(f"{hint:<11}{name:<6}{batch:>6}{precision:>6}{m['direct']:>11.1f}{m['tuned']:>11.1f}"
                  f"{m['extra']:>10.1f}{m['ratio']:>11.3f}x")


if __name__ == "__main__":
    main()
