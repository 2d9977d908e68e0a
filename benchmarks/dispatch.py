"""Per-call dispatch overhead of a tuned module over calling the runtime it chose directly (SPEC target: 10 µs).

    python benchmarks/dispatch.py [--backends eager,onnxruntime,openvino] [--calls 4000] [--block 50]

A tiny MLP at batch 1 under no_grad, tuned with one backend. "Direct" is the best a user's own script does
with the same runtime object: the original module for eager; ``session.run`` on a prebuilt numpy feed for ONNX
Runtime (the same ``InferenceSession``); ``InferRequest.infer(feed, share_inputs=True)`` for OpenVINO (the same
compiled model, LATENCY hint). "Tuned" is the ``tt.Module`` call, so the figure covers the whole path: the
signature lookup, the non-finite guard where the runtime needs one (OpenVINO), the backend's input mapping and
the output conversion. Calls are timed one by one in
alternating blocks (never alternating single calls: environment.md G19); the overhead is the median over
rounds of the difference of the two block medians, robust to load changing on a shared machine.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from _timing import load_average, paired_blocks
from torch import nn

import torch_tweak.torch as tt
from torch_tweak.torch import backend as backends


def tiny_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _runtime_backend(wrapped: Any) -> Any:
    """The backend that runs the wrapped module's one graph (inside the non-finite guard, if it has one)."""
    (backend,) = wrapped.backends.values()
    return backend.components()[-1]


def direct_call(name: str, backend: Any, reference: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    """The runtime's own call on the same runtime object the tuned module uses."""
    if name == "eager":
        return lambda: reference(x)
    feed = x.numpy()
    if name == "onnxruntime":
        session = backend._session.session
        inputs = {session.get_inputs()[0].name: feed}
        return lambda: session.run(None, inputs)
    request = backend._compiled_model.create_infer_request()
    return lambda: request.infer({0: feed}, share_inputs=True)


CANDIDATES: dict[str, Callable[[], Any]] = {
    "eager": lambda: backends.TorchEagerBackend(),
    "onnxruntime": lambda: backends.ONNXRuntimeBackend(),
    "openvino": lambda: backends.OpenVINOBackend(),
}


def measure(name: str, calls: int, block: int) -> dict[str, float]:
    reference, model = tiny_mlp(), tiny_mlp()
    wrapped = tt.Module(model, name=f"tiny_mlp_{name}", strategy=tt.OneBackendStrategy(CANDIDATES[name]()))
    tt.tune(wrapped, [torch.randn(16) for _ in range(4)], executor="inline")
    x = torch.randn(1, 16)
    with torch.no_grad():
        direct = direct_call(name, _runtime_backend(wrapped), reference, x)
        return paired_blocks(direct, lambda: wrapped(x), calls, block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="eager,onnxruntime,openvino", help="comma-separated: " +
                        ", ".join(CANDIDATES))
    parser.add_argument("--calls", type=int, default=4000, help="timed calls per variant")
    parser.add_argument("--block", type=int, default=50, help="calls per block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tt.config.cache_dir = tempfile.mkdtemp(prefix="tt_dispatch_")
    tt.config.progress = False
    names = [n for n in args.backends.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {list(CANDIDATES)}")
    rows = {name: measure(name, args.calls, args.block) for name in names}
    print(f"load average: {load_average():.2f}")
    print("| backend | direct µs (median) | tuned tt.Module µs | overhead µs (median of paired blocks) |")
    print("|---|---|---|---|")
    for name, m in rows.items():
        print(f"| {name} | {m['direct']:.2f} | {m['tuned']:.2f} | {m['extra']:.2f} ({m['ratio']:.2f}x throughput) |")


if __name__ == "__main__":
    main()
