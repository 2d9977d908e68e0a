"""Candidates another measured candidate stands in for (torch_tweak/torch/tune_strategy/stand_ins.py)."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from toy_models import cnn, mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import (
    OpenVINOBackend,
    OpenVINOBackendConfig,
    TorchAOBackend,
    TorchAOBackendConfig,
    TorchInductorAOTBackend,
    TorchInductorBackend,
)
from torch_tweak.torch.backend import available as backend_available
from torch_tweak.torch.backend.openvino.quantize import nncf_available
from torch_tweak.torch.profiling import Measurement, ProfilingConfig, SweepResult
from torch_tweak.torch.report.report import CandidateReport
from torch_tweak.torch.tune_strategy import linear_calls
from torch_tweak.torch.tune_strategy.graph_probes import kernel_time
from torch_tweak.torch.tune_strategy.linear_calls import int8_layer_slowdown, largest_linear_call, linear_share
from torch_tweak.torch.tune_strategy.results import Evaluation


class _Task:
    """The part of a GraphTask that ``linear_share`` reads."""

    def __init__(self, module: torch.nn.Module, sample: torch.Tensor) -> None:
        self.module, self.module_name = module, "m"
        self._sample = sample
        self.graph_spec = type("Spec", (), {"name": "0"})()
        self.probed: dict = {}

    def data(self):
        return [((self._sample,), {})]


def test_linear_share_counts_the_multiply_adds_of_linear_layers() -> None:
    assert linear_share(mlp(), _Task(mlp(), torch.randn(2, 8))) == pytest.approx(1.0)
    share = linear_share(cnn(), _Task(cnn(), torch.randn(2, 3, 16, 16)))
    # conv 3->4, 3x3 on 16x16: 27,648 multiply-adds per image; the 4->3 head: 12
    assert share == pytest.approx(12 / (27648 + 12), rel=1e-3)
    no_linear = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).eval()
    assert linear_share(no_linear, _Task(no_linear, torch.randn(1, 3, 8, 8))) == 0.0


class _PickledMidCall(torch.nn.Module):
    """Pickles itself between its two layers, as the background worker's sender thread may while a probe runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.copies: list[bytes] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        self.copies.append(pickle.dumps(self))
        return self.second(x)


def test_counting_linear_calls_leaves_no_hook_in_the_module_a_concurrent_pickle_could_carry() -> None:
    module = _PickledMidCall().eval()
    assert linear_share(module, _Task(module, torch.randn(2, 8))) == pytest.approx(1.0)
    copy = pickle.loads(module.copies[-1])
    assert not copy.first._forward_hooks and not copy.second._forward_hooks
    assert not module.first._forward_hooks and not module.second._forward_hooks
    assert largest_linear_call(_RecordedTask(module, {2: torch.randn(2, 8)})) == 2 * 8 * 16
    assert not pickle.loads(module.copies[-1]).first._forward_hooks


def _evaluation(template, status: str) -> Evaluation:
    row = CandidateReport(backend=template.describe(), key=template.key(), status=status)
    sweep = SweepResult([Measurement(1, [1.0])])
    return Evaluation("candidate", row, None, sweep, None, template=template)


def test_inductor_jit_and_aot_stand_in_for_each_other_once_one_is_screened_out() -> None:
    strategy = tt.HighestThroughputStrategy()
    screened = [_evaluation(TorchInductorBackend(), "screened_out")]
    row = strategy._stand_in_row(TorchInductorAOTBackend(), "candidate", None, screened)
    assert row is not None and row.status == "skipped"
    assert row.error == ("skipped: it compiles the graph into the same kernels as TorchInductorBackend(), which was "
                         "screened out; pass skip_stand_ins=False to the strategy to build it anyway")
    aot_screened = [_evaluation(TorchInductorAOTBackend(), "screened_out")]
    assert strategy._stand_in_row(TorchInductorBackend(), "candidate", None, aot_screened).status == "skipped"
    # screened out at the small end before its check: one measurement in its row, no sweep
    jit = TorchInductorBackend()
    early = Evaluation("candidate", CandidateReport(backend=jit.describe(), key=jit.key(), status="screened_out"),
                       template=jit)
    assert strategy._stand_in_row(TorchInductorAOTBackend(), "candidate", None, [early]).status == "skipped"
    # a sibling that was swept may be slower or faster by its per-call overhead: both are measured
    passed = [_evaluation(TorchInductorBackend(), "passed")]
    assert strategy._stand_in_row(TorchInductorAOTBackend(), "candidate", None, passed) is None
    # other settings compile other kernels
    tuned = TorchInductorAOTBackend(tt.backend.TorchInductorAOTBackendConfig(options={"freezing": True}))
    assert strategy._stand_in_row(tuned, "candidate", None, screened) is None
    off = tt.HighestThroughputStrategy(skip_stand_ins=False)
    assert off._stand_in_row(TorchInductorAOTBackend(), "candidate", None, screened) is None
    with pytest.raises(ConfigError, match="skip_stand_ins must be True or False"):
        tt.HighestThroughputStrategy(skip_stand_ins="yes")


def _measured(template, ms_at: dict[int, float], status: str = "passed") -> Evaluation:
    row = CandidateReport(backend=template.describe(), key=template.key(), status=status)
    sweep = SweepResult([Measurement(batch, [ms]) for batch, ms in ms_at.items()])
    return Evaluation("candidate", row, None, sweep, None, template=template)


