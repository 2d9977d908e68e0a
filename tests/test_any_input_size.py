"""A tuned model serves every size eager serves on its dynamic axes, not only the recorded range.

Tuning records a few sentences at batch sizes 1 and 2; the tuned encoder is then called with batch sizes and
sequence lengths outside what was recorded. A backend that truly cannot serve a call hands it to the original
module (while its weights are loaded), with one log line.
"""

from __future__ import annotations

import logging

import pytest
import torch
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import UnsupportedInputError
from torch_tweak.tiny_models import bert_dataset, tiny_bert
from torch_tweak.torch.backend import TorchEagerBackend

OUTSIDE = [(5, 3), (3, 30), (1, 2)]  # (batch, sequence length); recorded: batch 1-2, length 6-11


def _calls():
    generator = torch.Generator().manual_seed(7)
    for batch, length in OUTSIDE:
        yield {"input_ids": torch.randint(1, 100, (batch, length), generator=generator),
               "attention_mask": torch.ones(batch, length, dtype=torch.long)}


def _tuned_bert(backend):
    model = tiny_bert()
    wrapped = tt.Module(model, name="bert", strategy=tt.OneBackendStrategy(backend))
    report = tt.tune(wrapped, bert_dataset(), batch_sizes=[1, 2])
    assert wrapped.state is tt.ModuleState.TUNED, report
    return model, wrapped


def _check_outside_range(backend, atol, caplog):
    reference = tiny_bert()
    model, wrapped = _tuned_bert(backend)
    spec = wrapped.graph_specs[0]
    ids = next(s for s in spec.inputs if s.name.endswith("input_ids"))
    assert (ids.min_shape[0], ids.max_shape[0]) == (1, 2) and (ids.min_shape[1], ids.max_shape[1]) == (6, 11)
    for call in _calls():
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="torch_tweak.torch.module.wrapper"):
            got, want = wrapped(**call), reference(**call)
        assert not [r for r in caplog.records if "cannot serve" in r.getMessage()]  # the backend served it
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=atol, rtol=atol)
        torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=atol, rtol=atol)


@pytest.mark.openvino
@pytest.mark.parametrize("hint", ["LATENCY", "THROUGHPUT"])
def test_openvino_serves_batch_and_sequence_outside_the_recorded_range(hint, caplog):
    pytest.importorskip("openvino")
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    backend = OpenVINOBackend(OpenVINOBackendConfig(performance_hint=hint, inference_precision="f32"))
    _check_outside_range(backend, 1e-4, caplog)


@pytest.mark.slow
def test_inductor_aot_serves_batch_and_sequence_outside_the_recorded_range(caplog):
    from torch_tweak.torch.backend import TorchInductorAOTBackend

    _check_outside_range(TorchInductorAOTBackend(), 1e-4, caplog)


class SmallBatchOnly(TorchEagerBackend):
    """Eager, but refuses batches over 4 the way a runtime with a fixed shape would."""

    def _infer(self, *args, **kwargs):
        if args[0].shape[0] > 4:
            raise UnsupportedInputError(f"batch {args[0].shape[0]} is over this runtime's limit of 4")
        return super()._infer(*args, **kwargs)


def test_a_call_the_backend_cannot_serve_runs_the_original_module_once_logged(caplog):
    model = mlp()
    wrapped = tt.Module(model, name="limited", strategy=tt.OneBackendStrategy(SmallBatchOnly()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2])
    x = torch.randn(7, 8)
    with caplog.at_level(logging.WARNING, logger="torch_tweak.torch.module.wrapper"):
        first, second = wrapped(x), wrapped(x)
    torch.testing.assert_close(first, mlp()(x))
    torch.testing.assert_close(second, first)
    logged = [r.getMessage() for r in caplog.records if "cannot serve a call" in r.getMessage()]
    assert len(logged) == 1 and "over this runtime's limit of 4" in logged[0] and "original module" in logged[0]


class SelfContainedSmallBatchOnly(SmallBatchOnly):
    """Claims not to need the module's weights (as OpenVINO does), so tuning offloads them."""

    requires_original_module = False


