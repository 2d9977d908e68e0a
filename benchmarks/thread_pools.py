"""What a tuned OpenVINO module pays when PyTorch code runs between its calls (a pipeline's other steps).

    python benchmarks/thread_pools.py [--rounds 5] [--work-mb 16]

PyTorch's OpenMP threads keep spinning for a while after a parallel operation, and OpenVINO's threads want the
same cores for the next call (environment.md G19). This script tunes a small transformer encoder with the OpenVINO
backend and times, in blocks that alternate: the tuned call alone; a PyTorch elementwise operation on
``--work-mb`` MB alone (parallel: it wakes the OpenMP pool); the same work in numpy (one thread: it touches the
same memory, so what it adds over the sum of its parts is cache traffic, not threads); and each operation followed
by the tuned call, as in a pipeline. "Extra" is what a step costs over the sum of its parts, as a share of the
tuned call. Eager PyTorch in the same pipeline is timed too, since the fix below slows it. The whole measurement
runs twice, each in a fresh process: as the environment is, and with ``OMP_WAIT_POLICY=PASSIVE``, which libgomp
reads at start-up only (it must be set before ``import torch``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _timing import cpu_description

BLOCK_S = 0.3


def _encoder() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).eval()


def _block_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds per call over one block of at least :data:`BLOCK_S` seconds."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= BLOCK_S:
            return elapsed * 1000.0 / calls


def measure(rounds: int, work_mb: int) -> dict[str, float]:
    """Median milliseconds per call of each variant, timed in blocks whose order rotates from round to round."""
    import numpy as np
    import torch

    import torch_tweak.torch as tt
    from torch_tweak.torch.backend import OpenVINOBackend

    torch.set_num_threads(os.cpu_count() or 1)
    tt.config.cache_dir = tempfile.mkdtemp(prefix="tt_thread_pools_")
    tt.config.progress = False
    reference, model = _encoder(), _encoder()
    tuned = tt.Module(model, name="encoder", strategy=tt.OneBackendStrategy(OpenVINOBackend()))
    tt.tune(tuned, [torch.randn(128, 256) for _ in range(4)], batch_sizes=[1, 2], executor="inline")
    x = torch.randn(1, 128, 256)
    work = torch.randn(work_mb * 1024 * 1024 // 4)
    work_np = work.numpy().copy()

    def torch_op() -> None:
        torch.mul(work, 0.5, out=work)

    def numpy_op() -> None:
        np.multiply(work_np, 0.5, out=work_np)

    variants: dict[str, Callable[[], Any]] = {
        "tuned": lambda: tuned(x),
        "eager": lambda: reference(x),
        "torch op": torch_op,
        "numpy op": numpy_op,
        "torch op + tuned": lambda: (torch_op(), tuned(x)),
        "numpy op + tuned": lambda: (numpy_op(), tuned(x)),
        "torch op + eager": lambda: (torch_op(), reference(x)),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    with torch.no_grad():
        for fn in variants.values():
            fn()
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(_block_ms(variants[name]))
    return {name: statistics.median(values) for name, values in times.items()}


def _child(rounds: int, work_mb: int, passive: bool) -> dict[str, float]:
    env = {**os.environ}
    env.pop("OMP_WAIT_POLICY", None)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    done = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(rounds), "--work-mb", str(work_mb)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the measuring process failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _extra(m: dict[str, float], op: str, call: str) -> str:
    extra = m[f"{op} + {call}"] - m[op] - m[call]
    return f"{extra:+.2f} ms ({extra / m[call]:+.0%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed blocks per variant")
    parser.add_argument("--work-mb", type=int, default=16, help="size of the array the in-between operation touches")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds, args.work_mb)))
        return
    print(f"CPU: {cpu_description()}, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; work {args.work_mb} MB")
    print("| environment | tuned call ms | torch op ms | torch op + tuned: extra | numpy op + tuned: extra "
          "| eager call ms | torch op + eager: extra |")
    print("|---|---|---|---|---|---|---|")
    for label, passive in (("default", False), ("OMP_WAIT_POLICY=PASSIVE", True)):
        m = _child(args.rounds, args.work_mb, passive)
        print(f"| {label} | {m['tuned']:.2f} | {m['torch op']:.2f} | {_extra(m, 'torch op', 'tuned')} "
              f"| {_extra(m, 'numpy op', 'tuned')} | {m['eager']:.2f} | {_extra(m, 'torch op', 'eager')} |")


if __name__ == "__main__":
    main()
