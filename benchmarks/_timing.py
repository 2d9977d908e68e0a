"""Shared helpers for the benchmark scripts (median of blocks, spread, paired blocks, machine load, CPU)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def time_calls(fn: Callable[[], Any], calls: int, blocks: int = 7, warmup: int = 50) -> tuple[float, float]:
    """Median and spread (max - min over blocks) of the per-call time in µs."""
    for _ in range(warmup):
        fn()
    per_block = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_block.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_block), max(per_block) - min(per_block)


def load_average() -> float:
    """1-minute load average (a hint that another job shares the machine)."""
    return os.getloadavg()[0]


def call_times(fn: Callable[[], Any], n: int) -> list[float]:
    """Per-call wall times in µs, each call timed on its own."""
    times = []
    for _ in range(n):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1000)
    return times


def paired_blocks(direct: Callable[[], Any], tuned: Callable[[], Any], calls: int, block: int) -> dict[str, float]:
    """Time both callables in alternating blocks of ``block`` calls (order swapped every round).

    Returns the overall medians (µs) and, robust to load changing over time (a shared machine), the median
    over rounds of the per-round difference and ratio of the two block medians.
    """
    for fn in (direct, tuned):
        call_times(fn, 200)
    all_d: list[float] = []
    all_t: list[float] = []
    diffs, ratios = [], []
    for round_ in range(max(1, calls // block)):
        pair = [("d", direct), ("t", tuned)]
        medians = {}
        for name, fn in pair if round_ % 2 == 0 else pair[::-1]:
            times = call_times(fn, block)
            (all_d if name == "d" else all_t).extend(times)
            medians[name] = statistics.median(times)
        diffs.append(medians["t"] - medians["d"])
        ratios.append(medians["d"] / medians["t"])
    return {
        "direct": statistics.median(all_d),
        "tuned": statistics.median(all_t),
        "extra": statistics.median(diffs),
        "ratio": statistics.median(ratios),
    }


def cpu_description() -> str:
    """The CPU model and its vector and matrix ISA flags, for the head of a benchmark's output."""
    from torch_tweak.torch.environment import cpu_info, isa_flags

    flags = [f for f in (isa_flags() or []) if f.startswith(("avx512", "amx", "avx_vnni"))]
    return f"{cpu_info().model}; ISA: {', '.join(flags) or 'no AVX-512/AMX'}"
