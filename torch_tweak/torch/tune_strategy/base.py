"""TuneStrategy: how a graph's backend is chosen. Subclasses implement ``_tune``.

Every strategy builds and checks candidates through :meth:`TuneStrategy.try_backend`, so the fidelity rules
(recorded samples, then the non-finite probes and, when a candidate fails those, the non-finite guard) are
applied in one place.
"""

from __future__ import annotations

import copy
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import ConfigError, FidelityError, TorchTweakError
from torch_tweak.torch import progress
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.non_finite_guard import NonFiniteGuardBackend
from torch_tweak.torch.backend.torch_eager import TorchEagerBackend
from torch_tweak.torch.cache_limit import touch
from torch_tweak.torch.config import config
from torch_tweak.torch.executor.base import Executor
from torch_tweak.torch.fidelity import (
    NON_FINITE_GUARD,
    PROBE_FAILED,
    FidelityConfig,
    NonFiniteProbe,
    check_calls,
    guarded_probes,
    judged_probe_outcome,
    probe_non_finite,
    probe_sample,
)
from torch_tweak.torch.module.forward import pristine
from torch_tweak.torch.module.recording import RecordedSample
from torch_tweak.torch.module.sample_store import SampleStore
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample
from torch_tweak.torch.profiling import ProfilingConfig, SweepResult
from torch_tweak.torch.report.report import BUILD_FAILED, INFER_FAILED, PASSED, REJECTED, CandidateReport, GraphReport
from torch_tweak.torch.tune_strategy import warm_calls
from torch_tweak.torch.tune_strategy.results import Plan
from torch_tweak.torch.tune_strategy.sweeping import sweep_backend
from torch_tweak.utils.capture import capture_output
from torch_tweak.utils.permissions import secure_mkdir

logger = logging.getLogger(__name__)

#: Samples a calibrating candidate calibrates on, at most (whole recorded calls, the first ones recorded). Calibration
#: runs the float model over each of them, more than once: NNCF took 19.6 s on a ResNet-50 with the 190 samples of
#: 80 recorded calls, against 7.8 s with 64 samples (OpenVINO INT8 by hand in the 2026-12-01 09:24 peer run). From 64
#: to 32 samples (2 cores of an AVX-512 VNNI EPYC, 24 held-out inputs): ResNet-50 14.8 -> 9.9 s, BERT-base
#: (transformer preset) 29.6 -> 21.6 s, with the same error against eager (largest relative L2 0.33 / 0.31 and
#: 0.024 / 0.025, top-1 agreement 0.96 both); 16 samples saved BERT nothing more.
CALIBRATION_SAMPLES = 32


