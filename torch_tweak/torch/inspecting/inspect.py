"""``tt.inspect``: time every module a pipeline runs, to choose which ones to wrap."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import nn

from torch_tweak.errors import ConfigError
from torch_tweak.torch.config import config
from torch_tweak.torch.dataset import dataset_items, iter_batches
from torch_tweak.torch.module.walk import path_name, walk
from torch_tweak.utils.table import format_table

logger = logging.getLogger(__name__)


@dataclass
class ModuleInfo:
    """One module found by ``tt.inspect`` with its measured execution time.

    Attributes:
        name: path from the inspected object (``unet``, ``encoder.layer[0]``...; ``""`` is the object itself).
        module: the module.
        depth: 0 for the inspected object, +1 per module nesting level.
        parent: path of the closest enclosing module, or None.
        calls: calls during the timed iterations.
        total_time_s: inclusive time of those calls.
    """

    name: str
    module: nn.Module
    depth: int
    parent: str | None
    calls: int = 0
    total_time_s: float = 0.0
    _starts: list[float] = field(default_factory=list, repr=False)

    @property
    def mean_time_s(self) -> float:
        """Average time per call."""
        return self.total_time_s / self.calls if self.calls else 0.0

    # names used by the reference Torch Tweak (docs/migrating.md)

    @property
    def execution_count(self) -> int:
        """Same as :attr:`calls`."""
        return self.calls

    @property
    def total_execution_time(self) -> float:
        """Same as :attr:`total_time_s` (seconds)."""
        return self.total_time_s

    @property
    def average_execution_time(self) -> float:
        """Same as :attr:`mean_time_s` (seconds)."""
        return self.mean_time_s

    @property
    def module_type(self) -> str:
        """The module's class name."""
        return type(self.module).__name__

    @property
    def num_layers(self) -> int:
        """Number of direct child modules."""
        return sum(1 for _ in self.module.children())

    @property
    def num_parameters(self) -> int:
        """Number of parameter elements."""
        return sum(p.numel() for p in self.module.parameters())

    @property
    def precisions(self) -> list[str]:
        """Distinct parameter dtypes."""
        return sorted({str(p.dtype).removeprefix("torch.") for p in self.module.parameters()})


class InspectionReport:
    """The modules ``tt.inspect`` found, with their share of the total time."""

    def __init__(self, modules: list[ModuleInfo], total_time_s: float, min_depth: int) -> None:
        self.modules = modules
        self.total_time_s = total_time_s
        self.min_depth = min_depth

    def share(self, info: ModuleInfo) -> float:
        """Percentage of the inspected runs' wall time spent in ``info`` (inclusive)."""
        return 100.0 * info.total_time_s / self.total_time_s if self.total_time_s > 0 else 0.0

    def get_modules(self, min_execution_percentage: float | None = None, limit: int | None = None) -> list[ModuleInfo]:
        """The outermost executed modules at depth >= ``min_depth``, heaviest first.

        Args:
            min_execution_percentage: keep modules taking at least this fraction of the total time, as in the
                reference Torch Tweak: ``0.1`` means 10 %. A value above 1 is refused (write 5 % as ``0.05``).
            limit: return at most this many.
        """
        fraction = min_execution_percentage
        number = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
        if fraction is not None and (not number or not 0 <= fraction <= 1):
            hint = f" (for {fraction:g} % write {fraction / 100:g})" if number and 1 < fraction <= 100 else ""
            raise ConfigError(f"min_execution_percentage is a fraction of the total time in [0, 1] (0.1 means 10 %), "
                              f"got {fraction!r}{hint}.")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"limit must be a positive integer or None, got {limit!r}.")
        threshold = 100.0 * (fraction or 0.0)
        selected = [m for m in self.modules if m.calls and m.depth >= self.min_depth and self.share(m) >= threshold]
        names = {m.name for m in selected}
        by_name = {m.name: m for m in self.modules}
        outermost = [m for m in selected if not _has_ancestor_in(m, names, by_name)]
        outermost.sort(key=lambda m: (-m.total_time_s, m.depth, m.name))
        return outermost[:limit] if limit is not None else outermost

    def table(self) -> str:
        """The report as a text table."""
        headers = ["module", "type", "depth", "calls", "total ms", "mean ms", "share %", "params", "precisions"]
        rows = [
            [m.name or "<root>", type(m.module).__name__, m.depth, m.calls, f"{m.total_time_s * 1e3:.2f}",
             f"{m.mean_time_s * 1e3:.3f}", f"{self.share(m):.1f}", m.num_parameters, ",".join(m.precisions)]
            for m in sorted(self.modules, key=lambda m: (m.depth, -m.total_time_s))
            if m.calls
        ]
        return format_table(headers, rows, title=f"Inspected modules (total {self.total_time_s * 1e3:.1f} ms)")

    def describe(self, file: TextIO | None = None) -> None:
        """Print the table (to stdout unless ``file`` is given)."""
        print(self.table(), file=file or sys.stdout)

    def __str__(self) -> str:
        return self.table()