def test_a_thread_limited_candidate_is_skipped_once_its_every_core_twin_took_a_millisecond_or_more() -> None:
    from torch_tweak.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig

    def measured(template, *call_ms: float) -> Evaluation:
        row = CandidateReport(backend=template.describe(), key=template.key(), status="passed")
        sweep = SweepResult([Measurement(2 ** i, [ms] * 5) for i, ms in enumerate(call_ms)])
        return Evaluation("candidate", row, None, sweep, None, template=template)

    strategy = tt.HighestThroughputStrategy()
    one = OpenVINOBackend(OpenVINOBackendConfig(num_threads=1))
    assert one.every_core_twin().key() == OpenVINOBackend().key() and OpenVINOBackend().every_core_twin() is None
    row = strategy._stand_in_row(one, "candidate", None, [measured(OpenVINOBackend(), 1.5, 4.0)])
    assert row is not None and row.status == "skipped"
    assert row.error == ("skipped: it runs the model of OpenVINOBackend() on fewer threads, and that one's shortest "
                         "call took 1.50 ms: calls of 1 ms or more spend their time in work that threads share, not "
                         "in handing it over; pass skip_stand_ins=False to the strategy to build it anyway")
    # short calls, or no measurement of the twin yet: measured like any candidate
    assert strategy._stand_in_row(one, "candidate", None, [measured(OpenVINOBackend(), 0.05, 1.2)]) is None
    assert strategy._stand_in_row(one, "candidate", None, []) is None
    # the twin is the one with the same settings: the int8 model's, not the float one's
    int8_one = OpenVINOBackend(OpenVINOBackendConfig(quantization="int8", num_threads=1))
    assert strategy._stand_in_row(int8_one, "candidate", None, [measured(OpenVINOBackend(), 3.0)]) is None
    int8 = OpenVINOBackend(OpenVINOBackendConfig(quantization="int8"))
    assert strategy._stand_in_row(int8_one, "candidate", None, [measured(int8, 3.0)]).status == "skipped"
    ort_one = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(intra_op_num_threads=1))
    assert strategy._stand_in_row(ort_one, "candidate", None, [measured(ONNXRuntimeBackend(), 2.0)]).status == "skipped"
    # an every-core twin that failed to build, failed its check or was skipped: the one-thread twin runs that model
    for status, verb in (("build_failed", "failed to build"), ("rejected", "failed the fidelity check"),
                         ("skipped", "was skipped")):
        failed = Evaluation("candidate", CandidateReport(backend="OpenVINOBackend()", key=OpenVINOBackend().key(),
                                                         status=status), None, None, None, template=OpenVINOBackend())
        row = strategy._stand_in_row(one, "candidate", None, [failed])
        assert row.status == "skipped" and row.error.startswith(
            f"skipped: it runs the model of OpenVINOBackend() on fewer threads, and that one {verb}")
    screened = Evaluation("candidate", CandidateReport(backend="OpenVINOBackend()", key=OpenVINOBackend().key(),
                                                       status="screened_out"), None, None, None, template=OpenVINOBackend())
    assert strategy._stand_in_row(one, "candidate", None, [screened]) is None  # one thread may run faster
    off = tt.HighestThroughputStrategy(skip_stand_ins=False)
    assert off._stand_in_row(one, "candidate", None, [measured(OpenVINOBackend(), 1.5)]) is None


def test_inductor_aot_is_skipped_when_jit_without_its_overhead_would_still_lag_the_best() -> None:
    strategy = tt.HighestThroughputStrategy()
    best = _measured(tt.backend.TorchEagerBackend(), {1: 40.0, 32: 1300.0})  # the fastest so far, at both ends
    jit = _measured(TorchInductorBackend(), {1: 90.0, 32: 1800.0})  # 0.45x and 0.72x of it
    row = strategy._stand_in_row(TorchInductorAOTBackend(), "candidate", None, [best, jit])
    assert row is not None and row.status == "skipped"
    assert row.error.startswith("skipped: it compiles the graph into the same kernels as TorchInductorBackend(), "
                                "which even without 0.5 ms of per-call overhead would reach only 0.45x at batch 1, "
                                "0.72x at batch 32 of the best candidate's throughput (under 1/1.25)")
    # within the noise of the best at one end, but its calls so long that AOT's saving would not show: skipped
    close = _measured(TorchInductorBackend(), {1: 90.0, 32: 1500.0})
    row = strategy._stand_in_row(TorchInductorAOTBackend(), "candidate", None, [best, close])
    assert row.status == "skipped" and row.error == (
        "skipped: it compiles the graph into the same kernels as TorchInductorBackend(), whose calls took 90.0 ms or "
        "more: without its 0.5 ms of per-call overhead they would run at most 1.006x as fast, which no "
        "re-measurement tells apart; pass skip_stand_ins=False to the strategy to build it anyway")
    # within the noise of the best, with calls short enough at one batch size for the overhead to matter: built
    short = _measured(TorchInductorBackend(), {1: 12.0, 32: 1500.0})  # 12 / 11.5: up to 1.043x
    best_short = _measured(tt.backend.TorchEagerBackend(), {1: 11.0, 32: 1300.0})
    assert strategy._stand_in_row(TorchInductorAOTBackend(), "candidate", None, [best_short, short]) is None
    # calls as short as the overhead AOT removes (a tiny MLP): it may well win, so it is built
    tiny_best = _measured(tt.backend.TorchEagerBackend(), {1: 0.02, 32: 0.1})
    tiny_jit = _measured(TorchInductorBackend(), {1: 0.4, 32: 0.6})
    assert strategy._stand_in_row(TorchInductorAOTBackend(), "candidate", None, [tiny_best, tiny_jit]) is None
    # the rule runs one way: JIT is built after a lagging AOT (it may specialise shapes AOT keeps dynamic)
    aot = _measured(TorchInductorAOTBackend(), {1: 90.0, 32: 1800.0})
    assert strategy._stand_in_row(TorchInductorBackend(), "candidate", None, [best, aot]) is None
    assert tt.HighestThroughputStrategy(skip_stand_ins=False)._stand_in_row(
        TorchInductorAOTBackend(), "candidate", None, [best, jit]) is None


