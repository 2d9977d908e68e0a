"""Process-wide torch settings a third-party call may change, put back as they were.

Why: ``torchao.quantization.quantize_`` applies torchao's recommended Inductor settings and float32 matmul precision
to the whole process; other tuned modules must keep theirs, and Inductor's compiled-graph cache keys on both (a
changed field makes every later Inductor build in the process miss it). The TorchAO backend (``torchao.py``) runs
``quantize_`` inside :func:`isolated_inductor_config` and passes the Inductor settings to its own compile instead.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


@contextlib.contextmanager
def isolated_inductor_config(changes: dict[str, Any]) -> Any:
    """Undo global Inductor/matmul settings made inside the block; record the Inductor ones in ``changes``."""
    from torch._inductor import config as inductor_config

    before = inductor_config.get_config_copy()
    precisions = _matmul_precisions()
    try:
        yield
    finally:
        after = inductor_config.get_config_copy()
        changes.update({k: v for k, v in after.items() if k in before and before[k] != v})
        if changes:
            inductor_config.load_config({k: before[k] for k in changes})
        _restore_matmul_precisions(precisions)


#: Where torch keeps float32 matmul precision (``set_float32_matmul_precision`` sets the backends' fields too).
_PRECISION_FIELDS = ("mkldnn.matmul", "cuda.matmul")


def _matmul_precisions() -> dict[str, str]:
    """The float32 matmul precision and the per-backend ``fp32_precision`` fields this torch has."""
    found = {"": torch.get_float32_matmul_precision()}
    for name in _PRECISION_FIELDS:
        backend, _, op = name.partition(".")
        holder = getattr(getattr(torch.backends, backend, None), op, None)
        if holder is not None and hasattr(holder, "fp32_precision"):
            found[name] = holder.fp32_precision
    return found


def _restore_matmul_precisions(saved: dict[str, str]) -> None:
    """Put back what :func:`_matmul_precisions` saved, only where it changed: setting the precision again is not a
    no-op (``set_float32_matmul_precision("highest")`` turns the backends' ``"none"`` into ``"ieee"``, and Inductor's
    compiled-graph cache keys on them: a TorchAO build made every later Inductor build in the process miss the cache)."""
    if _matmul_precisions() == saved:
        return
    if torch.get_float32_matmul_precision() != saved[""]:
        torch.set_float32_matmul_precision(saved[""])
    for name, value in saved.items():
        if name:
            backend, _, op = name.partition(".")
            getattr(getattr(torch.backends, backend), op).fp32_precision = value
