"""Hugging Face transformers: static KV caches are traversed as tensors.

``ModelOutput`` objects need nothing special (they are dict subclasses and come back with their
type). ``StaticCache`` and its layers are registered as containers so their key/value tensors take part
in graph identity, recorded shapes and fidelity checks. Dynamic caches stay opaque objects passed
through unchanged (only backends that run the PyTorch module, such as eager, can use them).
"""

from __future__ import annotations

import logging
from typing import Any

from torch_tweak.torch.module.tree import register_container

logger = logging.getLogger(__name__)


def _layers(cache: Any) -> dict[str, Any]:
    return {"layers": list(cache.layers)}


def _kv(layer: Any) -> dict[str, Any]:
    return {"keys": layer.keys, "values": layer.values}


def register() -> None:
    """Register transformers' static cache classes (if this transformers version has them)."""
    try:
        from transformers import cache_utils
    except ImportError:  # pragma: no cover - transformers without cache utilities
        return
    for name, fields in (("StaticCache", _layers), ("StaticLayer", _kv), ("StaticSlidingWindowLayer", _kv)):
        cls = getattr(cache_utils, name, None)
        if isinstance(cls, type):
            register_container(cls, fields)
            logger.debug("Registered transformers.%s as a tensor container", name)
