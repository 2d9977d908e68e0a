"""Checkpoints: ``tt.save`` writes tuned modules to a ``.tt`` zip plus a sums file, ``tt.load`` restores them warm.

A checkpoint holds a versioned JSON manifest (see :mod:`.manifest`), tensors as safetensors and backend
artifacts (OpenVINO IR folders, AOTInductor packages). Nothing is pickled, nothing named in a file is
imported, and every member is verified (size and SHA-256, against the manifest and the sums file) before
it is used. :func:`verify` checks a checkpoint without loading it.
"""

from torch_tweak.torch.backend.registry import register_backend
from torch_tweak.torch.checkpoint.load import load
from torch_tweak.torch.checkpoint.manifest import FORMAT_VERSION, CheckpointWarning
from torch_tweak.torch.checkpoint.save import save
from torch_tweak.torch.checkpoint.verify import verify

__all__ = ["FORMAT_VERSION", "CheckpointWarning", "load", "register_backend", "save", "verify"]