@pytest.mark.slow
@pytest.mark.skipif(not backend_available("TorchAOBackend"), reason="needs torchao")
def test_torchao_is_skipped_on_a_graph_whose_linear_layers_do_almost_none_of_the_work() -> None:
    strategy = tt.HighestThroughputStrategy([TorchInductorBackend(), TorchAOBackend()], screening=False)
    model = tt.Module(cnn(), name="cnn", strategy=strategy)
    report = tt.tune(model, [torch.randn(3, 16, 16) for _ in range(4)], batch_sizes=[1, 2], executor="inline")
    rows = {c.backend: c for c in report.modules[0].graphs[0].candidates}
    assert rows["TorchInductorBackend()"].status in ("passed", "chosen")
    skipped = rows["TorchAOBackend()"]
    assert skipped.status == "skipped" and skipped.build_time_s is None
    assert skipped.error.startswith("skipped: it quantizes nn.Linear layers only, which do 0.04% of this graph's "
                                    "multiply-adds, and compiles the rest like TorchInductorBackend(), measured above")


def test_onnxruntime_int8_is_skipped_on_a_graph_whose_linear_layers_do_almost_none_of_the_work() -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from torch_tweak.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig

    int8 = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(quantization="int8_dynamic_per_tensor"))  # -> per channel -> fp32
    one = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(quantization="int8_dynamic_per_tensor", intra_op_num_threads=1))
    strategy = tt.HighestThroughputStrategy([ONNXRuntimeBackend(), int8, one], screening=False)
    model = tt.Module(cnn(), name="cnn_ort", strategy=strategy)
    report = tt.tune(model, [torch.randn(3, 16, 16) for _ in range(4)], batch_sizes=[1, 2], executor="inline")
    rows = {c.backend: c for c in report.modules[0].graphs[0].candidates}
    assert rows["ONNXRuntimeBackend()"].status in ("passed", "chosen")
    skipped = rows[int8.describe()]
    assert skipped.status == "skipped" and skipped.build_time_s is None
    assert skipped.error.startswith("skipped: its dynamic int8 quantizes nn.Linear layers only, which do 0.04% of "
                                    "this graph's multiply-adds, and runs the rest in float like ONNXRuntimeBackend(), "
                                    "measured above")
    assert rows[one.describe()].status == "skipped" and rows[one.describe()].error == skipped.error  # the same rule
    on_linear_layers = tt.Module(mlp(), name="mlp_ort", strategy=strategy)
    report = tt.tune(on_linear_layers, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2], executor="inline")
    for template in (int8, one):
        (row,) = [c for c in report.modules[0].graphs[0].candidates if c.backend.startswith(template.describe())]
        assert row.status != "skipped" and row.build_time_s is not None  # measured ("+ non-finite guard": int8)


@pytest.mark.parametrize(("model", "sample", "order"), [
    (mlp, torch.randn(2, 8), ["TorchAOBackend", "TorchInductorBackend", "TorchInductorAOTBackend"]),
    (cnn, torch.randn(2, 3, 16, 16), ["TorchInductorBackend", "TorchInductorAOTBackend", "TorchAOBackend"]),
], ids=["linear-layers-do-the-work", "a-cnn"])
def test_candidates_take_turns_cheapest_first_but_torchao_before_inductor_where_linear_layers_count(
        model, sample, order) -> None:
    templates = [TorchInductorAOTBackend(), TorchAOBackend(), TorchInductorBackend(), OpenVINOBackend()]
    task = _Task(model(), sample)
    turns = [type(t).__name__ for t, _ in tt.HighestThroughputStrategy(templates)._templates(task)]
    assert turns == ["TorchEagerBackend", "OpenVINOBackend", *order]
    assert "linear_share" in task.probed  # kept for a rerun like the other probes
    in_cost_order = tt.HighestThroughputStrategy(templates, skip_stand_ins=False)._templates(_Task(model(), sample))
    assert [type(t).__name__ for t, _ in in_cost_order][2:] == [  # equal costs keep the given order
        "TorchInductorBackend", "TorchInductorAOTBackend", "TorchAOBackend"]


@pytest.mark.parametrize(("saturates", "order"), [
    (False, ["TorchInductorBackend", "TorchAOBackend"]),
    (True, ["TorchAOBackend", "TorchInductorBackend"]),
], ids=["vnni-or-amx", "int8-dot-saturates"])
def test_inductor_keeps_its_turn_before_torchao_where_a_calibrated_int8_candidate_will_stand_in(
        monkeypatch: pytest.MonkeyPatch, saturates: bool, order: list[str]) -> None:
    # OpenVINO's calibrated int8, measured first, skips TorchAO on CPUs whose int8 dot products do not saturate: its
    # background build would only delay Inductor's, queued behind it in turn order
    from torch_tweak.torch.tune_strategy import stand_ins

    monkeypatch.setattr(stand_ins, "int8_dot_saturates", lambda: saturates)
    templates = [TorchAOBackend(), TorchInductorBackend(), OpenVINOBackend(OpenVINOBackendConfig(quantization="int8"))]
    task = _Task(mlp(), torch.randn(2, 8))
    task.device = torch.device("cpu")
    turns = [type(t).__name__ for t, _ in tt.HighestThroughputStrategy(templates)._templates(task)]
    assert turns == ["TorchEagerBackend", "OpenVINOBackend", *order]
    task.device = torch.device("xpu")  # no calibrated int8 stand-in off the CPU
    turns = [type(t).__name__ for t, _ in tt.HighestThroughputStrategy(templates)._templates(task)]
    assert turns[2:] == ["TorchAOBackend", "TorchInductorBackend"]
    task.device = torch.device("cpu")  # nor for a TorchAO config other than the default
    templates[0] = TorchAOBackend(TorchAOBackendConfig(quantization="int8wo"))
    turns = [type(t).__name__ for t, _ in tt.HighestThroughputStrategy(templates)._templates(task)]
    assert turns[2:] == ["TorchAOBackend", "TorchInductorBackend"]