def test_without_the_original_weights_the_refusal_is_raised():
    from torch_tweak.torch.module.state import internals

    tt.config.device_after_tuning = "meta"
    wrapped = tt.Module(mlp(), name="limited_meta", strategy=tt.OneBackendStrategy(SelfContainedSmallBatchOnly()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2])
    assert internals(wrapped).offloaded
    with pytest.raises(UnsupportedInputError, match="limit of 4"):
        wrapped(torch.randn(7, 8))


def test_a_graph_that_needed_auto_dims_once_is_exported_with_them_first():
    """OpenVINO and ONNX Runtime export the same graph in one worker: the failing first attempt runs once."""
    from torch_tweak.torch.backend._export import export_with_dims
    from torch_tweak.torch.module.recording import Recorder

    model, recorder = tiny_bert(), Recorder(True, 8)
    with torch.no_grad():
        for sentence in bert_dataset():
            recorder.record_call(model.forward, (), {k: v.unsqueeze(0) for k, v in sentence.items()}, 1)
    (spec,) = recorder.graph_specs()
    assert any(s.dynamic_axes() for s in spec.inputs)
    tried = []

    def export(auto_dims: bool) -> str:
        tried.append(auto_dims)
        if not auto_dims:
            raise RuntimeError("Constraints violated")
        return "program"

    assert export_with_dims(model, spec, export, "test export") == "program" and tried == [False, True]
    assert export_with_dims(model, spec, export, "test export") == "program" and tried == [False, True, True]
    assert export_with_dims(tiny_bert(), spec, export, "test export") == "program"  # another module: tried again
    assert tried[3:] == [False, True]
    static = mlp()
    static_recorder = Recorder(True, 8)
    with torch.no_grad():
        static_recorder.record_call(static.forward, (torch.randn(2, 8),), {}, 2)
    (static_spec,) = static_recorder.graph_specs()
    with pytest.raises(RuntimeError, match="Constraints violated"):  # no dynamic axis: nothing to retry with
        export_with_dims(static, static_spec, export, "test export")


def _recorded_bert_spec(model):
    from torch_tweak.torch.module.recording import Recorder

    recorder = Recorder(True, 8)
    with torch.no_grad():
        for sentence in bert_dataset():
            recorder.record_call(model.forward, (), {k: v.unsqueeze(0) for k, v in sentence.items()}, 1)
    (spec,) = recorder.graph_specs()
    return spec


def test_the_export_for_openvino_and_onnxruntime_infers_related_axes_on_its_first_attempt(caplog):
    """A BERT's ids and mask share their sequence axis: independent dims fail (a retry with Dim.AUTO costs 4-5 s on a
    BERT-base); Dim.DYNAMIC lets export infer it at once, and the program takes every recorded length."""
    from torch.export import Dim

    from torch_tweak.torch.backend._export import dynamic_shapes, example_leaves, export_program

    model = tiny_bert()
    spec = _recorded_bert_spec(model)
    assert [s.name for s in spec.inputs] == ["kwargs_attention_mask", "kwargs_input_ids"]
    axes = [spec.inputs[i].dynamic_axes() for i in range(len(spec.inputs))]
    assert all(axes) and all(spec.inputs[i].min_shape[a] > 1 for i, ax in enumerate(axes) for a in ax)
    (named,) = dynamic_shapes(spec)
    (inferred,) = dynamic_shapes(spec, inferred=True)
    assert all(not isinstance(d[a], type(Dim.DYNAMIC)) for d, ax in zip(named, axes) for a in ax)
    assert all(d[a] is Dim.DYNAMIC for d, ax in zip(inferred, axes) for a in ax)
    caplog.set_level(logging.INFO, logger="torch_tweak")
    with torch.no_grad():
        calls = [((), {k: v.unsqueeze(0) for k, v in sentence.items()}) for sentence in bert_dataset()]
        program = export_program(model, spec, tuple(example_leaves(spec, calls)))
    assert "retrying with Dim.AUTO" not in caplog.text
    short = {"input_ids": torch.randint(1, 100, (1, 2)), "attention_mask": torch.ones(1, 2, dtype=torch.long)}
    expected = model(**short).last_hidden_state
    served = program.module()(short["attention_mask"], short["input_ids"])  # graph order: sorted keyword names
    assert torch.allclose(served[0], expected, atol=1e-5)


