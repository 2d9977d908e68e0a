"""Deliberately broken backends for testing strategies and the fidelity check (never defaults).

``WrongOutputBackend`` adds an offset to every floating output, ``NaNBackend`` fills outputs with
NaN, ``FailingBuildBackend`` raises during build and ``WrongShapeBackend`` drops the last element
of the first axis. All run the module eagerly otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import BuildError
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.torch_eager import TorchEagerBackend
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, map_tensors


class WrongOutputBackend(TorchEagerBackend):
    """Eager, plus ``offset`` on every floating output element."""

    def __init__(self, offset: float = 1.0) -> None:
        super().__init__()
        self.offset = offset

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return map_tensors(super()._infer(*args, **kwargs),
                           lambda t: t + self.offset if t.is_floating_point() else t)


class NaNBackend(TorchEagerBackend):
    """Eager, with every floating output replaced by NaN."""

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return map_tensors(super()._infer(*args, **kwargs),
                           lambda t: torch.full_like(t, float("nan")) if t.is_floating_point() else t)


class WrongShapeBackend(TorchEagerBackend):
    """Eager, with the first axis of every output shortened by one."""

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return map_tensors(super()._infer(*args, **kwargs), lambda t: t[:-1] if t.dim() else t)


class FailingBuildBackend(TorchEagerBackend):
    """Raises :class:`BuildError` from build."""

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        sys.stdout.write("compiler output that should land in build.log\n")
        raise BuildError("deliberate build failure")