class _RecordedTask(_Task):
    """The part of a GraphTask that ``kernel_time`` reads: recorded samples with their batch sizes."""

    def __init__(self, module: torch.nn.Module, samples: dict[int, torch.Tensor]) -> None:
        super().__init__(module, next(iter(samples.values())))
        self.device = torch.device("cpu")
        self.samples = [type("Sample", (), {"batch_size": b, "sample": ((x,), {})})() for b, x in samples.items()]
        self.graph_spec.inputs = [type("Input", (), {"batch_multipliers": {0: 1}})()]  # one input, batch first


def test_kernel_time_times_the_matrix_multiplies_of_the_smallest_recorded_call() -> None:
    heavy = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4))).eval()
    task = _RecordedTask(heavy, {8: torch.randn(8, 512), 2: torch.randn(2, 512)})
    batch, ms, call_ms = kernel_time(task)
    # timed in other calls than the whole call, on a shared machine: ms may exceed call_ms; bound it loosely
    assert batch == 2 and 0.0 < ms <= 5 * call_ms
    light = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()).eval()  # no matrix multiply at all
    assert kernel_time(_RecordedTask(light, {1: torch.randn(1, 512)}))[:2] == (1, 0.0)
    assert kernel_time(_RecordedTask(light, {None: torch.randn(3)})) is None  # no batch axis: no bound


def test_largest_linear_call_counts_the_call_of_the_largest_recorded_batch() -> None:
    # Linear(8, 16) then Linear(16, 4): 8 * 16 multiply-adds per row for the larger one
    assert largest_linear_call(_RecordedTask(mlp(), {2: torch.randn(2, 8), 32: torch.randn(32, 8)})) == 32 * 8 * 16
    no_linear = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).eval()
    assert largest_linear_call(_RecordedTask(no_linear, {1: torch.randn(1, 3, 8, 8)})) == 0
    assert largest_linear_call(_RecordedTask(mlp(), {1: torch.randn(1, 5)})) is None  # the call fails: not countable


