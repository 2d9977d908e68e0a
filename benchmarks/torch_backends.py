"""Build time and steady-state throughput of the PyTorch backends relative to eager.

For an MLP, a small CNN and a small transformer encoder (dict in, dict out), each backend is built on the
graph recorded at batch 1 and 32 (the encoder also at another sequence length, so its sequence axis is
dynamic), then timed at batch 1 and 32: the median latency of many calls after a warm-up, each backend and
batch size in its own block (calls of different backends are never interleaved). Eager is timed before and
after the others and the faster run is the baseline, which damps load from other processes. Inductor compiles start
from an empty ``TORCHINDUCTOR_CACHE_DIR`` unless ``--warm-cache`` is given, so build times are cold.

    .venv/bin/python benchmarks/torch_backends.py [--models mlp cnn encoder] [--seconds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.torch.backend import (
    TorchAOBackend,
    TorchEagerBackend,
    TorchInductorAOTBackend,
    TorchInductorBackend,
)
from torch_tweak.torch.module.recording import record

BACKENDS: dict[str, Callable[[], Any]] = {
    "eager": TorchEagerBackend,
    "inductor": TorchInductorBackend,
    "inductor_aot": TorchInductorAOTBackend,
    "torchao(int8dq)": TorchAOBackend,
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = nn.Conv2d(cin, cout, 1, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv2(self.conv1(x)) + self.skip(x))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.blocks = nn.Sequential(Block(32, 32), Block(32, 64), Block(64, 128))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return h + self.ffn(self.norm2(h))


class Encoder(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([EncoderLayer(dim), EncoderLayer(dim)])
        self.pool = nn.Linear(dim, dim)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = self.emb(batch["input_ids"])
        mask = batch["attention_mask"][:, None, None, :].bool()
        for layer in self.layers:
            h = layer(h, mask)
        return {"last_hidden_state": h, "pooler_output": torch.tanh(self.pool(h[:, 0]))}


def text(batch: int, seq: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 1000, (batch, seq)), "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple]]] = {
    "mlp": (MLP, lambda b: (torch.randn(b, 512),)),
    "cnn": (CNN, lambda b: (torch.randn(b, 3, 32, 32),)),
    "encoder(seq64)": (Encoder, lambda b: (text(b, 64),)),
}


def median_latency(fn: Callable[[], Any], seconds: float, min_calls: int = 20, max_calls: int = 2000) -> float:
    """Median wall time of one call (seconds), after a warm-up, over at most ``seconds`` of calls."""
    for _ in range(5):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < max_calls and (len(times) < min_calls or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(backend: Any, inputs: dict[int, tuple], seconds: float) -> dict[int, float]:
    """Median latency per batch size, one block of calls per batch size."""
    return {b: median_latency(lambda a=args: backend.infer(*a), seconds) for b, args in inputs.items()}


def run(model_names: list[str], backend_names: list[str], seconds: float, root: Path) -> list[list[str]]:
    """Build and time every backend on every model; eager is timed first and last (the faster run is the base)."""
    rows = []
    for model_name in model_names:
        factory, make_args = MODELS[model_name]
        torch.manual_seed(0)
        model = factory().eval()
        calls = [(b, (make_args(b), {})) for b in (1, 32)]
        if model_name.startswith("encoder"):
            calls.append((2, ((text(2, 17),), {})))
        [(spec, samples)] = record(model, calls)
        inputs = {b: make_args(b) for b in (1, 32)}
        results: dict[str, tuple[float, dict[int, float]] | str] = {}
        eager_runs: list[dict[int, float]] = []
        for backend_name in [*backend_names, "eager"]:
            backend = BACKENDS[backend_name]()
            start = time.perf_counter()
            try:
                backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"),
                              root / model_name / f"{backend_name}{len(results)}")
            except Exception as exc:  # report and continue with the next backend
                results[backend_name] = f"failed: {type(exc).__name__}"
                continue
            build_s = time.perf_counter() - start
            latencies = measure(backend, inputs, seconds)
            if backend_name == "eager":
                eager_runs.append(latencies)
            results.setdefault(backend_name, (build_s, latencies))
            backend.deactivate()
            print(f"  done: {model_name} / {backend_name}", file=sys.stderr, flush=True)
        base = {b: min(run[b] for run in eager_runs) for b in inputs}
        for backend_name, result in results.items():
            if isinstance(result, str):
                rows.append([model_name, backend_name, result, "", "", "", ""])
                continue
            build_s, latencies = result
            latencies = base if backend_name == "eager" else latencies
            row = [model_name, backend_name, f"{build_s:.1f}"]
            for b in inputs:
                row += [f"{b / latencies[b]:,.0f}", f"x{base[b] / latencies[b]:.2f}"]
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--seconds", type=float, default=2.0, help="measurement time per backend and batch size")
    parser.add_argument("--warm-cache", action="store_true", help="keep the existing TORCHINDUCTOR_CACHE_DIR")
    args = parser.parse_args()
    if "eager" not in args.backends:
        args.backends.insert(0, "eager")
    with tempfile.TemporaryDirectory(prefix="tt_bench_") as tmp:
        if not args.warm_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        with torch.no_grad():
            rows = run(args.models, args.backends, args.seconds, Path(tmp))
    headers = ["model", "backend", "build s", "b1 items/s", "b1 vs eager", "b32 items/s", "b32 vs eager"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; 'vs eager' = throughput / eager throughput "
          "(eager: the faster of a block before and a block after the other backends)")
    for line in [headers, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)))


if __name__ == "__main__":
    main()
