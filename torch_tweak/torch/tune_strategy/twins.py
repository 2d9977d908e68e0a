"""Twins: candidates that compute the same outputs from the same artifact and differ only in how calls are
scheduled (:meth:`~torch_tweak.torch.backend.backend.Backend.outputs_key`; OpenVINO's LATENCY and THROUGHPUT
compile one IR in one precision into one or several streams). The first one a measuring strategy checks is judged
on every recorded call; a twin of a candidate that passed is confirmed on its smallest in-memory call (every call
when that one fails), which on a BERT-base on 2 cores saves 6-7 s per twin.
"""

from __future__ import annotations

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.report.report import PASSED, CandidateReport
from torch_tweak.torch.tune_strategy.base import GraphTask


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