class _SeenBatches(torch.nn.Module):
    """A linear layer over the last axis that notes the leading size of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.seen = torch.nn.Linear(8, 16), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return self.layer(x)


def test_the_largest_batchs_linear_calls_are_counted_on_a_smaller_call_of_the_same_shape_and_scaled() -> None:
    """The largest batch's call is not run (a BERT-base's at batch 32: 4.4 s): the smallest call whose other axes
    match and whose batch divides it is, its counts scaled; the int8 probe's input is that call's, repeated."""
    model = _SeenBatches().eval()
    task = _RecordedTask(model, {32: torch.randn(32, 5, 8), 4: torch.randn(4, 5, 8), 2: torch.randn(2, 5, 8)})
    assert largest_linear_call(task) == 32 * 5 * 8 * 16 and model.seen == [2]
    model.seen.clear()  # another length at the smaller batch: the largest call itself is counted
    assert largest_linear_call(_RecordedTask(model, {32: torch.randn(32, 5, 8), 2: torch.randn(2, 3, 8)})) \
        == 32 * 5 * 8 * 16 and model.seen == [32]
    model.seen.clear()  # 3 does not divide 32
    assert largest_linear_call(_RecordedTask(model, {32: torch.randn(32, 5, 8), 3: torch.randn(3, 5, 8)})) \
        == 32 * 5 * 8 * 16 and model.seen == [32]
    model.seen.clear()
    calls = linear_calls._largest_batch_calls(task, keep_input=True)
    layer, activation = calls.largest_call
    assert model.seen == [2] and layer is model.layer and activation.shape == (32, 5, 8)
    small = task.samples[2].sample[0][0]
    assert torch.equal(activation, small.repeat(16, 1, 1))


@pytest.mark.skipif(not backend_available("TorchAOBackend"), reason="needs torchao")
def test_torchao_is_skipped_before_anything_is_measured_when_its_matrices_are_too_small_for_int8() -> None:
    from torch_tweak.torch.backend import TorchAOBackendConfig
    from torch_tweak.torch.tune_strategy.stand_ins import INT8_MIN_LINEAR_MACS

    strategy = tt.HighestThroughputStrategy()
    small = _RecordedTask(mlp(), {1: torch.randn(1, 8), 8: torch.randn(8, 8)})
    row = strategy._stand_in_row(TorchAOBackend(), "candidate", small, [])
    assert row is not None and row.status == "skipped" and row.build_time_s is None
    assert row.error == ("skipped: its int8 quantizes every call's activations, which costs more than int8 saves on "
                         "matrices this small: the largest nn.Linear call of the largest recorded batch does 1,024 "
                         f"multiply-adds, under {INT8_MIN_LINEAR_MACS:,}; pass skip_stand_ins=False to the strategy "
                         "to build it anyway")
    # a large enough call at the largest batch (8 x 512 x 512 = 2.1 M): built, even though batch 1 is small
    wide = torch.nn.Sequential(torch.nn.Linear(512, 512)).eval()
    large = _RecordedTask(wide, {1: torch.randn(1, 512), 8: torch.randn(8, 512)})
    assert 8 * 512 * 512 >= INT8_MIN_LINEAR_MACS
    assert strategy._stand_in_row(TorchAOBackend(), "candidate", large, []) is None
    # no linear layer at all (nothing to learn from this rule), another quantization, or the rule switched off: built
    convs = _RecordedTask(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).eval(), {1: torch.randn(1, 3, 8, 8)})
    assert strategy._stand_in_row(TorchAOBackend(), "candidate", convs, []) is None
    weights_only = TorchAOBackend(TorchAOBackendConfig(quantization="int8wo"))
    assert strategy._stand_in_row(weights_only, "candidate", small, []) is None
    assert tt.HighestThroughputStrategy(skip_stand_ins=False)._stand_in_row(TorchAOBackend(), "candidate", small,
                                                                            []) is None


def _eager(ms_at: dict[int, float]) -> Evaluation:
    evaluation = _measured(tt.backend.TorchEagerBackend(), ms_at)
    evaluation.role = "baseline"
    return evaluation


def _passed(ms_at: dict[int, float]) -> Evaluation:
    evaluation = _measured(tt.backend.OpenVINOBackend(), ms_at)
    evaluation.pick = evaluation.sweep.measurements[-1]
    return evaluation


class _Probed:
    """The part of a GraphTask the kernel bound reads when ``kernel_time`` is replaced: what was probed (nothing)."""

    def __init__(self) -> None:
        self.probed: dict = {}


def test_inductor_is_skipped_when_eager_kernels_alone_keep_it_below_the_best(monkeypatch) -> None:
    import torch_tweak.torch.tune_strategy.graph_probes as probes

    strategy = tt.HighestThroughputStrategy()
    eager = _eager({1: 100.0, 8: 640.0})
    fast = _passed({1: 15.0, 8: 90.0})  # 6.7x and 7.1x eager
    monkeypatch.setattr(probes, "kernel_time", lambda task: (1, 85.0, 100.0))  # 85 % of the call in GEMMs
    row = strategy._stand_in_row(TorchInductorBackend(), "candidate", _Probed(), [eager, fast])
    assert row is not None and row.status == "skipped"
    # at most 1.25x the kernels (the noise): 1 / (0.85 / 1.25) = 1.47x eager, i.e. 0.22x and 0.21x of the best
    assert row.error == (
        "skipped: its default compile calls eager's matrix-multiply, convolution and attention kernels, which took "
        "85% of an eager call at batch 1 (100.0 ms measured); even with those 1.25x faster and all else free it would "
        "reach at most 0.22x at batch 1, 0.21x at batch 8 of the best candidate's throughput, so it could neither be "
        "chosen nor serve a batch size; pass skip_stand_ins=False to the strategy to build it anyway")
    assert strategy._stand_in_row(TorchInductorAOTBackend(), "candidate", _Probed(), [eager, fast]).status == "skipped"
    # with freezing on in Inductor's process-wide config, its kernels are not eager's: no bound
    from torch._inductor import config as inductor_config

    with inductor_config.patch(freezing=True):  # its own patch: monkeypatch would delete the setting on undo
        assert strategy._stand_in_row(TorchInductorBackend(), "candidate", _Probed(), [eager, fast]) is None
    # within reach (1.25x eager at batch 1, 1.28x at batch 8, under the bound's 1.47x): built
    close = _passed({1: 80.0, 8: 500.0})
    assert strategy._stand_in_row(TorchInductorBackend(), "candidate", _Probed(), [eager, close]) is None
    # eager's calls mostly outside those kernels: Inductor could win, so it is built
    monkeypatch.setattr(probes, "kernel_time", lambda task: (1, 10.0, 100.0))
    assert strategy._stand_in_row(TorchInductorBackend(), "candidate", _Probed(), [eager, fast]) is None
    # calls too short to time op by op, a tuned setting, no measured eager, or the rule switched off: built
    monkeypatch.setattr(probes, "kernel_time", lambda task: (1, 0.85, 1.0))
    tiny = _eager({1: 0.9, 8: 5.0})
    assert strategy._stand_in_row(TorchInductorBackend(), "candidate", _Probed(), [tiny, fast]) is None
    monkeypatch.setattr(probes, "kernel_time", lambda task: (1, 85.0, 100.0))
    tuned = TorchInductorBackend(tt.backend.TorchInductorBackendConfig(options={"freezing": True}))
    assert strategy._stand_in_row(tuned, "candidate", _Probed(), [eager, fast]) is None
    assert strategy._stand_in_row(TorchInductorBackend(), "candidate", _Probed(), [fast]) is None
    off = tt.HighestThroughputStrategy(skip_stand_ins=False)
    assert off._stand_in_row(TorchInductorBackend(), "candidate", _Probed(), [eager, fast]) is None
    # a candidate the bound cannot reach anywhere skips it whether or not the strategy screens: 1.6x eager at both
    # ends is 0.92x of what Inductor could reach at most, yet more than half of it (what screening keeps)
    slower = _passed({1: 62.5, 8: 400.0})
    for screens in (True, False):
        row = tt.HighestThroughputStrategy(screening=screens)._stand_in_row(TorchInductorBackend(), "candidate",
                                                                             _Probed(), [eager, slower])
        assert row is not None and "at most 0.92x at batch 1, 0.92x at batch 8" in row.error


def test_torchao_on_a_graph_of_few_linear_layers_is_skipped_when_the_kernel_bound_skipped_inductor(monkeypatch) -> None:
    """A CNN: TorchAO quantizes its classifier only and compiles the rest as Inductor does, so Inductor's bound is its
    bound too (before, with Inductor skipped and so never measured, a ResNet-50 built TorchAO for 50 s)."""
    import torch_tweak.torch.tune_strategy.graph_probes as probes

    strategy = tt.HighestThroughputStrategy()
    eager, fast = _eager({1: 100.0, 8: 640.0}), _passed({1: 15.0, 8: 90.0})
    monkeypatch.setattr(probes, "kernel_time", lambda task: (1, 85.0, 100.0))
    cnn_like = _Probed()
    cnn_like.probed["linear_share"] = 0.0005
    row = strategy._stand_in_row(TorchAOBackend(), "candidate", cnn_like, [eager, fast])
    assert row is not None and row.status == "skipped"
    assert row.error.startswith(
        "skipped: it quantizes nn.Linear layers only, which do 0.05% of this graph's multiply-adds, and compiles the "
        "rest as Inductor's default compile does, which calls eager's matrix-multiply, convolution and attention "
        "kernels, which took 85% of an eager call at batch 1")
    linear_heavy = _Probed()
    linear_heavy.device = torch.device("cpu")
    # an encoder: int8 matrices could change the bound, so no such skip
    linear_heavy.probed.update(linear_share=0.9, largest_linear_call=10**9)
    row = strategy._stand_in_row(TorchAOBackend(), "candidate", linear_heavy, [eager, fast])
    assert row is None or "compiles the rest as Inductor's" not in row.error


def test_a_rerun_decides_on_the_kernel_time_the_first_run_measured(monkeypatch) -> None:
    """The kernel timing is kept with the results: a rerun that reuses them skips Inductor again without timing
    (one run's noise once decided otherwise, and the rerun compiled Inductor for nothing)."""
    import torch_tweak.torch.tune_strategy.graph_probes as probes
    from torch_tweak.torch.testing import FakeClock, TimedBackend

    def run() -> dict[str, str]:
        clock = FakeClock()
        strategy = tt.HighestThroughputStrategy(
            [TimedBackend(clock, ms_per_call=0.4), TorchInductorBackend()],
            baseline=TimedBackend(clock, ms_per_call=3.0),
            profiling=ProfilingConfig(clock=clock, pause_s=0, min_time_s=0))
        report = tt.tune(tt.Module(mlp(), strategy=strategy), [torch.randn(8) for _ in range(4)], batch_sizes=[1, 4])
        return {c.backend: c.status for c in report.modules[0].graphs[0].candidates}

    timings: list[int] = []
    monkeypatch.setattr(probes, "kernel_time", lambda task: timings.append(1) or (1, 2.7, 3.0))  # 90 % kernels
    first = run()
    assert first[TorchInductorBackend().describe()] == "skipped" and timings == [1]
    monkeypatch.setattr(probes, "kernel_time", lambda task: timings.append(2) or (1, 0.3, 3.0))  # would build
    assert run() == first and timings == [1]
    stored = [p for p in Path(tt.config.cache_dir).rglob("results/*.json") if "kernel_time" in p.read_text()]
    assert len(stored) == 1
    stored[0].write_text('{"kernel_time": "garbage"}')  # a malformed stored timing is timed again
    monkeypatch.setattr(probes, "kernel_time", lambda task: timings.append(3) or (1, 2.7, 3.0))
    assert run() == first and timings == [1, 3]


@pytest.mark.skipif(not backend_available("TorchAOBackend"), reason="needs torchao")
def test_the_int8_probe_times_the_largest_linear_call_against_the_float_layer() -> None:
    wide = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).eval()
    slowdown, call = int8_layer_slowdown(TorchAOBackend(), _RecordedTask(wide, {1: torch.randn(1, 256),
                                                                                8: torch.randn(8, 256)}))
    assert slowdown > 0.0 and call == "8x256 -> 512"  # the first layer's call at batch 8 is the larger
    assert all(isinstance(p.data, torch.Tensor) and type(p.data) is torch.Tensor for p in wide.parameters())
    convs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).eval()
    assert int8_layer_slowdown(TorchAOBackend(), _RecordedTask(convs, {1: torch.randn(1, 3, 8, 8)})) is None
    assert int8_layer_slowdown(TorchAOBackend(), _RecordedTask(mlp(), {1: torch.randn(1, 5)})) is None  # call fails


