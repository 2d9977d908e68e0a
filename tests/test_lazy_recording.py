"""Tuning the same model again records it without running the calls whose output shapes are known
(torch_tweak/torch/module/known_shapes.py); what a check reads is still the module's own eager output."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from toy_models import KwargsModel, Pair

import torch_tweak.torch as tt
from torch_tweak.torch.cache_limit import cache_items
from torch_tweak.torch.module.known_shapes import KnownShapes, module_key
from torch_tweak.torch.module.recording import Recorder
from torch_tweak.torch.module.sample_store import SampleStore
from torch_tweak.torch.module.tree import map_tensors
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.report.report import CandidateStatus
from torch_tweak.torch.testing import FakeClock, TimedBackend


class Counting(nn.Module):
    """A small MLP that counts its forward calls (the count is not a weight)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.b(torch.relu(self.a(x)))


class Outer(nn.Module):
    """Counting with a wrapped inner module."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.inner = tt.Module(Counting(), strategy=strategy(clock))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


class Int8(TimedBackend):
    """Eager outputs declared int8: the strategy keeps held-out calls on disk and judges it on them."""

    @property
    def executed_precision(self) -> str:
        return "int8"


class WrongInt8(Int8):
    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return map_tensors(super()._infer(*args, **kwargs), lambda t: t + 1.0)


DATA = [torch.randn(8) for _ in range(24)]


def strategy(clock: FakeClock, *extra: TimedBackend) -> tt.HighestThroughputStrategy:
    return tt.HighestThroughputStrategy([Int8(clock, ms_per_call=0.5), *extra],
                                        profiling=ProfilingConfig(clock=clock, pause_s=0, min_time_s=0),
                                        baseline=TimedBackend(clock, ms_per_call=1.0))


def tune(model: nn.Module, clock: FakeClock, *extra: TimedBackend, data: Any = DATA,
         **kwargs: Any) -> tuple[tt.Module, Any]:
    wrapped = tt.Module(model, strategy=strategy(clock, *extra))
    report = tt.tune(wrapped, data, batch_sizes=[1, 2, 4], ignore_failing_modules=False, **kwargs)
    return wrapped, report.modules[0].graphs[0]


def test_second_run_skips_the_calls_it_knows_and_decides_the_same() -> None:
    clock = FakeClock()
    first = Counting()
    _, graph = tune(first, clock)
    second = Counting()
    wrapped, again = tune(second, clock)
    assert first.calls >= len(DATA) + 2
    assert second.calls <= 6, second.calls  # two recorded for real, the smallest sample's confirming check
    assert again.chosen == graph.chosen and all(row.reused for row in again.candidates)
    assert again.spec == graph.spec
    x = torch.randn(3, 8)
    torch.testing.assert_close(wrapped(x), Counting()(x))


def test_a_new_candidate_is_judged_on_eager_outputs_of_calls_recording_skipped() -> None:
    clock = FakeClock()
    _, graph = tune(Counting(), clock)
    _, again = tune(Counting(), clock, Int8(clock, ms_per_call=0.4, label="new"), WrongInt8(clock, ms_per_call=0.3))
    rows = {row.backend: row for row in again.candidates}
    judged = next(row for row in graph.candidates if row.backend == Int8(clock, ms_per_call=0.5).describe())
    new = rows[Int8(clock, ms_per_call=0.4, label="new").describe()]
    assert not new.reused and new.status in (CandidateStatus.PASSED, CandidateStatus.CHOSEN)
    assert (new.fidelity["samples"], new.fidelity["held_out_samples"]) == \
        (judged.fidelity["samples"], judged.fidelity["held_out_samples"])
    assert new.fidelity["held_out_samples"] >= 4 and new.fidelity["max_abs_error"] == 0.0
    wrong = rows[WrongInt8(clock, ms_per_call=0.3).describe()]
    assert wrong.status == CandidateStatus.REJECTED and "FidelityError" in wrong.error


def test_keyword_inputs_and_structured_outputs_are_judged_after_a_skipped_recording() -> None:
    clock = FakeClock()
    items = [{"x": torch.randn(6), "mask": (torch.rand(6) > 0.2).float()} for _ in range(16)]
    _, graph = tune(KwargsModel(), clock, data=items)
    model = KwargsModel()
    wrapped, again = tune(model, clock, Int8(clock, ms_per_call=0.4, label="new"), WrongInt8(clock, ms_per_call=0.3),
                          data=items)
    rows = {row.backend: row for row in again.candidates}
    new = rows[Int8(clock, ms_per_call=0.4, label="new").describe()]
    assert new.status in (CandidateStatus.PASSED, CandidateStatus.CHOSEN) and new.fidelity["held_out_samples"] >= 2
    assert rows[WrongInt8(clock, ms_per_call=0.3).describe()].status == CandidateStatus.REJECTED
    assert again.spec == graph.spec
    x, mask = torch.randn(3, 6), torch.ones(3, 6)
    out, reference = wrapped(x=x, mask=mask), KwargsModel()(x, mask=mask)
    assert isinstance(out, Pair)
    torch.testing.assert_close(tuple(out), tuple(reference))


def test_every_call_runs_when_turned_off_or_when_func_is_not_the_module() -> None:
    clock = FakeClock()
    tune(Counting(), clock)
    tt.config.lazy_recording = False
    off = Counting()
    tune(off, clock)
    assert off.calls >= len(DATA) + 2
    tt.config.lazy_recording = True
    via_function = Counting()
    wrapped = tt.Module(via_function, strategy=strategy(clock))
    tt.tune(lambda x: wrapped(x), DATA, batch_sizes=[1, 2, 4], ignore_failing_modules=False)
    assert via_function.calls >= len(DATA) + 2  # a function may use the outputs


def test_a_module_with_a_wrapped_module_inside_runs_every_call() -> None:
    clock = FakeClock()
    for _ in range(2):
        torch.manual_seed(0)
        outer = Outer(clock)
        report = tt.tune(tt.Module(outer, strategy=strategy(clock)), DATA, batch_sizes=[1, 2, 4],
                         ignore_failing_modules=False)
        assert len(report.modules) == 2
        assert outer.inner.wrapped.calls >= len(DATA) + 2  # its calls happen inside the outer one's


def test_shapes_that_depend_on_values_are_not_kept(tmp_path: Path) -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]

    recorder = Recorder(True, 4, known=KnownShapes(tmp_path / "shapes.json"))
    for value in (1.0, -1.0, 1.0):
        recorder.record_call(forward, (torch.full((2, 3), value),), {}, 2, lazy=True)
    recorder.known.save({k: g.shape_map for k, g in recorder.graphs.items()})
    assert json.loads((tmp_path / "shapes.json").read_text())["graphs"] == {}


def test_known_shapes_that_a_real_call_contradicts_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "shapes.json"
    stale = Recorder(True, 4, known=KnownShapes(path))
    stale.record_call(lambda x: torch.zeros(x.shape[0], 7), (torch.randn(2, 3),), {}, 2)
    stale.known.save({k: g.shape_map for k, g in stale.graphs.items()})  # says 7 features; the module gives 5
    linear, calls = nn.Linear(3, 5), []

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return linear(x)

    recorder = Recorder(True, 4, known=KnownShapes.load(path))
    for _ in range(3):
        recorder.record_call(forward, (torch.randn(2, 3),), {}, 2, lazy=True)
    assert len(calls) == 3 and recorder.known.off is not None
    assert recorder.graph_specs()[0].outputs[0].max_shape == (2, 5)
    assert not path.exists()  # the next run records every call, and writes it again
    recorder.known.save({k: g.shape_map for k, g in recorder.graphs.items()})
    assert not path.exists()


def test_a_malformed_file_is_a_warning_and_every_call_runs(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    tune(Counting(), clock)
    files = list((tt.config.cache_dir / "recordings").glob("*.json"))
    assert len(files) == 1
    files[0].write_text('{"format": 1, "graphs": {"x": [[[[1, -8]], [[1, 4]]]]}}')
    model = Counting()
    tune(model, clock)
    assert model.calls >= len(DATA) + 2
    assert "Ignoring the recorded shapes" in caplog.text


def test_the_key_covers_weights_and_source_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    def load(name: str, body: str) -> type:
        path = tmp_path / f"{name}.py"
        path.write_text("import torch\n\nclass Net(torch.nn.Linear):\n" + body)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # where inspect finds a class's file
        spec.loader.exec_module(module)
        return module.Net

    same, edited = load("net_a", "    pass\n"), load("net_b", "    scale = 2\n")
    torch.manual_seed(0)
    a = same(3, 2)
    torch.manual_seed(0)
    b = edited(3, 2)
    torch.manual_seed(1)
    c = same(3, 2)
    torch.manual_seed(0)
    keys = [module_key(a), module_key(b), module_key(c), module_key(same(3, 2))]
    assert None not in keys and len(set(keys[:3])) == 3
    torch.manual_seed(0)
    assert module_key(same(3, 2)) == keys[0]


def test_a_held_out_call_not_run_gets_its_outputs_once_and_keeps_them(tmp_path: Path) -> None:
    linear = nn.Linear(4, 3)
    runs: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        return linear(x)

    stores: list[SampleStore] = []

    def make(index: int, name: str) -> SampleStore:
        stores.append(SampleStore(tmp_path, 64))
        return stores[-1]

    first = Recorder(True, 4, stores=make, known=KnownShapes(tmp_path / "shapes.json"))
    for _ in range(12):
        first.record_call(forward, (torch.randn(1, 4),), {}, 1)
    first.known.save({k: g.shape_map for k, g in first.graphs.items()})
    runs.clear()
    known = KnownShapes.load(tmp_path / "shapes.json")
    second = Recorder(True, 4, stores=make, known=known)
    inputs = [torch.randn(1, 4) for _ in range(12)]
    for x in inputs:
        second.record_call(forward, (x,), {}, 1, lazy=True)
    assert len(runs) == 2  # the graph's first call (a sample) and the store's first (it shows the structure)
    store = stores[-1]
    assert [o is None for _, o, _ in store.held_out()] == [True, True, True]  # calls 1, 5, 9 of the store
    expected = [linear(x) for x in inputs[1:]]  # stored calls: every call after the first
    computed = list(store.held_out(forward))
    assert len(runs) == 5
    for (args, _), outputs, _ in computed:
        match = next(e for x, e in zip(inputs[1:], expected) if torch.equal(x, args[0]))
        torch.testing.assert_close(outputs, match)
    assert [o is None for _, o, _ in store.held_out()] == [False, False, False] and len(runs) == 5


def test_a_module_with_a_forward_hook_runs_every_call() -> None:
    clock = FakeClock()
    tune(Counting(), clock)
    seen: list[torch.Size] = []
    hooked = Counting()
    hooked.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    tune(hooked, clock)
    assert hooked.calls >= len(DATA) + 2 and len(seen) >= len(DATA) + 2


def test_the_shapes_file_is_an_item_the_cache_size_limit_counts() -> None:
    tune(Counting(), FakeClock())
    items = [path for _, _, path in cache_items(tt.config.cache_dir)]
    assert [p.suffix for p in items if p.parent.name == "recordings"] == [".json"]
