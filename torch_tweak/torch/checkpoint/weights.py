"""The wrapped modules' own tensors: listed in the manifest, stored as safetensors when a backend needs them.

A module's tensors are its ``state_dict`` minus the parts that belong to other wrapped modules inside it
(those are stored, or not, with their own entry). Tied tensors are stored once and listed as aliases.
On load, the stored tensors replace the module's (``load_state_dict(assign=True)``, so a model built on
the ``meta`` device works too) and the replaced ones are kept until the load has succeeded, so that a
failed load can put them back.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import CheckpointError
from torch_tweak.torch.module.released import has_values
from torch_tweak.torch.module.tree import dtype_name

WEIGHT_PREFIX = "module."
BACKEND_PREFIX = "backend."


def own_tensors(module: nn.Module, nested: list[str]) -> dict[str, torch.Tensor]:
    """``module``'s state dict (tensors as they are, Parameters included) without the ``nested`` prefixes."""
    state = module.state_dict(keep_vars=True)
    prefixes = tuple(p + "." for p in nested)
    return {k: v for k, v in state.items() if not (prefixes and k.startswith(prefixes))}


def describe_tensors(tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
    """``[[name, [shape], dtype], ...]`` in state dict order."""
    return [[name, list(t.shape), dtype_name(t.dtype)] for name, t in tensors.items()]


def pack(tensors: dict[str, torch.Tensor], where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors ready for safetensors (CPU, contiguous, no shared storage) and the aliases of tied ones."""
    packed: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_object: dict[int, str] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        if id(tensor) in by_object:
            aliases[name] = by_object[id(tensor)]
            continue
        if not has_values(tensor):
            raise CheckpointError(f"{where}: the tensor {name!r} has no data to store (it is on the meta device or was "
                                  "released after tuning). Keep the weights (tt.config.device_after_tuning = None) "
                                  "when a backend needs them.")
        data = tensor.detach().to("cpu")
        pointer = data.untyped_storage().data_ptr()
        if pointer in storages or not data.is_contiguous() or data.storage_offset():
            data = data.contiguous().clone()
        storages.add(data.untyped_storage().data_ptr())
        by_object[id(tensor)] = name
        packed[name] = data
    return packed, aliases


def check_matches(module: nn.Module, nested: list[str], stored: list[tuple[str, tuple[int, ...], str]],
                  name: str, where: str) -> dict[str, torch.Tensor]:
    """Check that ``module`` has exactly the stored tensor names, shapes and dtypes; return its tensors."""
    current = own_tensors(module, nested)
    expected = {n: (shape, dtype) for n, shape, dtype in stored}
    missing = [n for n in expected if n not in current]
    extra = [n for n in current if n not in expected]
    if missing or extra:
        raise CheckpointError(
            f"Module {name!r} at {where} does not match the checkpoint: "
            + (f"the checkpoint has tensors it lacks ({missing[:5]})" if missing else "")
            + ("; " if missing and extra else "")
            + (f"it has tensors the checkpoint lacks ({extra[:5]})" if extra else "")
            + ". Load into the same model (same code and configuration) that was tuned."
        )
    for n, tensor in current.items():
        shape, dtype = expected[n]
        if tuple(tensor.shape) != shape or dtype_name(tensor.dtype) != dtype:
            raise CheckpointError(
                f"Module {name!r} at {where} does not match the checkpoint: tensor {n!r} is "
                f"{dtype_name(tensor.dtype)}{list(tensor.shape)} here and {dtype}{list(shape)} in the checkpoint. "
                "Build the model with the same configuration and dtype as when tuning."
            )
    return current


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` to ``path`` as safetensors; a full disk or unwritable folder becomes an OSError with the
    path (safetensors raises its own error type), which the save turns into a CheckpointError."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        code = re.search(r"os error (\d+)", str(exc))
        raise OSError(int(code.group(1)) if code else errno.EIO, f"writing {path} failed: {exc}") from exc


def read_safetensors(path: Path, member: str) -> dict[str, torch.Tensor]:
    """Load a verified safetensors member (never pickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"The tensor file {member} in the checkpoint cannot be read ({exc}).") from exc


def module_weights(loaded: dict[str, torch.Tensor], aliases: dict[str, str], expected: list[str],
                   name: str) -> dict[str, torch.Tensor]:
    """The module tensors from a loaded safetensors dict, aliases resolved; every expected name must be present."""
    weights = {k[len(WEIGHT_PREFIX):]: v for k, v in loaded.items() if k.startswith(WEIGHT_PREFIX)}
    for alias, target in aliases.items():
        if target not in weights:
            raise CheckpointError(f"Module {name!r}: tied tensor {alias!r} refers to {target!r}, which is not stored.")
        weights[alias] = weights[target]
    missing = [n for n in expected if n not in weights]
    if missing or set(weights) - set(expected):
        raise CheckpointError(f"Module {name!r}: the stored tensors do not match the manifest (e.g. {missing[:3]}); "
                              "the checkpoint is corrupt.")
    return weights


def check_loaded(weights: dict[str, torch.Tensor], stored: list[tuple[str, tuple[int, ...], str]], name: str) -> None:
    """The loaded tensors must have the shapes and dtypes the manifest lists."""
    for n, shape, dtype in stored:
        tensor = weights[n]
        if tuple(tensor.shape) != shape or dtype_name(tensor.dtype) != dtype:
            raise CheckpointError(f"Module {name!r}: stored tensor {n!r} is {dtype_name(tensor.dtype)}"
                                  f"{list(tensor.shape)}, the manifest says {dtype}{list(shape)}; the checkpoint "
                                  "is corrupt.")


def assign(module: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace ``module``'s tensors with ``weights``; return the replaced ones (for :func:`restore`)."""
    state = module.state_dict(keep_vars=True)
    previous = {k: state[k] for k in weights}
    module.load_state_dict(weights, strict=False, assign=True)
    return previous


def restore(module: nn.Module, previous: dict[str, torch.Tensor]) -> None:
    """Undo :func:`assign`."""
    module.load_state_dict(previous, strict=False, assign=True)


def meta_tensors(module: nn.Module, nested: list[str], covered: set[str]) -> list[str]:
    """Names of ``module``'s tensors without data (meta device or released) and not in ``covered``."""
    return [n for n, t in own_tensors(module, nested).items() if not has_values(t) and n not in covered]
