"""ONNX Runtime dynamic INT8: weights with one scale per matrix against one per output channel.

    python benchmarks/onnxruntime_int8.py [--rounds 9] [--sizes 256-512-256,768-3072-768] [--batches 1,8,32]

Builds each MLP with ``ONNXRuntimeBackend`` at ``quantization="int8_dynamic_per_tensor"`` and ``"int8_dynamic"``
(per output channel) on every usable core and on one thread, and times every model's call (torch tensors in and
out, as a tuned module serves them) in blocks that take turns, the order rotating from round to round: the ratio
per round cancels the drift of a shared machine's speed. Prints per-call p50 µs and per-tensor / per-channel
time ratios (below 1: per-tensor weights are faster), and each model's relative L2 error against eager.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

import torch
from _timing import cpu_description, load_average, time_calls
from torch import nn

from torch_tweak.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig
from torch_tweak.torch.module.recording import record

QUANTIZATIONS = ("int8_dynamic_per_tensor", "int8_dynamic")


def _mlp(dims: list[int]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dims[0], dims[1]), nn.GELU(), nn.Linear(dims[1], dims[2])).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sizes", default="256-512-256,768-3072-768")
    parser.add_argument("--batches", default="1,8,32")
    args = parser.parse_args()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # the exporter's notes on missing torchvision ops
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{cpu_description()}; load average {load_average():.2f}")
    for size in args.sizes.split(","):
        dims = [int(d) for d in size.split("-")]
        model = _mlp(dims)
        ((spec, samples),) = record(model, [(b, ((torch.randn(b, dims[0]),), {})) for b in batches])
        calls, errors = {}, {}
        with tempfile.TemporaryDirectory() as cache:
            for quantization in QUANTIZATIONS:
                for threads in (None, 1):
                    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(quantization=quantization,
                                                                          intra_op_num_threads=threads))
                    backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"),
                                  Path(cache) / f"{quantization}_{threads}")
                    name = (quantization.removeprefix("int8_dynamic").strip("_") or "per_channel", threads or "all")
                    calls[name] = backend.serving()
                    x = torch.randn(64, dims[0])
                    with torch.no_grad():
                        reference = model(x)
                    errors[name] = float((calls[name](x) - reference).norm() / reference.norm())
            print(f"\nMLP {size}: rel L2 vs eager " + ", ".join(f"{q}/{t} threads {e:.2e}"
                                                               for (q, t), e in errors.items()))
            print("batch | threads | per-tensor p50 µs | per-channel p50 µs | per-tensor / per-channel (median, min-max)")
            for b in batches:
                x = torch.randn(b, dims[0])
                calls_per_block = max(20, int(2000 / b))
                for threads in ("all", 1):
                    pair = [("per_tensor", threads), ("per_channel", threads)]
                    times: dict[tuple, list[float]] = {p: [] for p in pair}
                    ratios = []
                    for round_ in range(args.rounds):
                        for name in pair if round_ % 2 == 0 else pair[::-1]:
                            fn = calls[name]
                            times[name].append(time_calls(lambda fn=fn, x=x: fn(x), calls_per_block, blocks=1)[0])
                        ratios.append(times[pair[0]][-1] / times[pair[1]][-1])
                    print(f"{b} | {threads} | {statistics.median(times[pair[0]]):.1f} | "
                          f"{statistics.median(times[pair[1]]):.1f} | {statistics.median(ratios):.2f}x "
                          f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
