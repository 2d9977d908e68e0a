"""The eager gate: the best candidate serves only if it beats eager by the strategy's ``eager_margin``.

The speed-up is the one the head-to-head timed in turns when eager took part in it (``contest.py``: the sweeps
put the two close), else the ratio of the two sweeps' picks. Mixed into ``MeasuringStrategy``
(``measuring_base.py``); the subclasses (``measuring.py``) say how a pick is scored against eager's and described.
"""

from __future__ import annotations

from typing import Any

from torch_tweak.torch.tune_strategy.base import GraphTask
from torch_tweak.torch.tune_strategy.results import Evaluation


class EagerGate:
    """Chooses between the best candidate and the eager baseline, with the reason the report gives (``self`` is a
    ``MeasuringStrategy``: its ``eager_margin``, ``metric_name``, ``_speedup`` and ``_describe_pick``)."""

    def _choose(self: Any, task: GraphTask, evaluations: list[Evaluation], best: Evaluation | None,
                in_turns: float | None = None) -> tuple[Evaluation, str]:
        """``best`` or eager, and the reason; ``in_turns``: ``best``'s speed-up over eager timed in turns, if it was."""
        eager = evaluations[0]
        margin = 1.0 + self.eager_margin
        if best is None and eager.pick is None:
            raise self._nothing_qualifies(task, evaluations)
        if best is None:
            assert eager.pick is not None
            if len(evaluations) == 1:
                return eager, f"eager was the only candidate: {self._describe_pick(eager.pick)}"
            others = "; ".join(f"{e.row.backend}: {e.row.error or 'does not qualify'}" for e in evaluations[1:])
            return eager, f"no other candidate qualified ({others}); eager stays with {self._describe_pick(eager.pick)}"
        assert best.pick is not None
        if eager.backend is None and not eager.reused:
            return best, (f"{self._describe_pick(best.pick)}; the eager baseline failed ({eager.row.error}), so "
                          "the eager gate could not be applied")
        if eager.pick is None:
            return best, f"{self._describe_pick(best.pick)}; eager does not qualify, so the eager gate does not apply"
        ratio = self._speedup(best.pick, eager.pick) if in_turns is None else in_turns
        how = "" if in_turns is None else " timed in turns"
        if ratio >= margin:
            return best, (f"{self._describe_pick(best.pick)}, {ratio:.2f}x eager's {self.metric_name}{how} "
                          f"(the eager gate needs >= {margin:.2f}x)")
        return eager, (f"eager gate: the best candidate {best.row.backend} reached only {ratio:.2f}x eager's "
                       f"{self.metric_name}{how} (sweeps: {self._describe_pick(best.pick)} vs eager "
                       f"{self._describe_pick(eager.pick)}), below the {margin:.2f}x required "
                       f"(eager_margin={self.eager_margin}); eager stays")