def test_an_axis_recorded_at_size_1_keeps_an_independent_dim_that_takes_1():
    """Dim.DYNAMIC's lower bound is 2: an axis recorded at length 1 keeps its named Dim (min 1), as before."""
    from torch.export import Dim

    from torch_tweak.torch.backend._export import dynamic_shapes
    from torch_tweak.torch.module.recording import Recorder

    model, recorder = tiny_bert(), Recorder(True, 8)
    with torch.no_grad():
        for length in (1, 5):
            call = {"input_ids": torch.randint(1, 100, (1, length)),
                    "attention_mask": torch.ones(1, length, dtype=torch.long)}
            recorder.record_call(model.forward, (), call, 1)
    (spec,) = recorder.graph_specs()
    dynamic = [(i, a) for i, s in enumerate(spec.inputs) for a in s.dynamic_axes()]
    assert dynamic and all(spec.inputs[i].min_shape[a] == 1 for i, a in dynamic)
    (shapes,) = dynamic_shapes(spec, inferred=True)
    assert all(shapes[i][a] is not Dim.DYNAMIC and shapes[i][a].min == 1 for i, a in dynamic)


# sequence axes recorded at one length (module/lengths.py) -----------------------------------------------------------


def _tuned_on_one_length(backend, name):
    model = tiny_bert()
    wrapped = tt.Module(model, name=name, strategy=tt.OneBackendStrategy(backend))
    report = tt.tune(wrapped, bert_dataset(lengths=(8, 8, 8)), batch_sizes=[1, 2])
    assert wrapped.state is tt.ModuleState.TUNED, report
    return wrapped, report


def _assert_serves_other_lengths(wrapped, atol, caplog):
    reference = tiny_bert()
    for call in _calls():
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="torch_tweak.torch.module.wrapper"):
            got, want = wrapped(**call), reference(**call)
        assert not [r for r in caplog.records if "cannot serve" in r.getMessage()]
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=atol, rtol=atol)


@pytest.mark.openvino
def test_sentences_of_one_length_are_tuned_for_any_length_with_openvino(tmp_path, caplog):
    pytest.importorskip("openvino")
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig
    from torch_tweak.torch.module.state import internals

    with caplog.at_level(logging.INFO, logger="torch_tweak.torch.module.lengths"):
        wrapped, report = _tuned_on_one_length(OpenVINOBackend(OpenVINOBackendConfig(inference_precision="f32")),
                                               "bert_one_length")
    probed = [r.getMessage() for r in caplog.records if "had one length in every recorded call" in r.getMessage()]
    assert len(probed) == 1 and "kwargs_attention_mask axis 1, kwargs_input_ids axis 1" in probed[0], probed
    ids = next(s for s in wrapped.graph_specs[0].inputs if s.name.endswith("input_ids"))
    assert ids.shape[1] == "dim1" and (ids.min_shape[1], ids.max_shape[1]) == (4, 8)
    assert internals(wrapped).offloaded  # the original weights are gone: the backend serves every length
    _assert_serves_other_lengths(wrapped, 1e-4, caplog)
    tt.save(wrapped, tmp_path / "bert.tt")
    _assert_serves_other_lengths(tt.load(tiny_bert(), tmp_path / "bert.tt"), 1e-4, caplog)


def test_sentences_of_one_length_are_tuned_for_any_length_with_onnxruntime(caplog):
    pytest.importorskip("onnxruntime")
    from torch_tweak.torch.backend import ONNXRuntimeBackend

    wrapped, _ = _tuned_on_one_length(ONNXRuntimeBackend(), "bert_one_length_ort")
    _assert_serves_other_lengths(wrapped, 1e-4, caplog)