@pytest.mark.skipif(not backend_available("TorchAOBackend"), reason="needs torchao")
def test_torchao_is_skipped_where_it_is_built_when_its_int8_layer_is_slower_than_float(monkeypatch) -> None:
    from torch_tweak.torch.tune_strategy import stand_ins

    # the bound is machine-dependent (int8 is 25x slower than float without VNNI, faster with it): set it here
    monkeypatch.setattr(stand_ins, "INT8_PROBE_SLOWDOWN", 0.0)
    wide = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).eval()
    strategy = tt.HighestThroughputStrategy([TorchAOBackend()])
    report = tt.tune(tt.Module(wide, name="wide", strategy=strategy), [torch.randn(512) for _ in range(8)],
                     batch_sizes=[1, 8], executor="inline")
    graph = report.modules[0].graphs[0]
    row = {c.backend: c for c in graph.candidates}["TorchAOBackend()"]
    assert row.status == "skipped" and row.build_time_s is None
    assert row.error.startswith("skipped: its int8 nn.Linear, timed on this graph's largest linear call (8x512 -> "
                                "512), took ")
    assert row.error.endswith("so quantizing can only slow the graph down; pass skip_stand_ins=False to the "
                              "strategy to build it anyway")
    assert graph.chosen == "TorchEagerBackend()"
    task = _RecordedTask(wide, {8: torch.randn(8, 512)})
    skipped, reason = strategy._skipped_whatever_measured(TorchAOBackend(), task)
    assert skipped and reason is not None and reason.startswith("its int8 nn.Linear")  # final: the turn takes it
    assert tt.HighestThroughputStrategy(skip_stand_ins=False)._probe_reason(TorchAOBackend(), task) is None
    monkeypatch.setattr(stand_ins, "INT8_PROBE_SLOWDOWN", 1e9)
    assert strategy._probe_reason(TorchAOBackend(), task) is None
    assert strategy._skipped_whatever_measured(TorchAOBackend(), task) == (False, None)


@pytest.mark.skipif(not backend_available("TorchAOBackend"), reason="needs torchao")
def test_quantizing_leaves_the_process_matmul_precision_as_it_was() -> None:
    # Inductor's compiled-graph cache keys on these: a change made every later Inductor build in the process miss
    fields = (torch.backends.mkldnn.matmul, torch.backends.cuda.matmul)
    for precision in (None, "high"):  # as the process has it (a fresh one: "none" fields), then one set
        previous = torch.get_float32_matmul_precision()
        if precision is not None:
            torch.set_float32_matmul_precision(precision)
        try:
            before = [torch.get_float32_matmul_precision(), *(f.fp32_precision for f in fields)]
            TorchAOBackend().int8_layer_calls(torch.nn.Linear(16, 16), torch.randn(2, 16))
            assert [torch.get_float32_matmul_precision(), *(f.fp32_precision for f in fields)] == before
        finally:
            if precision is not None:
                torch.set_float32_matmul_precision(previous)


