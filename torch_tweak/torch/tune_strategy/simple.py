"""Strategies that do not measure: OneBackendStrategy and FirstWinsStrategy."""

from __future__ import annotations

from collections.abc import Iterable

from torch_tweak.errors import ConfigError, TuningError
from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.registry import backends_from, default_candidates
from torch_tweak.torch.fidelity import FidelityConfig
from torch_tweak.torch.report.report import CHOSEN
from torch_tweak.torch.tune_strategy.base import (
    CandidateFailedError,
    GraphTask,
    TuneStrategy,
    describe_task,
    format_failures,
)
from torch_tweak.torch.tune_strategy.batch_search import search_if_enabled


class OneBackendStrategy(TuneStrategy):
    """Build and check exactly one backend; its failure is re-raised as the original error.

    For production, once you know which backend works for a module.
    """

    def __init__(self, backend: Backend, fidelity: FidelityConfig | None = None) -> None:
        super().__init__(fidelity)
        if backend is None:
            raise ConfigError("OneBackendStrategy needs a backend, e.g. OneBackendStrategy(TorchEagerBackend()).")
        self.backend = backends_from([backend], "OneBackendStrategy")[0]

    def candidates(self) -> list[Backend]:
        """The single backend."""
        return [self.backend]

    def _tune(self, task: GraphTask) -> Backend:
        search_if_enabled(self, task)
        try:
            backend, row = self.try_backend(self.backend, task)
        except CandidateFailedError as failure:
            raise (failure.__cause__ or failure) from None
        row.status = CHOSEN
        task.report.chosen = row.backend
        task.report.reason = "the only candidate"
        return backend


class FirstWinsStrategy(TuneStrategy):
    """Try backends in order; the first that builds and passes the fidelity check wins.

    Order them from fastest to most compatible. Failures are kept in the report; if every backend
    fails, :class:`TuningError` lists them.
    """

    def __init__(self, backends: Iterable[Backend] | None = None, fidelity: FidelityConfig | None = None) -> None:
        super().__init__(fidelity)
        self._backends = backends_from(backends, "FirstWinsStrategy")

    def candidates(self) -> list[Backend]:
        """The backends in the order they are tried (the defaults when none were given)."""
        if self._backends:
            return list(self._backends)
        return default_candidates()

    def _tune(self, task: GraphTask) -> Backend:
        search_if_enabled(self, task)
        failures = []
        for template in self.candidates():
            try:
                backend, row = self.try_backend(template, task)
            except CandidateFailedError as failure:
                failures.append(failure.report)
                continue
            row.status = CHOSEN
            task.report.chosen = row.backend
            task.report.reason = "first candidate that built and passed the fidelity check"
            return backend
        raise TuningError(f"There is no valid backend for {describe_task(task)}: {format_failures(failures)}")
