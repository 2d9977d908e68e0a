"""Helpers that do not need torch: hashing, permissions, tracing and output capture."""

from torch_tweak.utils.hashing import hash_bytes, hash_file, hash_string
from torch_tweak.utils.permissions import secure_file, secure_mkdir
from torch_tweak.utils.trace import annotate

__all__ = ["annotate", "hash_bytes", "hash_file", "hash_string", "secure_file", "secure_mkdir"]
