"""The environment block of a tuning report: what a result depends on, so it can be reproduced and compared.

It records the CPU (model, instruction-set flags that backends use, core counts), the versions of
torch_tweak and its runtimes (from package metadata: nothing is imported), and the thread settings
(torch's pools and the environment variables that size or pin the runtimes' threads).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from torch_tweak.__version__ import __version__

# Instruction-set flags (``/proc/cpuinfo`` names) that change which kernels the runtimes pick.
_ISA_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "vnni", "vaes", "vpclmulqdq", "gfni", "sha_ni")
# Distribution names whose versions are recorded (absent ones are recorded as None).
_LIBRARIES = ("numpy", "openvino", "torchao", "transformers", "diffusers", "safetensors", "matplotlib")
# Environment variables that change the number or placement of runtime threads.
_THREAD_VARIABLES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME",
    "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "TORCHINDUCTOR_COMPILE_THREADS",
)


@functools.cache
def _cpuinfo() -> tuple[str | None, tuple[str, ...] | None, int | None]:
    """CPU model, ISA flags and physical core count from ``/proc/cpuinfo`` (None where unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or None, None, None
    model: str | None = None
    flags: set[str] | None = None
    cores: set[tuple[str, str]] = set()
    physical_id = "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model is None:
            model = value
        elif key == "flags" and flags is None:
            flags = set(value.split())
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
    isa = tuple(sorted(f for f in flags if f.startswith(_ISA_PREFIXES))) if flags is not None else None
    return model, isa, len(cores) or None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    """torch_tweak, torch, Python and the optional runtimes (None when not installed)."""
    versions: dict[str, str | None] = {"torch_tweak": __version__, "torch": torch.__version__,
                                       "python": platform.python_version()}
    versions.update({name: _version(name) for name in _LIBRARIES})
    return versions


def thread_settings() -> dict[str, Any]:
    """torch's intra- and inter-op thread counts and the thread-related environment variables that are set."""
    return {
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "environment": {name: os.environ[name] for name in _THREAD_VARIABLES if name in os.environ},
    }


def collect_environment() -> dict[str, Any]:
    """The environment block stored in every report (JSON-able)."""
    model, flags, physical = _cpuinfo()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "cpu": {
            "model": model,
            "flags": list(flags) if flags is not None else None,
            "logical_cores": os.cpu_count(),
            "physical_cores": physical,
            "usable_cores": usable,
        },
        "platform": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                     "python_implementation": sys.implementation.name},
        "versions": library_versions(),
        "threads": thread_settings(),
    }


def describe_environment(env: dict[str, Any]) -> list[tuple[str, str]]:
    """``(label, value)`` pairs summarizing an environment block (tolerates missing keys)."""
    cpu = env.get("cpu") or {}
    versions = env.get("versions") or {}
    threads = env.get("threads") or {}
    flags = cpu.get("flags")
    pairs = [
        ("CPU", str(cpu.get("model") or "unknown")),
        ("cores", f"{cpu.get('physical_cores') or '?'} physical, {cpu.get('logical_cores') or '?'} logical, "
                  f"{cpu.get('usable_cores') or '?'} usable"),
        ("ISA flags", ", ".join(f for f in flags if f.startswith(("avx512", "amx", "avx_vnni", "avx2")))
         if isinstance(flags, list) else "unknown"),
        ("threads", f"torch {threads.get('torch_num_threads', '?')} intra-op, "
                    f"{threads.get('torch_num_interop_threads', '?')} inter-op"
                    + "".join(f"; {k}={v}" for k, v in (threads.get("environment") or {}).items())),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if v)),
    ]
    return [(label, value or "none") for label, value in pairs]
