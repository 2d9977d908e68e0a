"""Reusing tuning results: a candidate already built, checked and measured is not built again.

Tuning the same model again (under any module name), or again after a run was interrupted (Ctrl-C,
``kill -9``), reads what each candidate produced from ``<cache>/results/<key>.json``, written atomically as
soon as the candidate finished. The key is a SHA-256 over everything the result depends on: the module's weights
(:func:`~torch_tweak.torch.module.digest.weights_digest`), the graph spec, the backend's ``key()``, the
strategy's settings (class, profiling, fidelity, batch sizes, role) and the environment (CPU model and ISA
flags, torch and torch_tweak versions, the versions of the packages the backend needs). A changed weight,
library or CPU therefore misses exactly the affected entries; stale files are never read again and go
with ``tt.tune(clear_cache=True)`` or ``torch-tweak cache clear``.

Only outcomes that a rerun would reproduce are kept (passed, rejected, failed to build or to run, screened out
before its check: measured below what it needed, it is never chosen when reused; skipped by an int8 probe where
it was to be built: a verdict on the graph and this CPU, which the key holds); a timeout, or a candidate skipped
for what other candidates measured or for the time budget, is tried again. What the stand-in rules measure on the
graph itself (``graph_probes.KEPT_PROBES``: eager's time in the kernels Inductor keeps, its share of multiply-adds
in linear layers) and the mixed-call timings of routes across runtimes are kept beside the results under the same
key, so that a rerun which reuses the candidates' measurements decides as the first run did, without timing again. A reused candidate that the strategy chooses is built again (OpenVINO and ONNX Runtime
reuse their converted files; compilers their own caches) and checked again on the current samples before it
serves. A stored file is JSON parsed into plain values; a malformed one is a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, fields, replace
from typing import Any

from torch_tweak.errors import WorkerError
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.registry import required_packages
from torch_tweak.torch.cache import cache_folder
from torch_tweak.torch.cache_limit import touch
from torch_tweak.torch.environment import core_versions, cpu_info, distribution_versions, isa_flags
from torch_tweak.torch.module.digest import weights_digest
from torch_tweak.torch.profiling import SweepResult
from torch_tweak.torch.report.report import CandidateReport, GraphReport
from torch_tweak.torch.report.status import CandidateStatus
from torch_tweak.torch.tune_strategy.base import CandidateFailedError, GraphTask, describe_task, release_scratch
from torch_tweak.torch.tune_strategy.results import Evaluation, Plan
from torch_tweak.utils.json_file import write_json_atomic

logger = logging.getLogger(__name__)

FORMAT = 1
# screened out: measured before its check; skipped: only a probe's verdict reaches the cache (the other skips are
# decided before a candidate is evaluated, and never stored)
REUSABLE = {CandidateStatus.PASSED, CandidateStatus.REJECTED, CandidateStatus.BUILD_FAILED,
            CandidateStatus.INFER_FAILED, CandidateStatus.SCREENED_OUT, CandidateStatus.SKIPPED}


class ResultCache:
    """The stored results of one graph's candidates (see the module docstring)."""

    def __init__(self, module: Any, graph_spec: Any, settings: dict[str, Any]) -> None:
        self.folder = cache_folder("results")
        weights = weights_digest(module)
        measured_on = settings.get("measured_on")  # another machine's CPU (a Ray hardware class), else this one's
        cpu, isa = (measured_on["cpu"], measured_on["isa"]) if measured_on else (cpu_info().model, isa_flags())
        self._base: dict[str, Any] | None = None if weights is None else {
            "format": FORMAT, "weights": weights, "graph": graph_spec.to_dict(), "settings": settings,
            "cpu": cpu, "isa": isa, "versions": core_versions(),
        }

    def key(self, template: Backend, role: str) -> str | None:
        """The result key of ``template`` in ``role``; None when the weights cannot be hashed."""
        if self._base is None:
            return None
        packages = distribution_versions(required_packages(type(template).__name__))
        return _digest({**self._base, "backend": template.key(), "role": role, "packages": packages})

    def load(self, key: str | None) -> tuple[CandidateReport, SweepResult | None] | None:
        """The stored row and sweep for ``key``, or None (missing, unreadable or malformed)."""
        if key is None:
            return None
        path = self.folder / f"{key}.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            row = _row(doc["row"])
            sweep = SweepResult.from_dict(doc["sweep"]) if doc["sweep"] is not None else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("Ignoring the stored tuning result %s (%s); the candidate is tried again.", path, exc)
            return None
        if row.status not in REUSABLE:
            return None
        touch(path)
        return row, sweep

    def store(self, key: str | None, row: CandidateReport, sweep: SweepResult | None) -> None:
        """Write the row (status ``passed`` for a candidate that qualified) and its sweep, atomically."""
        if key is None or row.status not in REUSABLE:
            return
        doc = {"format": FORMAT, "row": asdict(row), "sweep": sweep.to_dict() if sweep is not None else None}
        try:
            self._write(key, doc)
        except OSError as exc:
            logger.warning("Could not store the tuning result of %s in %s: %s", row.backend, self.folder, exc)

    def restore_probes(self, probed: dict[str, Any], names: tuple[str, ...]) -> None:
        """Put into ``probed`` (a ``GraphTask.probed``) the ``names`` entries an earlier run stored for this graph:
        plain JSON values, which their readers check before use (nothing else of the file is taken)."""
        key = self._probes_key()
        try:
            stored = json.loads((self.folder / f"{key}.json").read_text(encoding="utf-8")) if key else {}
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning("Ignoring the stored probes of this graph (%s); they are measured again.", exc)
            return
        if isinstance(stored, dict):
            probed.update({name: stored[name] for name in names if name in stored})

    def store_probes(self, probed: dict[str, Any], names: tuple[str, ...]) -> None:
        """Keep the ``names`` entries of ``probed`` for a rerun (the stand-in rules' measurements of the graph: a
        rerun that reuses the candidates' results then decides as this run did)."""
        key, kept = self._probes_key(), {name: probed[name] for name in names if name in probed}
        if key is None or not kept:
            return
        try:
            self._write(key, kept)
        except (OSError, TypeError, ValueError) as exc:
            logger.warning("Could not store the probes of this graph in %s: %s", self.folder, exc)

    def _probes_key(self) -> str | None:
        return None if self._base is None else _digest({**self._base, "probes": 1})

    def _write(self, key: str, doc: Any) -> None:
        """Write ``doc`` as ``<key>.json``, atomically (a reader never sees half a file)."""
        write_json_atomic(self.folder / f"{key}.json", doc)