NEEDS_OV_NNCF = pytest.mark.skipif(not backend_available("OpenVINOBackend") or not nncf_available(),
                                   reason="needs openvino and nncf")


@NEEDS_OV_NNCF
def test_openvino_int8_layer_calls_run_the_layer_in_float_and_in_int8() -> None:
    layer = torch.nn.Linear(64, 32).eval()
    x = torch.randn(4, 10, 64)
    pair = OpenVINOBackend(OpenVINOBackendConfig(quantization="int8", inference_precision="f32")).int8_layer_calls(
        layer, x)
    assert pair is not None
    with torch.no_grad():
        expected = layer(x).reshape(-1, 32).numpy()
    float_out, int8_out = (call()[0] for call in pair)
    assert np.abs(float_out - expected).max() < 1e-4
    assert 0 < np.abs(int8_out - expected).max() < 0.1 * np.abs(expected).max()  # quantized, and close
    assert OpenVINOBackend().int8_layer_calls(layer, x) is None  # a float configuration quantizes nothing
    assert OpenVINOBackend(OpenVINOBackendConfig(quantization="int8_weights")).int8_layer_calls(layer, x) is None


def _ov_int8_pair(monkeypatch, probed: list[str], float_s: float, int8_s: float) -> None:
    """OpenVINO's int8 layer probe, replaced by calls that take the given seconds (the bound is machine-dependent)."""
    def spin(seconds: float) -> None:  # busy: the probe takes the smaller of the wall and CPU time ratios
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def pair(self, layer, activation):
        probed.append(f"{self.describe()} {tuple(activation.shape)} -> {layer.out_features}")
        return (lambda: spin(float_s)), (lambda: spin(int8_s))

    monkeypatch.setattr(OpenVINOBackend, "int8_layer_calls", pair)


@NEEDS_OV_NNCF
def test_openvino_int8_is_skipped_where_it_is_built_when_its_int8_layer_is_not_faster(monkeypatch) -> None:
    probed: list[str] = []
    _ov_int8_pair(monkeypatch, probed, float_s=0.001, int8_s=0.002)
    def wide() -> torch.nn.Module:  # the same weights each time: the same results in the cache
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).eval()

    int8 = [OpenVINOBackend(OpenVINOBackendConfig(quantization="int8", performance_hint=hint))
            for hint in ("LATENCY", "THROUGHPUT")]
    data = [torch.randn(512) for _ in range(8)]

    def tune(name: str) -> list[CandidateReport]:  # results are keyed by weights, not by the module's name
        report = tt.tune(tt.Module(wide(), name=name, strategy=tt.HighestThroughputStrategy(int8)), data,
                         batch_sizes=[1, 8], executor="inline")
        return [c for c in report.modules[0].graphs[0].candidates if c.role == "candidate"]

    rows = tune("first")
    assert [r.status for r in rows] == ["skipped", "skipped"] and all(r.build_time_s is None for r in rows)
    assert rows[0].error.startswith("skipped: its int8 copy of this graph's largest nn.Linear call (8x512 -> 512), "
                                    "built and timed as it would run, took ")
    assert "nn.Linear layers do 100% of the graph's multiply-adds" in rows[0].error
    assert probed == ["OpenVINOBackend(quantization=int8) (8, 512) -> 512"]  # once: the twin quantizes the same
    again = tune("again")  # the probe's verdict is a result like any other: reused, not probed again
    assert [(r.status, r.reused, r.error) for r in again] == [("skipped", True, r.error) for r in rows]
    assert len(probed) == 1
    strategy = tt.HighestThroughputStrategy()
    assert strategy._probe_reason(int8[0], _RecordedTask(cnn(), {2: torch.randn(2, 3, 8, 8)})) is None
    assert len(probed) == 1  # a CNN's convolutions are not linear layers: no probe
    assert tt.HighestThroughputStrategy(skip_stand_ins=False)._probe_reason(
        int8[0], _RecordedTask(wide(), {8: torch.randn(8, 512)})) is None


@pytest.mark.parametrize(("saturates", "slowdown", "skipped"), [
    (True, 1.08, True),  # no VNNI or AMX: int8 that is not faster cannot win
    (False, 1.08, False),  # VNNI or AMX: within a re-measurement's noise of float, so built and measured
    (False, 1.3, True),
])
def test_the_calibrated_int8_bound_allows_for_noise_on_cpus_with_int8_dot_products(monkeypatch, saturates, slowdown,
                                                                                  skipped) -> None:
    from torch_tweak.torch.tune_strategy import stand_ins

    monkeypatch.setattr(stand_ins, "int8_dot_saturates", lambda: saturates)
    monkeypatch.setattr(stand_ins, "_probed", lambda template, task: (slowdown, "8x512 -> 512"))
    wide = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).eval()
    reason = tt.HighestThroughputStrategy()._probe_reason(OpenVINOBackend(OpenVINOBackendConfig(quantization="int8")),
                                                          _RecordedTask(wide, {8: torch.randn(8, 512)}))
    assert (reason is not None) == skipped
    if skipped:
        assert f"took {slowdown:.2f}x as long as the float one" in reason


@NEEDS_OV_NNCF
def test_openvino_int8_is_built_when_its_int8_layer_is_faster(monkeypatch) -> None:
    probed: list[str] = []
    _ov_int8_pair(monkeypatch, probed, float_s=0.002, int8_s=0.001)
    wide = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).eval()
    strategy = tt.HighestThroughputStrategy([OpenVINOBackend(OpenVINOBackendConfig(quantization="int8"))])
    report = tt.tune(tt.Module(wide, name="wide", strategy=strategy), [torch.randn(64) for _ in range(8)],
                     batch_sizes=[1, 8], executor="inline")
    row = next(c for c in report.modules[0].graphs[0].candidates if c.role == "candidate")
    assert row.status not in ("skipped", "build_failed") and row.precision == "int8" and len(probed) == 1


