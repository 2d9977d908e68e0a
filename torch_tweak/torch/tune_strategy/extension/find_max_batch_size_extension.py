"""Reference-compatible import path (``docs/migrating.md``); see :mod:`torch_tweak.torch.tune_strategy.batch_search`."""

from torch_tweak.torch.tune_strategy.base import TuneStrategy

#: Subclass it (or :class:`TuneStrategy`) for a custom strategy; call
#: :func:`~torch_tweak.torch.tune_strategy.batch_search.search_if_enabled` at the start of ``_tune`` to run the search.
TuneStrategyFindMaxBatchSizeExtension = TuneStrategy

__all__ = ["TuneStrategyFindMaxBatchSizeExtension"]
