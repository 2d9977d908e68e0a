"""Recorded calls kept on disk for calibration and held-out fidelity checks (torch_tweak/torch/module/sample_store.py).

Each dataset item is tagged by its value (item ``i`` is ``full(i)``), so a backend's build data and a task metric's
inputs show exactly which recorded calls calibrated a candidate and which judged it. Tiny models, seconds each.
"""

from __future__ import annotations

import gc
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.fidelity import FidelityConfig
from torch_tweak.torch.module.recording import Recorder
from torch_tweak.torch.module.sample_store import STORE_PREFIX, SampleStore, is_held_out
from torch_tweak.torch.module.tree import flatten_sample
from torch_tweak.torch.report.report import CandidateStatus

CALIBRATED: list[list[float]] = []  # the tags each calibrating build received


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class QuantizedEager(TorchEagerBackend):
    """Eager, but declared int8: the fidelity check judges it on held-out calls; it calibrates on nothing."""

    @property
    def executed_precision(self) -> str:
        return "int8"


class ClampingBackend(QuantizedEager):
    """Calibrates an input range on its build data and clamps inputs to it, as int8 saturates: exact on the calls it
    calibrated on, wrong on a larger held-out input."""

    @property
    def needs_calibration(self) -> bool:
        return True

    def _build(self, module: nn.Module, graph_spec: Any, data: Any, cache_dir: Path) -> Any:
        tags = [float(args[0].reshape(-1)[0]) for args, _ in data]
        CALIBRATED.append(tags)
        self._range = (min(tags), max(tags))
        return super()._build(module, graph_spec, data, cache_dir)

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return super()._infer(args[0].clamp(*self._range), **kwargs)


def tagged(values: list[float]) -> list[torch.Tensor]:
    return [torch.full((4,), float(v)) for v in values]


def tag_metric(seen: list[float]) -> Any:
    def metric(reference: torch.Tensor, candidate: torch.Tensor) -> float:
        seen.append(float(reference.reshape(-1)[0]) / 2.0)  # Double: the reference is twice the input tag
        return 1.0 - float((reference - candidate).abs().max())

    return metric


