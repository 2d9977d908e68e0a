"""Dtype names, mapped through a fixed table (a name from a file never reaches ``getattr(torch, ...)``)."""

from __future__ import annotations

import torch

from torch_tweak.errors import UnsupportedInputError

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
        torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


def dtype_from_name(name: str) -> torch.dtype:
    """Map ``"float32"`` (or ``"torch.float32"``) to the dtype, from a fixed table (never ``getattr``)."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise UnsupportedInputError(f"Unknown dtype {name!r}; known dtypes: {sorted(_DTYPES)}.")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"``."""
    return str(dtype).removeprefix("torch.")
