"""Reference-compatible import path (``docs/migrating.md``). The reference's base class for strategies with the
max-batch-size search is :class:`~torch_tweak.torch.tune_strategy.base.TuneStrategy` here: every strategy has
the search and its setters."""

from torch_tweak.torch.tune_strategy.extension.find_max_batch_size_extension import (
    TuneStrategyFindMaxBatchSizeExtension,
)

__all__ = ["TuneStrategyFindMaxBatchSizeExtension"]