@dataclass
class GraphTask:
    """Everything a strategy needs to choose a backend for one graph of one module.

    Attributes:
        module: the wrapped ``nn.Module`` (its own forward; hooks and interception are removed while tuning).
        module_name: the ``tt.Module`` name.
        graph_spec: the graph's inputs and outputs.
        samples: recorded calls with their eager outputs (the fidelity reference), in memory.
        device: the tuning device.
        cache_dir: ``<cache>/<module>/<graph>``; each candidate builds in ``cache_dir / backend.key()``.
        report: the graph's report; strategies append a :class:`CandidateReport` per candidate.
        store: more recorded calls, on disk, when the strategy keeps them (:meth:`TuneStrategy.keeps_recorded_calls`):
            calibrating candidates build with its calibrating calls, and every candidate's fidelity check also
            judges its held-out calls.
        deadline: ``time.perf_counter()`` value by which the graph's tuning should end (its share of
            ``tt.tune(time_budget_s=...)``); None means no budget. Strategies skip candidates that would not fit.
        executor: where the measuring strategies evaluate candidates (``tt.tune(executor=...)``); None or an
            executor that is not isolated: in this process.
        judged, probed: rows that passed a full check (``twins.py``) and what the stand-in probes measured
            (``stand_ins.py``), kept for the candidates after them (the task's copies share both).
    """

    module: nn.Module
    module_name: str
    graph_spec: GraphSpec
    samples: list[RecordedSample]
    device: torch.device
    cache_dir: Path
    report: GraphReport
    store: SampleStore | None = None
    deadline: float | None = None
    executor: Executor | None = None
    judged: dict[str, CandidateReport] = field(default_factory=dict, repr=False)
    probed: dict[str, Any] = field(default_factory=dict, repr=False)

    def data(self) -> list[Sample]:
        """Deep copies of the recorded inputs, safe to hand to a backend."""
        return [copy.deepcopy(s.sample) for s in self.samples]

    def calibration_data(self) -> Sequence[Sample]:
        """What a calibrating candidate (:attr:`Backend.needs_calibration`) builds with: the calibrating calls of
        :attr:`store` up to :data:`CALIBRATION_SAMPLES` samples, loaded one at a time; without any, the in-memory
        samples but the last one (which the fidelity check then judges as a call calibration never saw)."""
        if self.store is not None:
            calibration = self.store.calibration(CALIBRATION_SAMPLES)
            if len(calibration):
                return calibration
        data = self.data()
        return data[:-1] if len(data) >= 2 else data

    def build_data(self, backend: Backend) -> Sequence[Sample]:
        """The samples ``backend`` is built with: :meth:`calibration_data` if it calibrates, else :meth:`data`."""
        return self.calibration_data() if backend.needs_calibration else self.data()

    def judged_calls(self, held_out: bool = True, smallest_only: bool = False) -> Iterator[tuple[Sample, Any, bool]]:
        """``(inputs, eager outputs, held out)`` of every call the fidelity check judges: the in-memory samples
        (copied), then (unless ``held_out`` is False) the held-out calls of :attr:`store` (loaded one at a time,
        so their outputs are never all in memory). Every candidate is judged on the same calls.
        ``smallest_only``: the in-memory sample of the smallest batch alone (a rebuild's confirming call).
        Calls that recording did not run (``module/known_shapes.py``) get their eager outputs here, once."""
        samples = self.samples
        if smallest_only and samples:
            samples = [min(samples, key=lambda s: s.batch_size or 0)]
        for sample in samples:
            sample.fill(self.module)
            yield copy.deepcopy(sample.sample), sample.outputs, False
        if held_out and self.store is not None:
            for inputs, outputs, _ in self.store.held_out(self.module):
                yield inputs, outputs, True


#: Measures a built backend on a task with a plan; the last argument is a cancel Event (or None).
Measure = Callable[[Backend, GraphTask, Plan, Any], SweepResult]


class CandidateFailedError(TorchTweakError, RuntimeError):
    """A candidate failed to build or was rejected; ``report`` holds its row, ``__cause__`` the error."""

    def __init__(self, report: CandidateReport) -> None:
        super().__init__(f"{report.backend}: {report.error}")
        self.report = report


