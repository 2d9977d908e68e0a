"""Process start → first output of a model loaded with ``tt.load``, per backend, for a small CNN and a BERT-shaped encoder.

    python benchmarks/load.py [--models cnn,encoder] [--backends eager,openvino,onnxruntime,aot,inductor,torchao]
                              [--repeats 3] [--untrusted]

The parent process tunes each model once per backend (that backend alone) and saves a checkpoint. Then, for
each backend, fresh Python processes each import torch_tweak, build the model, call ``tt.load`` (with
``trust_native_code=True``: the run's own checkpoints) and run one inference, timing ``tt.load``, the first
inference and the whole from the moment the parent started the process (interpreter start, imports and
building the model included). A last process counts every compile event: calls of ``torch.compile``,
``torch.export.export``, AOTInductor compilation and OpenVINO conversion, Dynamo frames, and Inductor FX-graph
cache misses (OpenVINO compiling its IR for the device is not compiling from PyTorch). The first process of
each backend gets an empty Inductor cache, like the first load on a new machine; the ``--repeats`` processes
after it share that cache (warmed only by the first load, never by tuning), like every later start on that
machine. ``--untrusted`` adds rows for the Inductor and TorchAO checkpoints loaded without
``trust_native_code`` (their warm-load packages are native code, so those load by compiling).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

BACKENDS = {
    "eager": "TorchEagerBackend",
    "openvino": "OpenVINOBackend",
    "onnxruntime": "ONNXRuntimeBackend",
    "aot": "TorchInductorAOTBackend",
    "inductor": "TorchInductorBackend",
    "torchao": "TorchAOBackend",
}


def small_cnn(seed: int = 0) -> nn.Module:
    """Two convolutions, pooling and a linear head; input ``[N, 3, 32, 32]``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10),
    ).eval()


