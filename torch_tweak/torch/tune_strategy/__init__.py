"""Tune strategies: how each graph's backend is chosen."""

from torch_tweak.torch.tune_strategy.base import GraphTask, TuneStrategy
from torch_tweak.torch.tune_strategy.simple import FirstWinsStrategy, OneBackendStrategy

__all__ = ["FirstWinsStrategy", "GraphTask", "OneBackendStrategy", "TuneStrategy"]