@pytest.mark.openvino
def test_without_the_probe_a_length_seen_once_stays_static():
    pytest.importorskip("openvino")
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    tt.config.probe_sequence_lengths = False
    wrapped, _ = _tuned_on_one_length(OpenVINOBackend(OpenVINOBackendConfig(inference_precision="f32")),
                                      "bert_static_length")
    ids = next(s for s in wrapped.graph_specs[0].inputs if s.name.endswith("input_ids"))
    assert ids.shape[1] == 8 and wrapped.graph_specs[0].inputs[0].min_shape[1] == 8
    call = {"input_ids": torch.ones(1, 5, dtype=torch.long), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    with pytest.raises(UnsupportedInputError, match="static axes were the same in every recorded call"):
        wrapped(**call)


class FixedLength(torch.nn.Module):
    """Embeds token ids, but only of length 8 (a model with a fixed-size position table, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] != 8:
            raise ValueError(f"sequences must have 8 tokens, got {ids.shape[1]}")
        return self.embed(ids).sum(1)


def test_a_module_that_runs_one_length_only_keeps_it_and_is_tuned(caplog):
    wrapped = tt.Module(FixedLength(), name="fixed_length", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    with caplog.at_level(logging.INFO, logger="torch_tweak.torch.module.lengths"):
        tt.tune(wrapped, [torch.randint(0, 100, (8,)) for _ in range(3)], batch_sizes=[1, 2])
    assert wrapped.state is tt.ModuleState.TUNED and wrapped.graph_specs[0].inputs[0].shape == ("batch0", 8)
    (message,) = [r.getMessage() for r in caplog.records if "did not run at half" in r.getMessage()]
    assert "ValueError: sequences must have 8 tokens, got 4" in message and "stay at their recorded length" in message
    assert wrapped(torch.randint(0, 100, (3, 8))).shape == (3, 4)


def test_floating_point_inputs_and_short_axes_are_not_probed():
    from torch_tweak.torch.module.lengths import constant_integer_axes, record_shorter_call
    from torch_tweak.torch.module.recording import Recorder

    recorder = Recorder(True, 4)

    def forward(x: torch.Tensor, ids: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        return x.sum(1) + ids.sum(1) + flags.sum(1)

    with torch.no_grad():
        for batch in (1, 2):
            recorder.record_call(forward, (torch.randn(batch, 8), torch.ones(batch, 6, dtype=torch.long),
                                           torch.ones(batch, 1, dtype=torch.bool)), {}, batch)
    (graph,) = recorder.graphs.values()
    assert constant_integer_axes(graph) == {(1, 1): 6}  # not the floats' axis, nor a length of 1
    assert record_shorter_call(graph, forward, "m") and not record_shorter_call(graph, forward, "m")  # once
    (spec,) = recorder.graph_specs()
    assert [s.shape for s in spec.inputs] == [("batch0", 8), ("batch0", "dim1"), ("batch0", 1)]
    assert spec.inputs[1].min_shape == (1, 3) and len(graph.samples) == 3


class BranchesOnLength(torch.nn.Module):
    """Runs every length, but its code branches on it: no single exported program serves lengths on both sides."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return x * 2 if ids.shape[1] > 6 else x


def test_an_export_that_cannot_take_the_probed_length_fails_its_candidate_saying_why():
    pytest.importorskip("onnxruntime")
    from torch_tweak.torch.backend import ONNXRuntimeBackend

    wrapped = tt.Module(BranchesOnLength(), name="branches", strategy=tt.OneBackendStrategy(ONNXRuntimeBackend()))
    report = tt.tune(wrapped, [torch.randint(0, 100, (8,)) for _ in range(3)], batch_sizes=[1, 2])
    (row,) = [c for c in report.modules[0].graphs[0].candidates if c.backend == "ONNXRuntimeBackend()"]
    assert row.status == "build_failed"
    assert ("could not keep axis 1 of input 'args_0' dynamic over the recorded sizes 4..8: the exported program "
            "takes sizes 7..any only") in row.error
    assert "tt.config.probe_sequence_lengths" in row.error
    tt.config.probe_sequence_lengths = False  # the fix the message names
    fixed = tt.Module(BranchesOnLength(), name="branches_fixed", strategy=tt.OneBackendStrategy(ONNXRuntimeBackend()))
    tt.tune(fixed, [torch.randint(0, 100, (8,)) for _ in range(3)], batch_sizes=[1, 2])
    assert fixed.state is tt.ModuleState.TUNED
