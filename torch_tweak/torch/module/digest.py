"""A hash of a module's weights: the one definition of "the same weights" (OpenVINO's IR reuse and the
tuning-result cache both key on it)."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from torch_tweak.torch.module.released import has_values


def weights_digest(module: nn.Module) -> str | None:
    """SHA-256 over every state-dict entry's name, dtype, shape and bytes; None if a tensor has no values
    (meta device or released), since then nothing can tell two such modules apart."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        if not has_values(tensor):
            return None
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        if flat.numel():
            digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()
