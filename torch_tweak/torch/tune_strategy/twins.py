"""Twins: candidates that compute the same outputs from the same artifact and differ only in how calls are
scheduled (:meth:`~torch_tweak.torch.backend.backend.Backend.outputs_key`; OpenVINO's LATENCY and THROUGHPUT
compile one IR in one precision into one or several streams). The first one a measuring strategy checks is judged
on every recorded call; a twin of a candidate that passed is confirmed on its smallest in-memory call (every call
when that one fails), which on a BERT-base on 2 cores saves 6-7 s per twin.

A candidate that runs on fewer threads than the runtime would use (OpenVINO's ``num_threads=1``, ONNX Runtime's
``intra_op_num_threads=1``) can win only where a call is mostly the threads' hand-offs between operations, so a
strategy skips it once its every-core twin (:meth:`~torch_tweak.torch.backend.Backend.every_core_twin`) was measured
and its shortest call took :data:`THREADS_PAY_OFF_MS` or more, or failed to build, failed its check or was skipped
(the thread-limited one runs the same model). On 2 cores of a Sapphire Rapids Xeon one thread ran 0.72-0.89x as long
as two on an MLP 256-512-256 (31-75 µs calls) and 0.85x on a 2-layer BERT of width 128 at batch 1 (0.36 ms), but
1.13-2.06x as long on a 4-layer BERT of width 256 (1.4-25 ms).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.report.report import PASSED, CandidateReport
from torch_tweak.torch.report.status import CandidateStatus
from torch_tweak.torch.tune_strategy.base import GraphTask

if TYPE_CHECKING:
    from torch_tweak.torch.tune_strategy.results import Evaluation

#: A thread-limited candidate is skipped when its every-core twin's shortest measured call took this long or more.
THREADS_PAY_OFF_MS = 1.0
_TWIN_FAILURES = {CandidateStatus.BUILD_FAILED: "failed to build",
                  CandidateStatus.REJECTED: "failed the fidelity check", CandidateStatus.SKIPPED: "was skipped"}


def twin_of(task: GraphTask, template: Backend) -> CandidateReport | None:
    """The row of a candidate judged on every recorded call that computes what ``template`` computes (the same
    :meth:`Backend.outputs_key`), if one passed in this task."""
    key = template.outputs_key()
    return task.judged.get(key) if key is not None else None


def remember_judged(task: GraphTask, template: Backend, row: CandidateReport) -> None:
    """Keep ``row`` as the judged twin of ``template``'s outputs key when it passed a full check."""
    key = template.outputs_key()
    fidelity = row.fidelity if isinstance(row.fidelity, dict) else {}
    if key is not None and row.status == PASSED and fidelity and not fidelity.get("judged_with"):
        task.judged.setdefault(key, row)


def thread_limited_reason(template: Backend, evaluations: list[Evaluation]) -> str | None:
    """Why a thread-limited candidate cannot beat ``template``, its every-core twin: that one failed to build, was
    rejected or skipped (the same model would be), or its calls are long (None: not evaluated yet, or short calls)."""
    twin = next((e for e in evaluations if e.template is not None and e.template.key() == template.key()), None)
    if twin is not None and (verb := _TWIN_FAILURES.get(twin.row.status)) is not None:
        return f"it runs the model of {twin.row.backend} on fewer threads, and that one {verb}"
    if twin is None or twin.sweep is None or not twin.sweep.measurements:
        return None
    shortest = min(m.p50_ms for m in twin.sweep.measurements)
    if shortest < THREADS_PAY_OFF_MS:
        return None
    return (f"it runs the model of {twin.row.backend} on fewer threads, and that one's shortest call took "
            f"{shortest:,.2f} ms: calls of {THREADS_PAY_OFF_MS:g} ms or more spend their time in work that threads "
            "share, not in handing it over")
