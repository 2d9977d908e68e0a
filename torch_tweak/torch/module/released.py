"""Weights that no chosen backend needs: their memory is freed, their place in the module stays.

Libraries ask a model where it lives by looking at its parameters: diffusers' ``pipe.device`` and
``pipe.dtype``, transformers' ``model.device`` and ``model.dtype``, ``next(module.parameters())``. Moving
released weights to the ``meta`` device answered "meta" to all of them, so a pipeline built its next
inputs on ``meta`` and the tuned module received tensors without data. Here each released tensor is
replaced by a :class:`ReleasedTensor`: a tensor subclass without storage that keeps the original shape,
strides, dtype, device and ``requires_grad``, so every question about placement gets the answer it got
before tuning and ``state_dict()`` keeps its keys. Anything that needs the values (arithmetic, a copy,
``torch.save``, safetensors, a dtype conversion) raises :class:`ReleasedWeightError`, which names the module
and the tensor and says how to keep the weights.

Only the entries of the released module are replaced; a tensor it shares with a module outside (a tied
embedding) stays alive and correct there. Submodules wrapped by their own ``tt.Module`` keep their tensors:
they may be called on their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import ReleasedWeightError

# Operations that only make another view of the same (absent) data; nn.Parameter and ``module.to`` use them.
_VIEW_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class ReleasedTensor(torch.Tensor):
    """A placeholder with the metadata of a released tensor and no data (see the module docstring)."""

    _tt_owner: str
    _tt_name: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, owner: str, name: str) -> ReleasedTensor:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), storage_offset=like.storage_offset(), dtype=like.dtype,
            device=like.device, layout=like.layout, requires_grad=like.requires_grad)
        tensor._tt_owner, tensor._tt_name = owner, name
        return tensor

    def __init__(self, like: torch.Tensor, owner: str, name: str) -> None:
        super().__init__()

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"ReleasedTensor({self._tt_owner}.{self._tt_name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device})")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        first = args[0] if args else None
        if func in _VIEW_OPS and isinstance(first, ReleasedTensor):
            return ReleasedTensor(first, first._tt_owner, first._tt_name)
        released = next((a for a in _flat(args, kwargs) if isinstance(a, ReleasedTensor)), None)
        raise _needs_values(released, f"the operation {func}")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _needs_values(self, "pickling (torch.save)")

    def storage(self) -> Any:  # type: ignore[override]
        raise _needs_values(self, "reading its storage")

    def untyped_storage(self) -> Any:  # type: ignore[override]
        raise _needs_values(self, "reading its storage")

    def numpy(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise _needs_values(self, "converting it to numpy")

    def tolist(self) -> Any:  # type: ignore[override]
        raise _needs_values(self, "reading its values")


def _flat(args: tuple[Any, ...], kwargs: Any) -> list[Any]:
    items: list[Any] = []
    for value in list(args) + list((kwargs or {}).values()):
        items.extend(value if isinstance(value, (list, tuple)) else [value])
    return items


def _needs_values(tensor: ReleasedTensor | None, what: str) -> ReleasedWeightError:
    where = f"{tensor._tt_owner!r} tensor {tensor._tt_name!r}" if tensor is not None else "a released tensor"
    return ReleasedWeightError(
        f"Module {where} has no values: {what} needs them, but they were released after tuning because no "
        "chosen backend uses the module's original weights (tt.config.device_after_tuning = 'release'). Set "
        "tt.config.device_after_tuning = None before tt.tune or tt.load to keep them, or build the model again "
        "to get them back.")


def has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds data (not on the meta device and not released)."""
    return not tensor.is_meta and not isinstance(tensor, ReleasedTensor)


def release(module: nn.Module, owner: str, keep: Callable[[nn.Module], bool]) -> int:
    """Replace the parameters and buffers of ``module`` and of its submodules (except those ``keep`` selects,
    and theirs) by placeholders; tied tensors stay tied. Returns the number of tensors released."""
    done: dict[int, torch.Tensor] = {}
    for prefix, sub in _released_modules(module, keep):
        for table, make in ((sub._parameters, _parameter), (sub._buffers, _buffer)):
            for name, tensor in list(table.items()):
                if tensor is None or not has_values(tensor):
                    continue
                if id(tensor) not in done:
                    done[id(tensor)] = make(tensor, owner, prefix + name)
                table[name] = done[id(tensor)]
    return len(done)


def _released_modules(module: nn.Module, keep: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, sub = stack.pop()
        if id(sub) in seen or (sub is not module and keep(sub)):
            continue
        seen.add(id(sub))
        found.append((prefix, sub))
        stack.extend((f"{prefix}{name}.", child) for name, child in sub._modules.items() if child is not None)
    return found


def _parameter(tensor: torch.Tensor, owner: str, name: str) -> torch.Tensor:
    return nn.Parameter(ReleasedTensor(tensor.detach(), owner, name), requires_grad=tensor.requires_grad)


def _buffer(tensor: torch.Tensor, owner: str, name: str) -> torch.Tensor:
    return ReleasedTensor(tensor.detach(), owner, name)
