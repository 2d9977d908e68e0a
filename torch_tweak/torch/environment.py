"""Reading the machine and the installed runtimes, for every record of where a result was produced.

Checkpoint manifests (to warn when a checkpoint is loaded on another CPU or with other versions) and
tuning reports (to reproduce and compare results) both record the CPU and library versions. Each
chooses what it keeps and how it lays it out; both read the machine here. Versions come from package
metadata, so no optional runtime is imported.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from torch_tweak.__version__ import __version__

CPUINFO = Path("/proc/cpuinfo")
#: Instruction-set flags that records keep (checkpoint manifests, warm-load fingerprints): code compiled on a CPU
#: with one of them may not run, or may run another kernel, on a CPU without it.
ISA_FLAGS = (
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
)


@dataclass(frozen=True)
class CpuInfo:
    """What the system tells about the CPU; None where it does not (``/proc/cpuinfo`` exists on Linux only).

    Attributes:
        model: the model name (``platform.processor()`` where ``/proc/cpuinfo`` is missing).
        flags: every instruction-set flag, ``/proc/cpuinfo`` names (``avx2``, ``avx512_bf16``, ``amx_tile``...).
        physical_cores: distinct (socket, core) pairs.
    """

    model: str | None
    flags: frozenset[str] | None
    physical_cores: int | None


@functools.cache
def cpu_info() -> CpuInfo:
    """The CPU's model, flags and physical core count (read once; the first processor's model and flags)."""
    try:
        text = CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return CpuInfo(platform.processor() or None, None, None)
    model: str | None = None
    flags: frozenset[str] | None = None
    cores: set[tuple[str, str]] = set()
    physical_id = "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model is None:
            model = value
        elif key == "flags" and flags is None:
            flags = frozenset(value.split())
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
    return CpuInfo(model, flags, len(cores) or None)


def isa_flags() -> list[str] | None:
    """The :data:`ISA_FLAGS` this CPU has, sorted (None where the system does not tell)."""
    flags = cpu_info().flags
    return None if flags is None else sorted(f for f in ISA_FLAGS if f in flags)


def int8_dot_saturates() -> bool:
    """True on an x86 CPU without VNNI or AMX: int8 matrix kernels there add pairs of u8 x s8 products in int16
    (``vpmaddubsw``), which saturates when both are large, so 8-bit weights lose accuracy where 7-bit ones do
    not (measured with ONNX Runtime's dynamic int8 on an AVX2 EPYC: relative L2 0.157 for a 64-128-64 MLP, the
    int8 tolerance being 0.15). False on other CPUs and where the flags are unknown."""
    flags = cpu_info().flags
    if not flags or "sse4_1" not in flags:
        return False
    return not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


def logical_cores() -> int | None:
    """Logical cores of the machine (None if unknown)."""
    return os.cpu_count()


def usable_cores() -> int | None:
    """Logical cores this process may run on (its affinity mask; all of them where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def core_versions() -> dict[str, str]:
    """The versions of torch_tweak and of the torch it runs with."""
    return {"torch_tweak": __version__, "torch": torch.__version__}


@functools.cache
def distribution_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (None when it is not installed), read once from its metadata."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def distribution_versions(distributions: Iterable[str]) -> dict[str, str | None]:
    """``{distribution: version or None}``, in the given order."""
    return {name: distribution_version(name) for name in distributions}
