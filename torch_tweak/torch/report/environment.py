"""The environment block of a tuning report: what a result depends on, so it can be reproduced and compared.

It records the CPU (model, instruction-set flags that backends use, core counts), the versions of
torch_tweak and its runtimes (from package metadata: nothing is imported), and the thread settings
(torch's pools and the environment variables that size or pin the runtimes' threads). The machine is
read by ``torch_tweak.torch.environment``; this module chooses what the report keeps and lays it out.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import torch

from torch_tweak.torch import environment as environment_probe

# Instruction-set flags (``/proc/cpuinfo`` names) that change which kernels the runtimes pick.
_ISA_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "vnni", "vaes", "vpclmulqdq", "gfni", "sha_ni")
# Distribution names whose versions are recorded (absent ones are recorded as None).
_LIBRARIES = ("numpy", "openvino", "torchao", "transformers", "diffusers", "safetensors", "matplotlib")
# Environment variables that change the number or placement of runtime threads.
_THREAD_VARIABLES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME",
    "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "TORCHINDUCTOR_COMPILE_THREADS",
)


def library_versions() -> dict[str, str | None]:
    """torch_tweak, torch, Python and the optional runtimes (None when not installed)."""
    return {**environment_probe.core_versions(), "python": platform.python_version(),
            **environment_probe.distribution_versions(_LIBRARIES)}


def thread_settings() -> dict[str, Any]:
    """torch's intra- and inter-op thread counts and the thread-related environment variables that are set."""
    return {
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "environment": {name: os.environ[name] for name in _THREAD_VARIABLES if name in os.environ},
    }


def collect_environment() -> dict[str, Any]:
    """The environment block stored in every report (JSON-able)."""
    cpu = environment_probe.cpu_info()
    return {
        "cpu": {
            "model": cpu.model,
            "flags": sorted(f for f in cpu.flags if f.startswith(_ISA_PREFIXES)) if cpu.flags is not None else None,
            "logical_cores": environment_probe.logical_cores(),
            "physical_cores": cpu.physical_cores,
            "usable_cores": environment_probe.usable_cores(),
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
    executor = env.get("executor")
    if isinstance(executor, dict):
        nodes = [n for n in executor.get("nodes") or [] if isinstance(n, dict)]
        pairs.append(("executor", str(executor.get("name") or "unknown")
                      + "".join(f"; node {n.get('host')}: {n.get('cpu')}" for n in nodes)))
    return [(label, value or "none") for label, value in pairs]