def _int8_wide() -> tuple[torch.nn.Module, _RecordedTask]:
    """A graph whose largest nn.Linear call (8 x 512 x 512 = 2.1 M multiply-adds) is large enough for TorchAO."""
    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).eval()
    return wide, _RecordedTask(wide, {1: torch.randn(1, 512), 8: torch.randn(8, 512)})


@pytest.mark.skipif(not backend_available("TorchAOBackend"), reason="needs torchao")
def test_torchao_is_skipped_once_a_calibrated_int8_candidate_of_the_graph_was_measured() -> None:
    from torch_tweak.torch.backend import TorchAOBackendConfig
    from torch_tweak.torch.tune_strategy.stand_ins import STATIC_INT8_LEAD

    strategy = tt.HighestThroughputStrategy()
    _, task = _int8_wide()
    assert strategy._stand_in_row(TorchAOBackend(), "candidate", task, []) is None  # large enough, nothing measured
    int8 = OpenVINOBackend(OpenVINOBackendConfig(quantization="int8", performance_hint="THROUGHPUT"))
    for status in ("passed", "screened_out"):
        row = strategy._stand_in_row(TorchAOBackend(), "candidate", task, [_evaluation(int8, status)])
        assert row is not None and row.status == "skipped" and row.build_time_s is None
        assert row.error == (
            "skipped: its int8 quantizes the same nn.Linear layers as OpenVINOBackend(performance_hint=THROUGHPUT,"
            "quantization=int8), measured above, but computes each call's activation scales instead of calibrating "
            f"them once, and leaves the rest of the graph to Inductor: on CPUs it ran at {STATIC_INT8_LEAD} of such a "
            "candidate's throughput wherever both were measured; pass skip_stand_ins=False to the strategy to build "
            "it anyway")
    rejected = Evaluation("candidate", CandidateReport(backend=int8.describe(), key=int8.key(), status="rejected"),
                          template=int8)  # failed its check: never measured, stands in for nothing
    weights_only = OpenVINOBackend(OpenVINOBackendConfig(quantization="int8_weights"))  # float activations
    for others in ([rejected], [_evaluation(OpenVINOBackend(), "passed")], [_evaluation(weights_only, "passed")]):
        assert strategy._stand_in_row(TorchAOBackend(), "candidate", task, others) is None
    measured = [_evaluation(int8, "passed")]
    assert strategy._stand_in_row(TorchAOBackend(TorchAOBackendConfig(quantization="int8wo")), "candidate", task,
                                  measured) is None  # another quantization: another computation
    assert tt.HighestThroughputStrategy(skip_stand_ins=False)._stand_in_row(TorchAOBackend(), "candidate", task,
                                                                            measured) is None
    task.device = torch.device("xpu")  # measured on CPUs only
    assert strategy._stand_in_row(TorchAOBackend(), "candidate", task, measured) is None


class _Ahead:
    """The part of BuildsAhead that ``drop_stood_in`` uses: which builds are pending, which were dropped."""

    def __init__(self, *pending) -> None:
        self.keys = {t.key() for t in pending}
        self.stopped: list[str] = []

    def pending(self, template) -> bool:
        return template.key() in self.keys

    def stop(self, template) -> bool:
        self.keys.discard(template.key())
        self.stopped.append(template.describe())
        return True


@pytest.mark.skipif(not backend_available("TorchAOBackend"), reason="needs torchao")
def test_the_background_build_of_a_stood_in_torchao_stops_when_the_calibrated_candidate_is_measured() -> None:
    strategy = tt.HighestThroughputStrategy()
    _, task = _int8_wide()
    queue = [(TorchAOBackend(), "candidate"), (TorchInductorBackend(), "candidate")]
    ahead = _Ahead(*(t for t, _ in queue))
    strategy.drop_stood_in(ahead, queue, task, [_evaluation(OpenVINOBackend(), "passed")])
    assert ahead.stopped == []  # a float candidate tells nothing about TorchAO
    int8 = OpenVINOBackend(OpenVINOBackendConfig(quantization="int8"))
    strategy.drop_stood_in(ahead, queue, task, [_evaluation(int8, "passed")])
    assert ahead.stopped == ["TorchAOBackend()"]  # Inductor's rules have nothing to go on (no eager measured)
    strategy.drop_stood_in(ahead, queue, task, [_evaluation(int8, "passed")])
    assert ahead.stopped == ["TorchAOBackend()"]  # no longer pending: stopped once
    strategy.drop_stood_in(None, queue, task, [_evaluation(int8, "passed")])  # no background worker: nothing to do


@NEEDS_OV_NNCF
@pytest.mark.skipif(not backend_available("TorchAOBackend"), reason="needs torchao")
def test_tuning_skips_torchao_after_openvino_int8_passed(monkeypatch) -> None:
    _ov_int8_pair(monkeypatch, [], float_s=0.002, int8_s=0.001)  # the int8 layer probe lets OpenVINO int8 be built
    wide, _ = _int8_wide()
    strategy = tt.HighestThroughputStrategy([TorchAOBackend(), OpenVINOBackend(OpenVINOBackendConfig(
        quantization="int8", inference_precision="f32"))])
    report = tt.tune(tt.Module(wide, name="wide", strategy=strategy), [torch.randn(512) for _ in range(8)],
                     batch_sizes=[1, 8], executor="inline")
    rows = [c for c in report.modules[0].graphs[0].candidates if c.role == "candidate"]
    # the cheaper build takes the first turn (served through the guard: OpenVINO's ReLU turns NaN into numbers)
    assert [r.backend for r in rows] == ["OpenVINOBackend(inference_precision=f32,quantization=int8) + non-finite "
                                         "guard", "TorchAOBackend()"]
    assert rows[0].status in ("passed", "chosen") and rows[0].precision == "int8"
    assert rows[1].status == "skipped" and rows[1].build_time_s is None
    assert rows[1].error.startswith("skipped: its int8 quantizes the same nn.Linear layers as OpenVINOBackend(")