class TuneStrategy(ABC):
    """Base class of strategies.

    A strategy receives one graph at a time (:meth:`tune`) and returns a built, active backend that
    passed the fidelity check. Use :meth:`try_backend` to build and check a candidate: it deep-copies
    the template, builds it with its output captured in ``build.log``, compares its outputs with the
    recorded eager outputs and appends the result to the graph's report. A candidate that passes the
    samples but not the non-finite probes comes back wrapped in a :class:`NonFiniteGuardBackend` when
    ``fidelity.non_finite == "guard"`` (the default) and the probes pass through the guard.
    """

    #: Largest batch size the max-batch-size search tries.
    max_batch_size_limit: int = 256
    #: Seconds one candidate (or the max-batch-size search) may take; None: no limit.
    candidate_time_limit_s: float | None = 600.0

    def __init__(self, fidelity: FidelityConfig | None = None) -> None:
        self._correctness_check = True
        self.fidelity = fidelity or FidelityConfig()
        self.find_max_batch_size = False
        self._search_profiling: ProfilingConfig | None = None
        self._search_backend: Backend | None = None

    # max-batch-size search (batch_search.py); off by default, the reference's setters --------------

    def enable_find_max_batch_size(self, enable: bool = True) -> TuneStrategy:
        """Turn the max-batch-size search on or off (off by default; the reference Torch Tweak has it on).

        Before choosing a backend for a graph with a batch axis, the built-in strategies measure eager over
        powers of two and widen the graph's max batch size to the one with the highest throughput.
        Returns ``self``.
        """
        self.find_max_batch_size = bool(enable)
        return self

    def set_find_max_batch_size_profiling_config(self, profiling: ProfilingConfig) -> TuneStrategy:
        """Measure the max-batch-size search with ``profiling`` instead of the strategy's own. Returns ``self``."""
        if not isinstance(profiling, ProfilingConfig):
            raise ConfigError(
                f"set_find_max_batch_size_profiling_config needs a torch_tweak.torch.profiling.ProfilingConfig, got "
                f"{type(profiling).__name__}. The reference's ProfilingConfig (batch sizes, stop strategies) has no "
                "equivalent here: the search always tries powers of two up to max_batch_size_limit."
            )
        self._search_profiling = profiling
        return self

    def set_find_max_batch_size_default_backend_class(self, backend_class: type[Backend]) -> TuneStrategy:
        """Run the max-batch-size search on ``backend_class()`` (default: eager). Returns ``self``."""
        if not (isinstance(backend_class, type) and issubclass(backend_class, Backend)):
            raise ConfigError(f"set_find_max_batch_size_default_backend_class needs a Backend subclass (e.g. "
                              f"TorchEagerBackend), got {backend_class!r}.")
        self._search_backend = backend_class()
        return self

    def batch_search_baseline(self) -> Backend:
        """The backend the max-batch-size search measures."""
        return self._search_backend if self._search_backend is not None else TorchEagerBackend()

    def batch_search_measure(self) -> Measure:
        """How the max-batch-size search measures a built backend."""
        profiling = self._search_profiling or ProfilingConfig()
        return lambda backend, task, plan, cancel: sweep_backend(backend, task.graph_spec, task.device, plan,
                                                                 profiling, cancel)

    def enable_correctness_check(self, enable: bool = True) -> TuneStrategy:
        """Turn the fidelity check on or off (on by default). Returns ``self``."""
        self._correctness_check = bool(enable)
        return self

    def clone(self) -> TuneStrategy:
        """A deep copy of this strategy."""
        return copy.deepcopy(self)

    def describe(self) -> str:
        """One line naming the strategy and its candidates."""
        return f"{self.__class__.__name__}({', '.join(b.describe() for b in self.candidates())})"

    def candidates(self) -> list[Backend]:
        """The backend templates this strategy may try."""
        return []

    def keeps_recorded_calls(self) -> bool:
        """Whether tuning should keep more of a graph's calls on disk for this strategy
        (``tt.config.max_num_calibration_samples``): a candidate calibrates on them, or the fidelity check is on
        and judges a quantized candidate or by a task metric, so calls no calibration saw must be judged."""
        templates = self.candidates()
        if any(t.needs_calibration for t in templates):
            return True
        return self._correctness_check and (self.fidelity.task is not None or any(t.quantized for t in templates))

    def tune(self, task: GraphTask) -> Backend:
        """Choose, build and return the backend for ``task``'s graph."""
        task.report.strategy = self.describe()
        start = time.perf_counter()
        with pristine(task.module):
            backend = self._tune(task)
        logger.info("%s graph %s: chose %s in %.1fs", task.module_name, task.graph_spec.name, backend.describe(),
                    time.perf_counter() - start)
        return backend

    @abstractmethod
    def _tune(self, task: GraphTask) -> Backend:
        """Return a built, active, checked backend, or raise."""

    def try_backend(self, template: Backend, task: GraphTask, role: str = "candidate", confirm: bool = False,
                    before_check: Callable[[Backend, CandidateReport], None] | None = None,
                    judged: CandidateReport | None = None,
                    built: tuple[Backend, float] | None = None) -> tuple[Backend, CandidateReport]:
        """Build and check a copy of ``template``; raises :class:`CandidateFailedError` with the report row.

        Returns the built copy, or that copy behind the non-finite guard (the row's ``backend`` says so): what the
        strategy measures and may choose. ``confirm`` checks a build whose outputs were judged before (the same
        artifact rebuilt, or a twin; the eager baseline against its own recordings) on the in-memory call of the
        smallest batch, on every judged call only if that one fails; ``judged`` is the judged build's row, whose
        non-finite probe outcome it keeps. ``before_check`` runs on the built copy and its row before the check
        and may end the candidate by raising :class:`CandidateFailedError` (screening a candidate too slow).
        ``built``: the copy built already by :func:`build_in_cache` (ahead of its turn) and its build seconds."""
        row = CandidateReport(backend=template.describe(), key=template.key(), role=role)
        task.report.candidates.append(row)
        progress.update(candidate=row.backend, phase="build")
        row.log_path = str(task.cache_dir / template.key() / "build.log")
        if built is not None:
            backend, row.build_time_s = built
        else:
            backend, start = copy.deepcopy(template), time.perf_counter()
            try:
                build_in_cache(backend, task, config.console_output)
            except Exception as exc:
                row.build_time_s = time.perf_counter() - start
                row.status = BUILD_FAILED
                row.error = f"{type(exc).__name__}: {exc} (build log: {row.log_path})"
                raise CandidateFailedError(row) from exc
            row.build_time_s = time.perf_counter() - start
        row.precision = backend.executed_precision
        if before_check is not None:
            before_check(backend, row)
        if self._correctness_check:
            progress.update(phase="check")
            backend = self._check(backend, task, row, confirm, judged)
        row.status = PASSED
        if getattr(self, "profiling", None) is not None:  # measuring strategies measure next
            progress.update(phase="measure")
        return backend, row

    def _check(self, backend: Backend, task: GraphTask, row: CandidateReport, confirm: bool = False,
               judged: CandidateReport | None = None) -> Backend:
        """Compare ``backend`` on the recorded calls (:meth:`GraphTask.judged_calls`: the in-memory samples and
        the held-out calls kept on disk, one at a time), then probe it; returns it, or it behind the guard.
        ``confirm``: the smallest in-memory call alone when it passes (it shows that the artifact computes what was
        judged; one call can fail a pooled task metric that every call passes: then every call is judged), and the
        probe outcome of ``judged`` (a ResNet-50 rebuilt on 2 cores: 0.3 s to build and confirm, 8.6 s with every
        in-memory call up to batch 32 and both probes); a ``judged`` row in another precision is no confirmation."""

        def outputs(held_out_calls: bool = True, smallest_only: bool = False) -> Iterator[tuple[Any, Any, bool]]:
            for (args, kwargs), expected, held_out in task.judged_calls(held_out_calls, smallest_only):
                try:
                    with torch.no_grad():
                        start = time.perf_counter()
                        actual = backend.infer(*args, **kwargs)
                        warm_calls.note(backend, args, kwargs, time.perf_counter() - start)
                except Exception as exc:
                    row.status = INFER_FAILED
                    row.error = f"{type(exc).__name__}: {exc}"
                    release_quietly(backend)
                    raise CandidateFailedError(row) from exc
                yield expected, actual, held_out

        precision = row.precision or "fp32"
        confirm = confirm and (judged is None or judged.precision == row.precision)
        result = check_calls(outputs(False, True), precision, self.fidelity) if confirm and task.samples else None
        if result is None or not result.passed:
            result = check_calls(outputs(), precision, self.fidelity)
        elif judged is not None:
            result.judged_with = judged.backend  # its other calls were judged on that build
        if result is None:
            return backend
        sample = probe_sample(task.samples)
        known = judged_probe_outcome(judged.fidelity) if confirm and judged is not None else None
        if result.passed and self.fidelity.check_non_finite and sample is not None:
            if known is not None:  # the same artifact as the judged build: its probe outcome stands
                guarded, reason = known
                if guarded and self.fidelity.non_finite == NON_FINITE_GUARD:
                    backend = NonFiniteGuardBackend(backend, task.module, task.graph_spec, f"fidelity probe: {reason}")
                    row.backend = backend.describe()
            else:
                probes = probe_non_finite(task.module, backend.infer, sample, task.graph_spec)
                if self.fidelity.non_finite == NON_FINITE_GUARD and any(p.status == PROBE_FAILED for p in probes):
                    backend, probes = _guard(backend, task, row, sample, probes)
                result.add_probes(probes)
        row.fidelity = result.to_dict()
        if not result.passed:
            row.status = REJECTED
            detail = "" if result.failed_probe() else f" (tolerance for {result.precision}: {result.tolerance})"
            row.error = f"FidelityError: {result.message}{detail}"
            release_quietly(backend)
            raise CandidateFailedError(row) from FidelityError(row.error)
        return backend


