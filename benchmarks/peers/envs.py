"""Separate virtual environments for the peers (NVIDIA AITune, Triton Model Navigator).

Each peer gets ``benchmarks/.peer_envs/<name>/venv``, built on first use from the recipe below and reused
while the recipe is unchanged (``ready.json`` holds the recipe's hash and ``pip freeze``). torch stays
2.13.0 in every environment: each pip command runs with a constraints file pinning it. A build that fails
leaves ``error.txt`` (the failing command and the end of its output) and is retried on the next run.
Nothing here touches the project's own environment or dependencies.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / ".peer_envs"
TORCH_PIN = "torch==2.13.0"
WORKLOAD_PACKAGES = ["transformers==5.24.0"]  # builds the BERT-shaped encoder from a config (no download)

RECIPES: dict[str, list[list[str]]] = {
    # AITune 0.6.0: --no-deps plus its CPU-safe requirements, and the modules it imports unconditionally
    # (triton, polygraphy, onnxruntime, modelopt). TensorRT itself is replaced by a stub at run time.
    "aitune": [
        [TORCH_PIN],
        ["--no-deps", "aitune==0.6.0"],
        ["autowrapt>=1.0", "dill>=0.3.8", "nvidia-ml-py", "numpy>=1.26.4", "pandas>=2.3", "psutil",
         "tabulate>=0.9.0", "wrapt~=2.0", "nvtx", "onnxscript>=0.2.0", "onnx-ir>=0.1.11"],
        ["--no-deps", "torchao==0.18.0"],
        ["--no-deps", "triton==3.9.0", "polygraphy"],
        ["onnxruntime"],
        ["--no-deps", "nvidia-modelopt==0.47.0"],
        ["onnx-graphsurgeon", "tqdm", "onnxslim", "lief", "requests", "omegaconf", "huggingface_hub", "pydantic",
         "pulp", "rich", "scipy", "regex"],
        WORKLOAD_PACKAGES,
    ],
    # Model Navigator 0.14.0: --no-deps plus its requirements, CPU onnxruntime instead of onnxruntime-gpu.
    "navigator": [
        [TORCH_PIN],
        ["--no-deps", "triton-model-navigator==0.14.0"],
        ["dacite~=1.8", "fire>=0.4.0", "jsonlines>=3.1.0", "loguru>=0.7.2", "numpy<2", "onnx~=1.16",
         "onnx_graphsurgeon~=0.5", "onnxruntime~=1.20", "onnxscript", "packaging~=24.1", "polygraphy>=0.49.0",
         "psutil>=5.7", "py-cpuinfo>=8.0", "pynvml~=11.5", "python-slugify~=8.0", "pyyaml~=6.0", "tabulate>=0.8",
         "tritonclient[grpc]~=2.47", "wrapt>=1.16", "pyee>=11.1.0", "rich>=13.7.1", "protobuf>=4"],
        WORKLOAD_PACKAGES,
    ],
}


@dataclass
class PeerEnv:
    """A peer's environment: its Python, or the reason it could not be built."""

    name: str
    python: Path | None
    error: str | None = None
    built_now: bool = False
    build_s: float = 0.0


def _recipe_hash(name: str) -> str:
    return hashlib.sha256(json.dumps([TORCH_PIN, RECIPES[name]]).encode()).hexdigest()[:16]


def _base_python() -> str:
    """The interpreter the project's venv was made from (same Python version, no site-packages)."""
    return getattr(sys, "_base_executable", sys.executable)


def ensure(name: str, log: bool = True) -> PeerEnv:
    """Return the peer's environment, building it first if it is missing or its recipe changed."""
    folder = ROOT / name
    venv = folder / "venv"
    python = venv / "bin" / "python"
    ready = folder / "ready.json"
    digest = _recipe_hash(name)
    if ready.is_file() and python.is_file():
        try:
            if json.loads(ready.read_text()).get("recipe") == digest:
                return PeerEnv(name, python)
        except (OSError, ValueError):
            pass
    folder.mkdir(parents=True, exist_ok=True)
    ready.unlink(missing_ok=True)
    (folder / "error.txt").unlink(missing_ok=True)
    start = time.perf_counter()
    constraints = folder / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    commands = [[_base_python(), "-m", "venv", "--clear", str(venv)]]
    commands += [[str(python), "-m", "pip", "install", "-q", "-c", str(constraints), *step] for step in RECIPES[name]]
    with open(folder / "build.log", "w") as out:
        for command in commands:
            if log:
                print(f"  [{name} env] {' '.join(command[3:] if 'pip' in command else command)}", flush=True)
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0:
                tail = (folder / "build.log").read_text()[-1500:]
                error = f"environment build failed at `{' '.join(command[-3:])}`: {tail.strip().splitlines()[-1]}"
                (folder / "error.txt").write_text(error + "\n\n" + tail)
                return PeerEnv(name, None, error, True, time.perf_counter() - start)
    freeze = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    torch_line = next((line for line in freeze.splitlines() if line.lower().startswith("torch==")), "")
    if not torch_line.startswith(TORCH_PIN):
        error = f"environment build replaced torch ({torch_line or 'torch missing'})"
        (folder / "error.txt").write_text(error + "\n")
        return PeerEnv(name, None, error, True, time.perf_counter() - start)
    ready.write_text(json.dumps({"recipe": digest, "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                 "freeze": freeze.splitlines()}, indent=1))
    return PeerEnv(name, python, None, True, time.perf_counter() - start)


if __name__ == "__main__":
    for peer in sys.argv[1:] or list(RECIPES):
        env = ensure(peer)
        print(peer, env.python or env.error, f"{env.build_s:.0f}s")