class Encoder(nn.Module):
    """transformers ``BertModel`` with a BERT-shaped config scaled down (4 layers, hidden 256, 4 heads), returning
    ``last_hidden_state`` for token ids ``[N, 32]``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(seed)
        config = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.eval()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).last_hidden_state


MODELS = {
    "cnn": (small_cnn, lambda n: torch.randn(n, 3, 32, 32), "small CNN, input [1, 3, 32, 32]"),
    "encoder": (Encoder, lambda n: torch.randint(0, 1000, (n, 32)),
                "BERT-shaped encoder (4 layers, hidden 256), token ids [1, 32]"),
}


def count_compilations() -> dict[str, int]:
    """Wrap the entry points that compile from PyTorch so that every call is counted."""
    import torch._inductor
    import torch.export

    counts = {"torch.compile": 0, "torch.export": 0, "aoti_compile": 0, "openvino_convert": 0}
    targets = [(torch, "compile", "torch.compile"), (torch.export, "export", "torch.export"),
               (torch._inductor, "aoti_compile_and_package", "aoti_compile")]
    try:
        from torch_tweak.torch.backend.openvino import converter

        targets.append((converter, "to_ov_model", "openvino_convert"))
    except ImportError:
        pass
    for owner, name, key in targets:
        original = getattr(owner, name)

        def counted(*args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        setattr(owner, name, counted)
    return counts


def child(model_name: str, checkpoint: str, count: bool, trusted: bool, spawned: float) -> None:
    """Run in a fresh process: load, infer once, print timings (or compilation counts) as JSON.

    Timed runs install no counters, because the counters import ``torch._inductor`` and ``torch.export``,
    whose import time belongs to the load of the backends that need them.
    """
    import torch_tweak.torch as tt

    counts = count_compilations() if count else {}
    build, make_input, _ = MODELS[model_name]
    model = build(seed=1)
    x = make_input(1)
    start = time.perf_counter()
    loaded = tt.load(model, checkpoint, trust_native_code=trusted)
    load_s = time.perf_counter() - start
    with torch.no_grad():
        loaded(x)
    first_s = time.perf_counter() - start - load_s
    total_s = time.time() - spawned
    frames = misses = 0
    if "torch._dynamo" in sys.modules:  # read after timing: importing it here costs the timed part nothing
        from torch._dynamo.utils import counters

        frames = int(sum(counters["frames"].values()))
        misses = int(counters["inductor"]["fxgraph_cache_miss"])
    print(json.dumps({"load_s": load_s, "first_s": first_s, "total_s": total_s, "compiles": counts,
                      "dynamo_frames": frames, "inductor_misses": misses, "state": loaded.state.name}))


def tune_and_save(model_name: str, name: str, folder: Path) -> Path:
    import torch_tweak.torch as tt
    from torch_tweak.torch import backend as backends

    build, make_input, _ = MODELS[model_name]
    wrapped = tt.Module(build(), name=f"{model_name}_{name}",
                        strategy=tt.OneBackendStrategy(getattr(backends, BACKENDS[name])()))
    tt.tune(wrapped, [make_input(1)[0] for _ in range(4)], batch_sizes=[1, 2])
    return tt.save(wrapped, folder / f"{model_name}_{name}.tt")


def run_children(model_name: str, checkpoint: Path, cache: str, repeats: int, trusted: bool) -> list[dict]:
    """Cold run, ``repeats`` timed runs sharing the Inductor cache, then one run that counts compile events."""
    runs = []
    for i in range(repeats + 2):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        command = [sys.executable, __file__, "--child", model_name, str(checkpoint), "--spawned", repr(time.time())]
        command += (["--count"] if i > repeats else []) + ([] if trusted else ["--untrusted"])
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"{checkpoint.name}: the loading process failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs


def row(label: str, runs: list[dict], checkpoint: Path) -> str:
    cold, warm, counted = runs[0], runs[1:-1], runs[-1]
    counts = {k: v for k, v in counted["compiles"].items() if v}
    if counted["dynamo_frames"]:
        counts["dynamo frames"] = counted["dynamo_frames"]
    if counted.get("inductor_misses"):
        counts["inductor cache misses"] = counted["inductor_misses"]
    compiled = "no" if not counts else "yes: " + ", ".join(f"{k} ×{v}" for k, v in counts.items())
    return (f"| {label} | {cold['total_s']:.2f} | {statistics.median(r['total_s'] for r in warm):.2f} | "
            f"{statistics.median(r['load_s'] for r in warm):.3f} | {statistics.median(r['first_s'] for r in warm):.3f} "
            f"| {compiled} | {warm[0]['state']}, {checkpoint.stat().st_size / 1024:.0f} KiB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--untrusted", action="store_true", help="also load Inductor/TorchAO without trust_native_code")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "CHECKPOINT"), help=argparse.SUPPRESS)
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.count, not args.untrusted, args.spawned or time.time())
        return
    import torch_tweak.torch as tt

    folder = Path(tempfile.mkdtemp(prefix="tt_load_bench_"))
    tt.config.cache_dir = folder / "cache"
    tables = []
    for model_name in args.models.split(","):
        rows = []
        for name in args.backends.split(","):
            started = time.perf_counter()
            try:
                checkpoint = tune_and_save(model_name, name, folder)
            except Exception as exc:  # noqa: BLE001 - a backend that cannot tune here is reported, not fatal
                rows.append(f"| {name} | n/a | n/a | n/a | n/a | n/a | tuning failed: {type(exc).__name__}: "
                            f"{str(exc)[:80]} |")
                continue
            print(f"{model_name}/{name}: tuned and saved in {time.perf_counter() - started:.1f}s", file=sys.stderr)
            variants = [(name, True)] + ([(f"{name} (untrusted)", False)]
                                         if args.untrusted and name in ("inductor", "torchao") else [])
            for label, trusted in variants:
                cache = tempfile.mkdtemp(prefix=f"inductor_{model_name}_{name}_", dir=folder)
                rows.append(row(label, run_children(model_name, checkpoint, cache, args.repeats, trusted), checkpoint))
                print(rows[-1], file=sys.stderr)
        tables.append((model_name, rows))
    print(f"times in seconds; process start → first output: from the parent starting the process to the first output "
          f"(interpreter start, imports, building the model, tt.load, one inference at batch 1); later processes: "
          f"median of {args.repeats}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for model_name, rows in tables:
        print(f"\n{MODELS[model_name][2]}\n")
        print("| backend | process start → first output, first process (cold compiler cache) | process start → first "
              "output, later processes | tt.load | first inference | compiled at load | state, checkpoint size |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