def _guard(backend: Backend, task: GraphTask, row: CandidateReport, sample: Sample,
           probes: list[NonFiniteProbe]) -> tuple[Backend, list[NonFiniteProbe]]:
    """Run the probes again through a :class:`NonFiniteGuardBackend` around ``backend``; when they pass, return
    a guard (its overhead is then measured with it) and the probes marked ``guarded``, else ``backend``."""
    failed = next(p for p in probes if p.status == PROBE_FAILED)
    reason = f"fidelity probe: {failed.message}"
    proof = NonFiniteGuardBackend(backend, task.module, task.graph_spec, reason, quiet=True)
    merged = guarded_probes(probes, probe_non_finite(task.module, proof.infer, sample, task.graph_spec))
    if any(p.status == PROBE_FAILED for p in merged):
        return backend, merged
    guard = NonFiniteGuardBackend(backend, task.module, task.graph_spec, reason)  # warns at the first real diversion
    logger.info("%s: %s does not propagate NaN/inf like eager; it is kept behind the non-finite guard (calls with "
                "NaN/inf inputs run the module's original code, so its weights stay in memory)",
                describe_task(task), row.backend)
    row.backend = guard.describe()
    return guard, merged


def release_scratch(backend: Backend) -> None:
    """:meth:`Backend.release_scratch` on ``backend`` and every backend it delegates to (a router's routes, a
    guard's inner backend): a built candidate that waits, or serves, need not keep its largest batch's buffers."""
    for component in backend.components():
        component.release_scratch()
        warm_calls.forget(component)  # the components include the backend itself