@pytest.fixture()
def stores(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What every store held when tuning removed it: its folder, call count and files."""
    removed: list[dict[str, Any]] = []
    original = SampleStore.remove

    def remove(self: SampleStore) -> None:
        removed.append({"folder": self.folder, "count": self.count, "files": sorted(p.name for p in self.folder.iterdir())})
        original(self)

    monkeypatch.setattr(SampleStore, "remove", remove)
    CALIBRATED.clear()
    return removed


def leftover_stores(root: Path) -> list[Path]:
    return list(root.rglob(f"{STORE_PREFIX}*")) if root.exists() else []


# the split and the setting -------------------------------------------------------------------------------------


def test_split_is_deterministic_a_quarter_held_out_at_least_one_each() -> None:
    for count in range(2, 40):
        held = [i for i in range(count) if is_held_out(i)]
        assert 1 <= len(held) < count
    assert not is_held_out(0)
    assert sum(is_held_out(i) for i in range(128)) == 32


def test_setting_is_validated() -> None:
    assert tt.config.max_num_calibration_samples == 128
    tt.config.max_num_calibration_samples = 0
    for bad in (-1, 2.5, "8", True, None):
        with pytest.raises(ConfigError, match="max_num_calibration_samples must be an integer"):
            tt.config.max_num_calibration_samples = bad


# recording -----------------------------------------------------------------------------------------------------


def test_recording_stops_at_the_bound_on_disk_in_the_work_folder_and_is_removed(stores: list[dict[str, Any]]) -> None:
    tt.config.max_num_calibration_samples = 5
    model = tt.Module(Double(), name="double", strategy=tt.OneBackendStrategy(QuantizedEager()))
    tt.tune(model, tagged(list(range(20))), batch_sizes=[1, 2])
    (store,) = stores
    assert store["count"] == 5
    assert store["files"] == [f"call-{i:06d}.safetensors" for i in range(5)]
    assert store["folder"].parent == tt.config.cache_dir / "double" / "0"  # the graph's work folder
    assert not store["folder"].exists() and leftover_stores(tt.config.cache_dir) == []


def test_stores_are_removed_when_tuning_fails(stores: list[dict[str, Any]]) -> None:
    class Broken(QuantizedEager):
        def _build(self, *args: Any) -> Any:
            raise RuntimeError("no")

    model = tt.Module(Double(), name="broken", strategy=tt.OneBackendStrategy(Broken()))
    with pytest.raises(RuntimeError, match="no"):
        tt.tune(model, tagged(list(range(6))), batch_sizes=[1], ignore_failing_modules=False)
    assert [s["count"] for s in stores] == [5] and leftover_stores(tt.config.cache_dir) == []


@pytest.mark.parametrize("strategy", [
    tt.OneBackendStrategy(TorchEagerBackend()),
    tt.FirstWinsStrategy([TorchEagerBackend()]),
    tt.OneBackendStrategy(QuantizedEager()).enable_correctness_check(False),  # nothing would judge held-out calls
])
def test_nothing_extra_is_recorded_without_quantized_candidates_or_a_metric(
        strategy: tt.TuneStrategy, stores: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    captured: list[int] = []
    monkeypatch.setattr(SampleStore, "capture", staticmethod(lambda leaves: captured.append(1) or leaves))
    model = tt.Module(Double(), name="plain", strategy=strategy)
    report = tt.tune(model, tagged(list(range(12))), batch_sizes=[1, 2])
    assert stores == [] and captured == [] and leftover_stores(tt.config.cache_dir) == []
    fidelity = report.modules[0].graphs[0].candidates[0].fidelity
    assert fidelity is None or (fidelity["samples"], fidelity["held_out_samples"]) == (2, 0)  # the in-memory ones


def test_a_task_metric_or_a_strategy_per_graph_decides_per_graph(stores: list[dict[str, Any]]) -> None:
    metric = tt.FirstWinsStrategy([TorchEagerBackend()], fidelity=FidelityConfig(metric="cosine"))
    model = tt.Module(Double(), name="metric", strategy=metric)
    tt.tune(model, tagged(list(range(6))), batch_sizes=[1])
    assert [s["count"] for s in stores] == [5]

    class TwoGraphs(nn.Module):
        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return x * scale

    stores.clear()
    model = tt.Module(TwoGraphs(), name="two", strategies=[tt.OneBackendStrategy(TorchEagerBackend()),
                                                           tt.OneBackendStrategy(QuantizedEager())])
    tt.tune(lambda x: model(x, scale=1.0 if float(x[0, 0]) < 5 else 2.0), tagged([0, 1, 2, 9, 8, 7]), batch_sizes=[1])
    assert [(s["folder"].parent.name, s["count"]) for s in stores] == [("1", 2)]  # the quantized strategy's graph


def test_a_stored_call_round_trips_its_structure_devices_and_outputs(tmp_path: Path) -> None:
    def forward(x: torch.Tensor, *, extra: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x + 1, {"sum": x + extra["bias"]}

    store = SampleStore(tmp_path, limit=3)
    recorder = Recorder(strict=True, max_samples=1, stores=lambda index, name: store)
    calls = [((torch.full((2, 3), float(i)),), {"extra": {"bias": torch.ones(3), "flag": True}}) for i in range(5)]
    with torch.no_grad():
        for args, kwargs in calls:
            recorder.record_call(forward, args, kwargs, 2)
    assert store.count == 3 and len(store.calibration()) == 2 and len(store.held_out()) == 1
    (args, kwargs), outputs, batch = store.held_out()[0]  # call 2 (the first call stayed in memory)
    assert batch == 2 and kwargs["extra"]["flag"] is True
    torch.testing.assert_close(args[0], calls[2][0][0])
    torch.testing.assert_close(outputs[1]["sum"], forward(*calls[2][0], **calls[2][1])[1]["sum"])
    assert [float(a[0][0, 0]) for a, _ in store.calibration()] == [1.0, 3.0]
    assert store.load(0)[1] is None  # calibrating calls keep no outputs
    store.remove()
    assert not store.folder.exists() and not store.wants_call()


def test_calibration_takes_the_first_calibrating_calls_up_to_a_number_of_samples(tmp_path: Path) -> None:
    store = SampleStore(tmp_path, limit=8)
    sizes = [4, 4, 2, 8, 1, 1, None, 1]  # calls 1 and 5 are held out
    for index, size in enumerate(sizes):
        x = torch.full((size or 1, 3), float(index))
        store.add([x], ["cpu"], flatten_sample((x,), {})[1], x + 1, size)
    assert store.batch_size(3) == 8 and store.batch_size(6) is None

    def first_values(calls):
        return [float(args[0][0, 0]) for args, _ in calls]

    assert first_values(store.calibration()) == [0.0, 2.0, 3.0, 4.0, 6.0, 7.0]
    assert first_values(store.calibration(max_samples=6)) == [0.0, 2.0]  # 4 + 2; call 3 would make 14
    assert first_values(store.calibration(max_samples=14)) == [0.0, 2.0, 3.0]
    assert first_values(store.calibration(max_samples=16)) == [0.0, 2.0, 3.0, 4.0, 6.0]  # no batch size: one sample
    assert first_values(store.calibration(max_samples=1)) == [0.0]  # one call at least, however large
    store.remove()


def test_calls_that_cannot_be_rebuilt_or_differ_are_not_stored(tmp_path: Path) -> None:
    class Opaque:
        pass

    store = SampleStore(tmp_path, limit=4)
    store.add([torch.ones(1)], ["cpu"], flatten_sample((torch.ones(1), Opaque()), {})[1], torch.ones(1), 1)
    assert store.count == 0 and store.stopped is not None and "rebuilt" in store.stopped

    store = SampleStore(tmp_path, limit=4)
    for scale in (1.0, 2.0, 1.0):  # strict_mode off: one graph, other non-tensor values
        leaves, structure = flatten_sample((torch.ones(1),), {"scale": scale})
        store.add(store.capture(leaves), ["cpu"], structure, torch.ones(1), 1)
    assert store.count == 2 and store.stopped is None


# calibration and the fidelity check ------------------------------------------------------------------------------


def test_calibration_and_judged_calls_are_disjoint_and_every_candidate_is_judged_on_the_same(
        stores: list[dict[str, Any]]) -> None:
    judged: list[float] = []
    fidelity = FidelityConfig(metric=tag_metric(judged), threshold=0.999, check_non_finite=False)
    strategy = tt.FirstWinsStrategy([ClampingBackend(), TorchEagerBackend()], fidelity=fidelity)
    model = tt.Module(Double(), name="split", strategy=strategy)
    report = tt.tune(model, tagged([6.5, *range(1, 13)]), batch_sizes=[1])  # item 0 in memory, 1..12 kept on disk
    (calibrated,) = CALIBRATED
    held_out = [float(1 + i) for i in range(12) if is_held_out(i)]
    assert held_out == [2.0, 6.0, 10.0]
    assert sorted(calibrated) == sorted(set(map(float, range(1, 13))) - set(held_out))
    assert judged == [6.5, *held_out]  # the in-memory sample, then the held-out calls
    assert not set(calibrated) & set(judged)
    (row,) = report.modules[0].graphs[0].candidates
    assert row.status == CandidateStatus.CHOSEN and row.fidelity["metric_value"] == 1.0  # within the range
    assert (row.fidelity["samples"], row.fidelity["held_out_samples"]) == (4, 3)
    assert "3 of 4 calls held out" in str(report)


def test_a_candidate_that_passes_on_calibration_calls_but_not_on_held_out_ones_is_rejected(
        stores: list[dict[str, Any]]) -> None:
    values = [1, 1, 100, 1, 1, 1]  # item 2 is the first held-out call: outside the calibrated range [1, 1]
    strategy = tt.FirstWinsStrategy([ClampingBackend(), TorchEagerBackend()])
    model = tt.Module(Double(), name="clamp", strategy=strategy)
    report = tt.tune(model, tagged(values), batch_sizes=[1])
    clamping, eager = report.modules[0].graphs[0].candidates
    assert CALIBRATED == [[1.0, 1.0, 1.0, 1.0]]
    assert clamping.status == CandidateStatus.REJECTED and clamping.error.startswith("FidelityError:")
    assert (clamping.fidelity["samples"], clamping.fidelity["held_out_samples"]) == (2, 1)  # failed at the first
    assert eager.status == CandidateStatus.CHOSEN
    assert (eager.fidelity["samples"], eager.fidelity["held_out_samples"]) == (2, 1)  # judged on the same calls

    CALIBRATED.clear()  # the same candidate, judged on the in-memory samples only, is accepted
    tt.config.max_num_calibration_samples = 0
    model = tt.Module(Double(), name="clamp_memory", strategy=tt.FirstWinsStrategy([ClampingBackend()]))
    report = tt.tune(model, tagged(values), batch_sizes=[1])
    (row,) = report.modules[0].graphs[0].candidates
    assert row.status == CandidateStatus.CHOSEN and CALIBRATED == [[1.0]]


# the checkpoint stores the calibrated IR -------------------------------------------------------------------------


def test_checkpoint_stores_the_ir_calibrated_on_the_kept_calls(tmp_path: Path, stores: list[dict[str, Any]]) -> None:
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()

    backend = OpenVINOBackend(OpenVINOBackendConfig(quantization="int8"))
    strategy = tt.OneBackendStrategy(backend, fidelity=FidelityConfig(metric="cosine", threshold=0.9))
    model = tt.Module(mlp(), name="mlp", strategy=strategy)
    torch.manual_seed(1)
    report = tt.tune(model, [torch.randn(16) for _ in range(12)], batch_sizes=[1, 2])
    (row,) = report.modules[0].graphs[0].candidates
    assert row.status == CandidateStatus.CHOSEN and row.fidelity["held_out_samples"] > 0
    (chosen,) = model.backends.values()
    xml = next(b for b in chosen.components() if isinstance(b, OpenVINOBackend))._ov_model_xml
    assert "FakeQuantize" in xml.read_text()
    path = tt.save(model, tmp_path / "int8.tt")
    with zipfile.ZipFile(path) as archive:
        (member,) = [n for n in archive.namelist() if n.endswith("model.xml")]
        assert archive.read(member) == xml.read_bytes()
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(x)
    del model, chosen
    gc.collect()  # the tuned module's name is free again
    with torch.no_grad():
        torch.testing.assert_close(tt.load(mlp(), path)(x), expected)
