"""Shared timing helpers for the benchmark scripts (median of blocks, spread, machine load)."""

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