def _digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _measured_on(task: GraphTask) -> dict[str, Any] | None:
    """The CPU an isolated executor measures ``task`` on when it is not this machine (a Ray hardware class: results
    measured on one class are reused for that class only); None: this machine, or no executor is reachable."""
    executor = task.executor
    if executor is None or not executor.isolated:
        return None
    try:
        return executor.hardware()
    except WorkerError:  # the graph is tuned in this process then (the executor's share fails the same way)
        return None


def _row(data: Any) -> CandidateReport:
    if not isinstance(data, dict):
        raise ValueError("the row is not an object")
    known = {f.name for f in fields(CandidateReport)}
    row = CandidateReport(**{k: v for k, v in data.items() if k in known})
    if not isinstance(row.backend, str) or not isinstance(row.key, str):
        raise ValueError("the row has no backend name or key")
    row.status = CandidateStatus(row.status)
    return row


class ReusedResults:
    """What a measuring strategy does with the result cache: the settings a key covers, a reused evaluation,
    and building a reused candidate again when it is to serve (mixed into ``MeasuringStrategy``)."""

    profiling: Any
    fidelity: Any
    # From MeasuringStrategy / TuneStrategy (not defined here, so the MRO finds theirs): ``_pick(sweep)`` and
    # ``try_backend(template, task, role)``.

    def _settings(self, plan: Plan, screen: Plan | None, task: GraphTask) -> dict[str, Any]:
        """What a stored result depends on besides weights, graph, backend and environment (and, when
        ``task.executor`` measures on another machine, that machine's CPU)."""
        profiling = {f.name: getattr(self.profiling, f.name) for f in fields(self.profiling)
                     if f.name != "clock"}  # which clock measured does not change the result
        settings = {"strategy": type(self).__name__, "profiling": profiling, "fidelity": repr(self.fidelity),
                    "batch_sizes": plan.batch_sizes, "batched": plan.batched,
                    "screen": screen.batch_sizes if screen is not None else None}
        measured_on = _measured_on(task)
        if measured_on is not None:  # only then: keys of results measured here stay as they were
            settings["measured_on"] = measured_on
        return settings

    def _reused(self, task: GraphTask, role: str, row: CandidateReport, sweep: SweepResult | None) -> Evaluation:
        """An evaluation from the result cache: its row goes into the report, marked ``reused``."""
        row.reused = True
        task.report.candidates.append(row)
        pick = self._pick(sweep) if sweep is not None and row.status == CandidateStatus.PASSED else None
        logger.info("%s: %s reused from an earlier run (%s)", describe_task(task), row.backend, row.status)
        return Evaluation(role, row, None, sweep, pick, reused=True)

    def _rebuild(self, task: GraphTask, evaluation: Evaluation) -> bool:
        """Build and confirm a reused (or worker-measured) candidate that is to serve; False (its row says why) if
        that fails now.

        The rebuild loads the artifact the judged build left (an IR, an ONNX file, a compiler's cache), so a
        confirming check on the smallest in-memory call is enough (every judged call when it does not pass), the
        judged build's non-finite probe outcome stands (behind the guard or not), and the row keeps the full
        check's result. A worker's row keeps the worker's build time, the cost of tuning; a
        result reused from an earlier run shows what it took to build this time.
        """
        assert evaluation.template is not None
        private = replace(task, report=GraphReport(name=task.report.name))
        try:
            backend, fresh = self.try_backend(evaluation.template, private, evaluation.role, confirm=True,
                                              judged=evaluation.row)
        except CandidateFailedError as failure:
            for name in ("status", "error", "fidelity", "log_path", "build_time_s"):
                setattr(evaluation.row, name, getattr(failure.report, name))
            evaluation.pick, evaluation.reused = None, False
            where = "measured by a worker" if evaluation.row.worker else "reused from an earlier run"
            logger.warning("%s: %s, %s, failed when built again in this process: %s", describe_task(task),
                           evaluation.row.backend, where, evaluation.row.error)
            return False
        evaluation.backend = backend
        release_scratch(backend)  # the confirming check's largest batch need not stay allocated
        evaluation.row.fidelity = evaluation.row.fidelity or fresh.fidelity
        if evaluation.reused or evaluation.row.build_time_s is None:
            evaluation.row.build_time_s = fresh.build_time_s
        logger.info("%s: %s built again in this process in %.1fs", describe_task(task), evaluation.row.backend,
                    fresh.build_time_s or 0.0)
        return True
