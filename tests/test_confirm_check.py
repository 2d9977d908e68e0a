"""Confirming checks (torch_tweak/torch/tune_strategy/base.py, result_cache.py): a build whose outputs were judged
before (the eager baseline against its own recordings, a reused or worker-measured candidate built again to serve,
a twin of a judged candidate: the same artifact scheduled differently, ``Backend.outputs_key``) is judged on the in-memory call of the smallest batch, and on every recorded call only when that one does not pass;
a rebuilt candidate keeps the judged build's non-finite probe outcome instead of probing again.

Each dataset item is tagged by its value (item ``i`` is ``full(i)``), so the task metric shows which recorded calls
judged a candidate. A task metric makes tuning keep held-out calls on disk (tt.config.max_num_calibration_samples).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import torch_tweak.torch as tt
from torch_tweak.torch.fidelity import FidelityConfig
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.report.metrics import format_fidelity
from torch_tweak.torch.testing import FakeClock, TimedBackend

JUDGED: list[tuple[float, ...]] = []  # the tags of each call the task metric saw, in order
MISMATCH: set[float] = set()  # tags on which Flipping backends swap the two scores
POISONED: list[int] = []  # calls with a NaN or inf input that reached a NaNHiding backend


class Scores(nn.Module):
    """Two class scores per row, the first one larger for every positive input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[:, 0], -x[:, 0]], dim=1)


class Flipping(TimedBackend):
    """Eager, except that rows whose tag is in :data:`MISMATCH` get their two scores swapped (a wrong top-1)."""

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._infer(*args, **kwargs)
        flip = torch.tensor([float(v) in MISMATCH for v in args[0][:, 0]])
        return torch.where(flip[:, None], out.flip(1), out)


class NaNHiding(TimedBackend):
    """Eager, except that NaN outputs become 0 (as OpenVINO's ReLU does): the probes put it behind the guard."""

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        if not bool(torch.isfinite(args[0]).all()):
            POISONED.append(1)
        return torch.nan_to_num(super()._infer(*args, **kwargs), nan=0.0)


IN_MEMORY = [(1.0,), (1.0, 2.0)]
SMALLEST = IN_MEMORY[:1]  # the in-memory call of the smallest batch


def tagged(count: int) -> list[torch.Tensor]:
    return [torch.full((4,), float(i + 1)) for i in range(count)]


