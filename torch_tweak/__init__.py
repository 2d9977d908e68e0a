"""torch_tweak: tune PyTorch models and pipelines for inference.

The public API lives in :mod:`torch_tweak.torch` (``import torch_tweak.torch as tt``).
Importing this package does not import torch.
"""

from torch_tweak.__version__ import __version__

__all__ = ["__version__"]
