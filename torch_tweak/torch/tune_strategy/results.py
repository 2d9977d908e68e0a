"""Results of the measuring strategies: per-candidate evaluations and per-graph summaries."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.profiling import Measurement, SweepResult
from torch_tweak.torch.report.report import REJECTED, CandidateReport, GraphReport

logger = logging.getLogger(__name__)

#: The role of the eager reference in a measuring strategy's evaluations and report rows.
BASELINE = "baseline"


@dataclass
class Evaluation:
    """One candidate's outcome: its report row, the built backend (None if it failed or was reused) and its
    sweep."""

    role: str
    row: CandidateReport
    backend: Backend | None = None
    sweep: SweepResult | None = None
    pick: Measurement | None = None
    template: Backend | None = None  # what to build if a reused result is chosen
    key: str | None = None  # its result-cache key
    # Row and sweep come from the result cache or an isolated executor's worker; ``backend`` is built here only
    # if the candidate is to serve.
    reused: bool = False

    @property
    def qualified(self) -> bool:
        """Built (or reused) and measured, so it can be compared and chosen."""
        return (self.backend is not None or self.reused) and self.pick is not None


#: A candidate's outcome as a strategy reports it: the report's own row (one model for both).
CandidateResult = CandidateReport


@dataclass(frozen=True)
class StrategyResult:
    """What a measuring strategy decided for one graph: a view of that graph's report (no second copy)."""

    module_name: str
    graph: GraphReport

    @property
    def graph_spec_name(self) -> str:
        """The graph's name."""
        return self.graph.name

    @property
    def chosen(self) -> str | None:
        """The chosen candidate's ``describe()``."""
        return self.graph.chosen

    @property
    def reason(self) -> str | None:
        """Why it was chosen."""
        return self.graph.reason

    @property
    def candidates(self) -> list[CandidateReport]:
        """Every candidate's report row, in the order they were tried."""
        return self.graph.candidates


#: How much a candidate's throughput moved between two measurements on these shared 2-core machines (up to 25 %).
NOISE = 1.25


@dataclass
class Plan:
    """How a graph is measured: the batch sizes, whether they are real batch sizes, the base inputs, the
    measurements a candidate already has (its screening ends: the sweep takes them instead of measuring again),
    and at screening the throughput a candidate needs at each end to be kept, as ``(batch size, samples/s)``
    pairs (the sweep stops once they are :func:`out_of_reach`)."""

    batch_sizes: list[int]
    batched: bool
    sample: Any
    known: tuple[Measurement, ...] = ()
    needs: tuple[tuple[int, float], ...] = ()


def out_of_reach(measurement: Measurement, plan: Plan) -> bool:
    """Whether a candidate measured at ``measurement``'s batch size cannot reach what it needs (``plan.needs``) at
    any screening end.

    A call at a larger batch takes no less time than one at a smaller batch, so throughput grows at most in
    proportion to the batch size: the bound at a larger end is this throughput times the ratio of the sizes
    (and :data:`NOISE`); an end below ``measurement``'s size is never bounded by it.
    """
    needs = dict(plan.needs)
    if not needs or measurement.batch_size not in needs or measurement.throughput >= needs[measurement.batch_size]:
        return False
    size = measurement.batch_size
    return all(size <= other and measurement.throughput * other / size * NOISE < need
               for other, need in needs.items() if other != size)


def unbuilt(evaluations: Iterable[Evaluation]) -> list[Evaluation]:
    """The evaluations without a built backend, each once (a router may send two batch-size ranges to the same
    candidate; building it twice would leak the first build)."""
    return list({id(e): e for e in evaluations if e.backend is None}.values())


def selection_dict(metric: str, pick: Measurement | None) -> dict[str, Any] | None:
    """The measurement a strategy judged a candidate by, for its report row (None: it did not qualify)."""
    if pick is None:
        return None
    return {"metric": metric, "batch_size": pick.batch_size, "throughput": pick.throughput,
            "p50_ms": pick.p50_ms, "p99_ms": pick.p99_ms, "stable": pick.stable}


def precision_retry(template: Backend, evaluation: Evaluation, seen: set[str]) -> Backend | None:
    """A higher-precision variant of a candidate the fidelity check rejected at reduced precision, if any.

    The variant is a candidate of its own, with its own row in the report (never a silent substitution). A
    candidate kept behind the non-finite guard passed the check, so it gets none (its NaN/inf problem is
    solved; at f32 it would only be slower). One rejected by a probe does: int8 activation scales can be
    what turns an inf row into inf instead of NaN, which a higher precision does not do.
    """
    if evaluation.row.status != REJECTED or evaluation.row.precision in (None, "fp32"):
        return None
    retry = template.precision_fallback()
    if retry is None or retry.key() in seen:
        return None
    seen.add(retry.key())
    logger.info("%s was rejected at %s; trying %s", evaluation.row.backend, evaluation.row.precision, retry.describe())
    return retry
