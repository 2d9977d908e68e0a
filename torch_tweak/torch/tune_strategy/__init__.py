"""Tune strategies: how each graph's backend is chosen."""

from torch_tweak.torch.backend.registry import default_candidates
from torch_tweak.torch.tune_strategy.base import GraphTask, TuneStrategy
from torch_tweak.torch.tune_strategy.measuring import (
    HighestThroughputStrategy,
    LatencyBudgetStrategy,
    LowestLatencyStrategy,
)
from torch_tweak.torch.tune_strategy.measuring_base import MeasuringStrategy
from torch_tweak.torch.tune_strategy.results import CandidateResult, StrategyResult
from torch_tweak.torch.tune_strategy.simple import FirstWinsStrategy, OneBackendStrategy

__all__ = [
    "CandidateResult",
    "FirstWinsStrategy",
    "GraphTask",
    "HighestThroughputStrategy",
    "LatencyBudgetStrategy",
    "LowestLatencyStrategy",
    "MeasuringStrategy",
    "OneBackendStrategy",
    "StrategyResult",
    "TuneStrategy",
    "default_candidates",
]
