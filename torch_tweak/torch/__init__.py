"""torch_tweak's public API: ``import torch_tweak.torch as tt``."""