def build_in_cache(backend: Backend, task: GraphTask, console: bool) -> None:
    """Build ``backend`` (a copy of a candidate template) for ``task`` in its folder of the task's cache, where
    ``build.log`` captures what the build prints (shown too with ``console``)."""
    cache_dir = secure_mkdir(task.cache_dir / backend.key())
    touch(cache_dir)  # recently used: the cache's size limit deletes the least recently used first
    with capture_output(cache_dir / "build.log", console=console):
        backend.build(task.module, task.graph_spec, task.build_data(backend), task.device, cache_dir)


def release_quietly(backend: Backend) -> None:
    """:meth:`Backend.release` for a candidate a strategy drops: an error while releasing is logged, never
    raised, so it cannot hide the error that made the candidate fail."""
    try:
        backend.release()
    except Exception:  # noqa: BLE001 - see the docstring
        logger.debug("Could not deactivate candidate %s", backend.describe(), exc_info=True)


def format_failures(rows: list[CandidateReport]) -> str:
    """``backend: error`` lines for an error message."""
    return "; ".join(f"{r.backend}: {r.error}" for r in rows) or "no candidate was tried"


def describe_task(task: GraphTask) -> str:
    """``module 'x' graph 0`` for messages."""
    return f"module {task.module_name!r} graph {task.graph_spec.name}"