def _has_ancestor_in(info: ModuleInfo, names: set[str], by_name: dict[str, ModuleInfo]) -> bool:
    parent = info.parent
    while parent is not None:
        if parent in names:
            return True
        parent = by_name[parent].parent if parent in by_name else None
    return False


def inspect(
    obj: Any,
    dataset: Any,
    inference_function: Callable[..., Any] | None = None,
    number_of_iterations: int = 10,
    warmup_iterations: int = 5,
    min_depth: int = 0,
    max_depth: int = 5,
) -> InspectionReport:
    """Run ``inference_function`` (default: ``obj``) over ``dataset`` at batch size 1 and time every module.

    Every module reachable from ``obj`` (attributes, dicts, lists, child modules; each visited once) gets
    timing hooks; they are removed afterwards, also when the pipeline raises (the error propagates).
    """
    for name, value, low in (("number_of_iterations", number_of_iterations, 1), ("warmup_iterations", warmup_iterations, 0),
                             ("min_depth", min_depth, 0), ("max_depth", max_depth, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}.")
    run = inference_function if inference_function is not None else obj
    if not callable(run):
        raise ConfigError(f"{type(obj).__name__} is not callable; pass inference_function=... to run it.")
    items = dataset_items(dataset)
    calls = list(iter_batches(items, 1))
    infos = [ModuleInfo(f.name, f.module, f.depth, path_name(f.parent) if f.parent is not None else None)
             for f in walk(obj, max_depth=max_depth)]
    if config.inspect_debug:
        for info in infos:
            logger.debug("inspect visits %s (%s, depth %d)", info.name or "<root>", type(info.module).__name__, info.depth)
    handles = []
    try:
        for info in infos:
            handles.append(info.module.register_forward_pre_hook(_pre(info)))
            handles.append(info.module.register_forward_hook(_post(info), always_call=True))
        with torch.no_grad():
            for i in range(warmup_iterations):
                args, kwargs = calls[i % len(calls)]
                run(*args, **kwargs)
            for info in infos:
                info.calls, info.total_time_s, info._starts = 0, 0.0, []
            start = time.perf_counter()
            for i in range(number_of_iterations):
                args, kwargs = calls[i % len(calls)]
                run(*args, **kwargs)
            total = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    if config.inspect_debug:
        for info in infos:
            if info.calls:
                logger.debug("inspect: %s%s ran %d time(s), %.3f ms", "  " * info.depth, info.name or "<root>",
                             info.calls, info.total_time_s * 1e3)
    return InspectionReport(infos, total, min_depth)


def _pre(info: ModuleInfo) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        info._starts.append(time.perf_counter())

    return hook


def _post(info: ModuleInfo) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if info._starts:
            info.total_time_s += time.perf_counter() - info._starts.pop()
            info.calls += 1

    return hook
