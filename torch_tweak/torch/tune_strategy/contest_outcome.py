"""What a head-to-head (``contest.py``) decides, and when the rounds left can no longer change it.

The last round is left out when it cannot change the outcome: every block after the first makes as many calls as
the contender's first block did, so the calls still to come are known in number, and each median can then end
anywhere between the median with all of them faster than every call so far and the median with all of them
slower (:func:`median_ranges`). When the winner (and the eager gate's verdict) come out the same at every end of
those ranges (:meth:`Outcome.settled`), the rounds left could only move the reported times: on a BERT-base, the
head-to-head of three int8 contenders at batch 32 timed 9 calls of about a second for a verdict the first 6 had
settled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch_tweak.torch.profiling import percentile

MIN_WIN = 1.03  # a rival must beat the best in turns by this factor to replace it (no flapping between equals)
_UNBOUNDED_MS = 1e30  # stands for "slower than every call so far" in the range a median can still reach

#: Per contender, per batch size: milliseconds (the medians so far at their lowest and at their highest reach).
Times = list[dict[int, float]]


def median_ranges(times: list[dict[int, list[float]]], more: list[int]) -> tuple[Times, Times]:
    """The lowest and the highest median each contender's calls at each size can reach after ``more[i]`` further
    calls of contender ``i`` at each of its sizes: all of them faster than any so far, or all slower."""
    lowest = [{size: percentile(values + [0.0] * k, 50) for size, values in record.items()}
              for record, k in zip(times, more, strict=True)]
    highest = [{size: percentile(values + [_UNBOUNDED_MS] * k, 50) for size, values in record.items()}
               for record, k in zip(times, more, strict=True)]
    return lowest, highest


@dataclass(frozen=True)
class Outcome:
    """What a head-to-head decides, so that its timing stops once the rounds left cannot change that.

    A contest (``pairwise`` False): contender 0 is the best, the next ``rivals`` its rivals, and when ``gate`` is
    set eager comes last and the winner's speed-up over it must reach ``gate``. A route (``pairwise``): contender 1
    takes each batch size where its call takes :data:`MIN_WIN` times less than contender 0's."""

    rivals: int = 1
    gate: float | None = None
    pairwise: bool = False

    def rule(self, score: Callable[[dict[int, float]], float]) -> Callable[[Times, Times], list[bool]]:
        """``needed(lowest, highest)`` for :func:`contest_times`, scoring per-size times with ``score``."""
        return lambda lowest, highest: self.needed(score, lowest, highest)

    def settled(self, score: Callable[[dict[int, float]], float], lowest: Times, highest: Times) -> bool:
        """Whether the decision comes out the same wherever in their ranges the medians end (scores only fall as
        times grow)."""
        return not any(self.needed(score, lowest, highest))

    def needed(self, score: Callable[[dict[int, float]], float], lowest: Times, highest: Times) -> list[bool]:
        """Per contender, whether its further calls can still change the decision, wherever in their ranges the
        medians end (all False: settled). A rival that cannot beat the best even at its fastest never wins, nor
        decides which rival does (one that beats the best is faster than it); eager matters only while the gate's
        verdict is open for a contender that may still win; the best only while a rival may win, or for the gate.
        A contender left out keeps the median it has, which lies in its range: the decision is one its further
        calls could have given."""
        if self.pairwise:
            mine_low, theirs_low = lowest
            mine_high, theirs_high = highest
            settled = all(beats(-theirs_high[s], -mine_low[s]) or not beats(-theirs_low[s], -mine_high[s])
                          for s in mine_low)
            return [not settled, not settled]
        ranges = [(score(high), score(low)) for low, high in zip(lowest, highest, strict=True)]  # (worst, best)
        best_worst, best_best = ranges[0]
        rivals = range(1, 1 + self.rivals)
        open_rivals = [i for i in rivals if beats(ranges[i][1], best_worst)]
        sure = [i for i in open_rivals if beats(ranges[i][0], best_best)
                and all(ranges[i][0] > ranges[q][1] for q in rivals if q != i)]
        winners = [0] if not open_rivals else sure[:1] or [0, *open_rivals]
        needed = [len(winners) > 1 and i in winners for i in range(len(ranges))]
        if self.gate is not None:
            eager_worst, eager_best = ranges[-1]
            gate = self.gate
            if any(factor(ranges[w][0], eager_best) < gate <= factor(ranges[w][1], eager_worst) for w in winners):
                needed = [need or i in winners or i == len(ranges) - 1 for i, need in enumerate(needed)]
        return needed


def beats(rival: float, best: float) -> bool:
    """Whether score ``rival`` beats ``best`` by :data:`MIN_WIN`."""
    return factor(rival, best) >= MIN_WIN


def factor(rival: float, best: float) -> float:
    """How many times better score ``rival`` is than ``best`` (scores are higher-is-better, of either sign)."""
    if best > 0:
        return rival / best
    return best / rival if rival < 0 else float("inf")
