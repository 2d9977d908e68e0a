"""Time from ``tt.load`` to the first inference in a fresh process, per backend, for a small CNN.

    python benchmarks/load.py [--backends eager,openvino,aot,inductor,torchao] [--repeats 3]

The parent process tunes the CNN once per backend (that backend alone) and saves a checkpoint. Then, for
each backend, fresh Python processes each build the model, call ``tt.load`` and run one inference, timing
both, and count every way of compiling from PyTorch: ``torch.compile``, ``torch.export.export``,
AOTInductor compilation, OpenVINO conversion and Dynamo frames (OpenVINO compiling its IR for the device
is not compiling from PyTorch). The first process of each backend gets an empty Inductor cache, like the
first load on a new machine; the ``--repeats`` processes after it share that cache (warmed only by the
first load, never by tuning), like every later start on that machine.
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


def child(backend: str, checkpoint: str, count: bool) -> None:
    """Run in a fresh process: load, infer once, print timings (or compilation counts) as JSON.

    Timed runs install no counters, because the counters import ``torch._inductor`` and ``torch.export``,
    whose import time belongs to the load of the backends that need them.
    """
    import torch_tweak.torch as tt

    counts = count_compilations() if count else {}
    model = small_cnn(seed=1)
    x = torch.randn(1, 3, 32, 32)
    start = time.perf_counter()
    loaded = tt.load(model, checkpoint)
    load_s = time.perf_counter() - start
    with torch.no_grad():
        loaded(x)
    first_s = time.perf_counter() - start - load_s
    frames = 0
    if "torch._dynamo" in sys.modules:  # read after timing: importing it here costs the timed part nothing
        from torch._dynamo.utils import counters

        frames = int(sum(counters["frames"].values()))
    print(json.dumps({"load_s": load_s, "first_s": first_s, "compiles": counts, "dynamo_frames": frames,
                      "state": loaded.state.name}))


def tune_and_save(name: str, folder: Path) -> Path:
    import torch_tweak.torch as tt
    from torch_tweak.torch import backend as backends

    wrapped = tt.Module(small_cnn(), name=f"cnn_{name}",
                        strategy=tt.OneBackendStrategy(getattr(backends, BACKENDS[name])()))
    tt.tune(wrapped, [torch.randn(3, 32, 32) for _ in range(4)], batch_sizes=[1, 2])
    return tt.save(wrapped, folder / f"{name}.tt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "CHECKPOINT"), help=argparse.SUPPRESS)
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.count)
        return
    import torch_tweak.torch as tt

    folder = Path(tempfile.mkdtemp(prefix="tt_load_bench_"))
    tt.config.cache_dir = folder / "cache"
    rows = []
    for name in args.backends.split(","):
        try:
            checkpoint = tune_and_save(name, folder)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot tune here is reported, not fatal
            rows.append(f"| {name} | n/a | n/a | n/a | n/a | n/a | tuning failed: {type(exc).__name__}: {str(exc)[:80]} |")
            continue
        cache = tempfile.mkdtemp(prefix=f"inductor_{name}_", dir=folder)
        runs = []
        for i in range(args.repeats + 2):  # cold, timed repeats, then one run that counts compilations
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            command = [sys.executable, __file__, "--child", name, str(checkpoint)] + (["--count"] if i > args.repeats else [])
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"{name}: the loading process failed:\n{proc.stderr[-3000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        cold, warm, counted = runs[0], runs[1:-1], runs[-1]
        counts = {k: v for k, v in counted["compiles"].items() if v}
        if counted["dynamo_frames"]:
            counts["dynamo frames"] = counted["dynamo_frames"]
        compiled = "no" if not counts else "yes: " + ", ".join(f"{k} ×{v}" for k, v in counts.items())
        rows.append(
            f"| {name} | {cold['load_s'] + cold['first_s']:.2f} | {statistics.median(r['load_s'] for r in warm):.3f} | "
            f"{statistics.median(r['first_s'] for r in warm):.3f} | "
            f"{statistics.median(r['load_s'] + r['first_s'] for r in warm):.3f} | {compiled} | "
            f"{warm[0]['state']}, {checkpoint.stat().st_size / 1024:.0f} KiB |")
    print(f"small CNN, input [1, 3, 32, 32]; times in seconds from tt.load to the first output in a fresh process; "
          f"later processes: median of {args.repeats}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print("| backend | first process on the machine (cold compiler cache) | later processes: tt.load | first inference "
          "| load → first output | compiled from PyTorch at load | state, checkpoint size |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