def recording_metric(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    JUDGED.append(tuple(float(v) for v in reference[:, 0]))
    return 1.0 - float((reference - candidate).abs().max())


@pytest.fixture
def clock() -> FakeClock:
    JUDGED.clear()
    MISMATCH.clear()
    POISONED.clear()
    return FakeClock()


def tune(clock: FakeClock, fidelity: FidelityConfig, candidate: TimedBackend | None = None,
         count: int = 64) -> tuple[dict[str, Any], Any]:
    strategy = tt.HighestThroughputStrategy([candidate or TimedBackend(clock, ms_per_call=0.5)],
                                            profiling=ProfilingConfig(clock=clock, pause_s=0, min_time_s=0),
                                            baseline=TimedBackend(clock, ms_per_call=1.0), fidelity=fidelity)
    model = tt.Module(Scores(), strategy=strategy)
    report = tt.tune(model, tagged(count), batch_sizes=[1, 2], executor="inline", ignore_failing_modules=False)
    graph = report.modules[0].graphs[0]
    return {row.role: row for row in graph.candidates}, graph


def test_the_baseline_is_judged_on_its_smallest_call_and_the_candidates_on_every_call(clock: FakeClock) -> None:
    rows, graph = tune(clock, FidelityConfig(metric=recording_metric, threshold=0.99))
    baseline, candidate = rows["baseline"], rows["candidate"]
    assert (baseline.fidelity["samples"], baseline.fidelity["held_out_samples"]) == (1, 0)
    assert JUDGED[:1] == SMALLEST  # the baseline: the in-memory call of batch size 1
    held_out = candidate.fidelity["held_out_samples"]
    assert held_out > 10 and candidate.fidelity["samples"] == 2 + held_out
    assert JUDGED[1:3] == IN_MEMORY and len(JUDGED) == 3 + held_out  # the first call at each batch size, then the rest
    assert graph.chosen == candidate.backend


def test_a_rebuilt_result_is_confirmed_on_its_smallest_call_and_keeps_the_full_check(clock: FakeClock) -> None:
    fidelity = FidelityConfig(metric=recording_metric, threshold=0.99)
    first, _ = tune(clock, fidelity)
    JUDGED.clear()
    second, graph = tune(clock, fidelity)  # every result reused; the chosen one is built again to serve
    assert second["candidate"].reused and graph.chosen == second["candidate"].backend
    assert JUDGED == SMALLEST  # the confirming check only
    assert second["candidate"].fidelity == first["candidate"].fidelity  # the report shows the full check


def test_a_rebuilt_result_keeps_the_guard_its_probes_asked_for_without_probing_again(clock: FakeClock) -> None:
    first, graph = tune(clock, FidelityConfig(), NaNHiding(clock, ms_per_call=0.5))
    assert first["candidate"].backend.endswith("+ non-finite guard") and graph.chosen == first["candidate"].backend
    assert POISONED  # the probes of the first run reached the candidate
    POISONED.clear()
    second, graph = tune(clock, FidelityConfig(), NaNHiding(clock, ms_per_call=0.5))
    assert second["candidate"].reused and graph.chosen == first["candidate"].backend
    assert not POISONED  # the rebuild kept the judged outcome: no probe ran
    assert second["candidate"].fidelity["non_finite"] == first["candidate"].fidelity["non_finite"]
    assert {p["status"] for p in first["candidate"].fidelity["non_finite"]} == {"guarded"}


def test_when_the_in_memory_samples_fail_a_pooled_metric_every_call_is_judged(clock: FakeClock) -> None:
    """Top-1 agreement pools over rows: tag 1 wrong fails 0.85 on the in-memory rows (2 of 3 wrong), not on all of
    them (2 of 19 wrong: those 3 and the 16 held-out calls at batch size 1)."""
    fidelity = FidelityConfig(metric="topk", k=1, threshold=0.85)
    first, _ = tune(clock, fidelity, Flipping(clock, ms_per_call=0.5))
    assert first["candidate"].status == "chosen"
    MISMATCH.add(1.0)  # the rebuilt candidate now gets the first in-memory call wrong
    second, graph = tune(clock, fidelity, Flipping(clock, ms_per_call=0.5))
    assert graph.chosen == second["candidate"].backend and second["candidate"].status == "chosen"
    MISMATCH.update(float(i) for i in range(65))  # every answer wrong: the whole set fails too
    third, graph = tune(clock, fidelity, Flipping(clock, ms_per_call=0.5))
    assert third["candidate"].status == "rejected" and "top1" in third["candidate"].error
    assert graph.chosen == third["baseline"].backend


class Twin(TimedBackend):
    """Eager outputs under one outputs key (the same artifact scheduled differently); label ``wrong`` breaks that
    promise and swaps every row's scores."""

    def outputs_key(self) -> str | None:
        return "Twin_same_outputs"

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._infer(*args, **kwargs)
        return out.flip(1) if self.timing.label == "wrong" else out


def tune_twins(clock: FakeClock, second: str) -> list[Any]:
    strategy = tt.HighestThroughputStrategy(
        [Twin(clock, ms_per_call=0.5, label="first"), Twin(clock, ms_per_call=0.4, label=second)],
        profiling=ProfilingConfig(clock=clock, pause_s=0, min_time_s=0), baseline=TimedBackend(clock, ms_per_call=1.0),
        fidelity=FidelityConfig(metric=recording_metric, threshold=0.99))
    report = tt.tune(tt.Module(Scores(), strategy=strategy), tagged(64), batch_sizes=[1, 2], executor="inline",
                     ignore_failing_modules=False)
    return [row for row in report.modules[0].graphs[0].candidates if row.role == "candidate"]


def test_a_twin_of_a_judged_candidate_is_confirmed_on_its_smallest_call(clock: FakeClock) -> None:
    first, second = tune_twins(clock, "second")
    held_out = first.fidelity["held_out_samples"]
    assert first.fidelity["samples"] == 2 + held_out and first.fidelity["judged_with"] is None
    assert JUDGED[1 + first.fidelity["samples"]:] == SMALLEST  # after the baseline's call and the first's check
    assert (second.fidelity["samples"], second.fidelity["judged_with"]) == (1, first.backend)
    assert second.status == "chosen"
    assert format_fidelity(second).endswith(f"; 1 call like {first.backend})")


def test_a_twin_that_differs_on_its_confirming_call_is_judged_on_every_call(clock: FakeClock) -> None:
    first, second = tune_twins(clock, "wrong")
    assert first.status == "chosen" and second.status == "rejected" and "FidelityError" in second.error
    assert JUDGED[-2:] == [*SMALLEST, IN_MEMORY[0]]  # its confirming call failed: the full check began again
    assert second.fidelity["judged_with"] is None


def test_openvino_configurations_that_differ_only_in_their_hint_share_an_outputs_key() -> None:
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig, TorchInductorBackend

    def key(**fields: Any) -> str | None:
        return OpenVINOBackend(OpenVINOBackendConfig(**fields)).outputs_key()

    assert key() == key(performance_hint="THROUGHPUT") is not None
    assert key(quantization="int8") == key(quantization="int8", performance_hint="THROUGHPUT") != key()
    assert key(inference_precision="f32") != key()
    assert TorchInductorBackend().outputs_key() is None and TimedBackend(FakeClock()).outputs_key() is None
