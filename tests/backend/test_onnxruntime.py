"""ONNXRuntimeBackend: config, state machine, fidelity on sizes outside the recorded range, INT8, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")

from toy_models import PaddedCausalAttention, left_padded_call  # noqa: E402

import torch_tweak.torch as tt  # noqa: E402
from torch_tweak.errors import (  # noqa: E402
    BackendStateError,
    CheckpointError,
    ConfigError,
    ConversionError,
    UnsupportedDeviceError,
    UnsupportedInputError,
)
from torch_tweak.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig, TorchEagerBackend  # noqa: E402
from torch_tweak.torch.backend.backend import BackendState  # noqa: E402
from torch_tweak.torch.fidelity import FidelityConfig  # noqa: E402
from torch_tweak.torch.module.recording import record  # noqa: E402

CPU = torch.device("cpu")
INT8 = ONNXRuntimeBackendConfig(quantization="int8_dynamic")
PER_TENSOR = ONNXRuntimeBackendConfig(quantization="int8_dynamic_per_tensor")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()


class BnCNN(nn.Module):
    """Convolution, batch norm with non-trivial statistics (folded by the exporter), max pooling, linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8, 5)
        self.body[1].running_mean.uniform_(-1, 1)
        self.body[1].running_var.uniform_(0.5, 2)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


class Encoder(nn.Module):
    """Token ids and a padding mask (keyword argument) → dict of hidden states and a pooled vector."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.encoder(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)
        return {"hidden": h, "pooled": h.mean(dim=1)}


class DataDependent(nn.Module):
    """A branch on a tensor value: torch.export cannot capture it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x - 1


class Outlier(nn.Module):
    """A constant 1e4 feature the weights ignore: one INT8 scale for the whole activation tensor wipes out the rest."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(33, 16)
        with torch.no_grad():
            self.lin.weight[:, -1] = 0.0
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([x, x.new_full((*x.shape[:-1], 1), 1e4)], dim=-1))


def encoder_call(batch: int, seq: int) -> tuple:
    ids = torch.randint(0, 100, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -1] = 0
    return (ids,), {"attention_mask": mask}


MODELS = {  # factory, recorded calls (batch, sample), calls outside the recorded batch and sequence ranges
    "mlp": (mlp, lambda: [(b, ((torch.randn(b, 8),), {})) for b in (2, 4)],
            lambda: [((torch.randn(b, 8),), {}) for b in (1, 9, 64)]),
    "cnn": (BnCNN, lambda: [(b, ((torch.randn(b, 3, 8, 8),), {})) for b in (2, 3)],
            lambda: [((torch.randn(b, 3, 8, 8),), {}) for b in (1, 17)]),
    "encoder": (Encoder, lambda: [(b, encoder_call(b, s)) for b, s in ((2, 5), (3, 7))],
                lambda: [encoder_call(b, s) for b, s in ((1, 3), (6, 5), (2, 40), (9, 2))]),
    "padded_attention": (PaddedCausalAttention, lambda: [(b, left_padded_call(b, s)) for b, s in ((2, 6), (3, 8))],
                         lambda: [left_padded_call(b, s) for b, s in ((1, 4), (5, 7), (2, 33))]),
}


def build(name: str, cache: Path, config: ONNXRuntimeBackendConfig | None = None):
    factory, calls, _ = MODELS[name]
    model = factory()
    torch.manual_seed(1)
    ((spec, samples),) = record(model, calls())
    backend = ONNXRuntimeBackend(config)
    backend.build(model, spec, [s.sample for s in samples], CPU, cache)
    return backend, spec, samples, model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """Backends built once per model for the tests that only run them."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            cache[name] = build(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def assert_close(actual, expected, atol: float = 1e-5) -> None:
    assert type(actual) is type(expected)
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_close(actual[key], expected[key], atol)
    else:
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, atol=atol, rtol=atol)


# config ----------------------------------------------------------------------------------------


def test_import_and_config_do_not_import_onnxruntime() -> None:
    code = (
        "import sys; from torch_tweak.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig;"
        "ONNXRuntimeBackend(ONNXRuntimeBackendConfig(quantization='int8_dynamic')).describe();"
        "ONNXRuntimeBackend.default_variants();"
        "bad = [m for m in ('onnxruntime', 'onnx', 'onnxscript') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_defaults_describe_key_round_trip() -> None:
    default = ONNXRuntimeBackendConfig()
    assert (default.graph_optimization_level, default.intra_op_num_threads, default.execution_mode,
            default.quantization) == ("all", None, "sequential", None)
    assert ONNXRuntimeBackend().describe() == "ONNXRuntimeBackend()"
    config = ONNXRuntimeBackendConfig(graph_optimization_level="BASIC", intra_op_num_threads=1,
                                      execution_mode="Parallel", quantization="int8_dynamic")
    backend = ONNXRuntimeBackend(config)
    assert backend.describe() == ("ONNXRuntimeBackend(graph_optimization_level=basic,intra_op_num_threads=1,"
                                  "execution_mode=parallel,quantization=int8_dynamic)")
    assert backend.key() == f"ONNXRuntimeBackend_{config.key()}" and backend.key() != ONNXRuntimeBackend().key()
    assert ONNXRuntimeBackendConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert backend.executed_precision == "int8" and ONNXRuntimeBackend().executed_precision == "fp32"
    assert ONNXRuntimeBackend.runtime == "onnxruntime" and not ONNXRuntimeBackend.native_code
    assert backend.precision_fallback().describe() == ("ONNXRuntimeBackend(graph_optimization_level=basic,"
                                                       "intra_op_num_threads=1,execution_mode=parallel)")


@pytest.mark.parametrize("onnx_installed", [True, False])
@pytest.mark.parametrize("cores", [1, 2])
def test_default_variants_add_dynamic_int8_where_onnx_can_quantize_and_one_thread_int8_with_more_cores(
        monkeypatch: pytest.MonkeyPatch, onnx_installed: bool, cores: int) -> None:
    import importlib.util

    from torch_tweak.torch.backend import onnxruntime as ort_backend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (real(name, *a) if onnx_installed else None) if name == "onnx" else real(name, *a))
    monkeypatch.setattr(ort_backend, "usable_cores", lambda: cores)
    int8 = ["ONNXRuntimeBackend(quantization=int8_dynamic_per_tensor)"]
    if cores > 1:
        int8.append("ONNXRuntimeBackend(intra_op_num_threads=1,quantization=int8_dynamic_per_tensor)")
    expected = ["ONNXRuntimeBackend()"] + (int8 if onnx_installed else [])
    variants = ONNXRuntimeBackend.default_variants()
    assert [b.describe() for b in variants] == expected
    # the one-thread int8 model is the every-core one's twin: same outputs, built from its files
    if len(variants) == 3:
        assert variants[2].every_core_twin().key() == variants[1].key()
        assert variants[2].outputs_key() == variants[1].outputs_key() != variants[0].outputs_key()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"graph_optimization_level": "max"}, "graph_optimization_level"),
        ({"intra_op_num_threads": 0}, "intra_op_num_threads"),
        ({"intra_op_num_threads": True}, "intra_op_num_threads"),
        ({"execution_mode": None}, "execution_mode"),
        ({"quantization": "int4"}, "'int8_dynamic_per_tensor', 'int8_dynamic'"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ONNXRuntimeBackendConfig(**kwargs)


def test_config_from_dict_refuses_unknown_fields() -> None:
    with pytest.raises(ConfigError, match="providers"):
        ONNXRuntimeBackendConfig.from_dict({"providers": ["CUDAExecutionProvider"]})


# state machine ---------------------------------------------------------------------------------


def test_state_machine_before_build() -> None:
    backend = ONNXRuntimeBackend()
    assert backend.state == BackendState.INIT
    with pytest.raises(RuntimeError, match="Backend has not been properly initialized. Please call build"):
        backend.to_dict()
    with pytest.raises(BackendStateError, match="should be built first"):
        backend.activate()
    with pytest.raises(BackendStateError, match="should be built first"):
        backend.deactivate()
    with pytest.raises(BackendStateError, match="should be activated first"):
        backend.infer(torch.randn(1, 8))
    with pytest.raises(BackendStateError, match="should be loaded from a checkpoint"):
        backend.deploy(CPU)


def test_state_machine_build_to_deploy(tmp_path: Path) -> None:
    backend, spec, samples, _ = build("mlp", tmp_path / "cache")
    x = samples[0].args[0]
    assert backend.state == BackendState.ACTIVE and backend.is_active and backend.device == CPU
    assert backend._session.threads == len(os.sched_getaffinity(0))
    with pytest.raises(BackendStateError, match="build should be called only once"):
        backend.build(mlp(), spec, [], CPU, tmp_path / "other")
    with pytest.raises(BackendStateError, match="should be loaded from a checkpoint"):
        backend.deploy(CPU)
    backend.deactivate()
    assert backend.state == BackendState.INACTIVE and backend._session is None
    with pytest.raises(BackendStateError, match="should be activated first"):
        backend.infer(x)
    backend.activate()
    assert_close(backend.infer(x), samples[0].outputs)

    state = backend.to_dict()
    assert state["onnx_model"] == tmp_path / "cache" / "onnxruntime" / "model.onnx"
    json.dumps({k: v for k, v in state.items() if not isinstance(v, Path)})
    loaded = ONNXRuntimeBackend.from_dict(None, state)
    assert loaded.state == BackendState.CHECKPOINT_LOADED and loaded.describe() == backend.describe()
    with pytest.raises(BackendStateError, match="has already been deployed"):
        loaded.deactivate()
    with pytest.raises(BackendStateError, match="should be activated first"):
        loaded.infer(x)
    with pytest.raises(UnsupportedDeviceError, match="CPU execution provider"):
        loaded.deploy("xpu:0")
    loaded.deploy(None)
    assert loaded.state == BackendState.DEPLOYED and loaded.device == CPU
    assert_close(loaded.infer(x), samples[0].outputs)
    for method in (loaded.activate, loaded.deactivate):
        with pytest.raises(BackendStateError, match="already deployed"):
            method()
    again = ONNXRuntimeBackend.from_dict(None, state)
    again.activate()
    assert_close(again.infer(x), samples[0].outputs)


def test_from_dict_errors(tmp_path: Path) -> None:
    backend, _, samples, _ = build("mlp", tmp_path / "cache")
    state = backend.to_dict()
    with pytest.raises(ValueError, match="Invalid state_dict type: TorchEagerBackend"):
        ONNXRuntimeBackend.from_dict(None, {**state, "type": "TorchEagerBackend"})
    with pytest.raises(ValueError, match=r"Checkpoint is missing the ONNX model path \(onnx_model\)."):
        ONNXRuntimeBackend.from_dict(None, {k: v for k, v in state.items() if k != "onnx_model"})
    with pytest.raises(CheckpointError, match="does not exist"):
        ONNXRuntimeBackend.from_dict(None, {**state, "onnx_model": tmp_path / "nowhere.onnx"})
    folder = tmp_path / "folder"  # the artifact form of a model whose weights are external files
    folder.mkdir()
    shutil.copy(state["onnx_model"], folder / "model.onnx")
    from_folder = ONNXRuntimeBackend.from_dict(None, {**state, "onnx_model": folder})
    from_folder.deploy(None)
    assert_close(from_folder.infer(samples[0].args[0]), samples[0].outputs)

    state["onnx_model"].write_bytes(b"\x08\x07garbage")
    corrupt = ONNXRuntimeBackend.from_dict(None, state)
    with pytest.raises(CheckpointError, match="corrupt"):
        corrupt.deploy(CPU)
    backend.deactivate()
    with pytest.raises(CheckpointError, match="corrupt"):
        backend.activate()


def test_model_reading_outside_its_folder_is_refused(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, numpy_helper

    backend, _, _, _ = build("mlp", tmp_path / "cache")
    model = onnx.load(str(backend.to_dict()["onnx_model"]))
    weight = next(t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT)
    size = numpy_helper.to_array(weight).nbytes
    (tmp_path / "secret.bin").write_bytes(b"\0" * size)  # a file beside the archive member's folder
    for field in ("raw_data", "float_data"):
        weight.ClearField(field)
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", str(size))):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    (tmp_path / "member").mkdir()
    onnx.save(model, str(tmp_path / "member" / "model.onnx"))
    forged = ONNXRuntimeBackend.from_dict(None, {**backend.to_dict(), "onnx_model": tmp_path / "member" / "model.onnx"})
    with pytest.raises(CheckpointError, match="escapes model directory"):
        forged.deploy(None)


# export and fidelity ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_eager_inside_and_outside_the_recorded_ranges(name: str, built) -> None:
    backend, spec, samples, model = built(name)
    assert backend.executed_precision == "fp32"
    for sample in samples:
        assert_close(backend.infer(*sample.args, **sample.kwargs), sample.outputs)
    for args, kwargs in MODELS[name][2]():  # batch sizes and sequence lengths never recorded
        with torch.no_grad():
            expected = model(*args, **kwargs)
        assert_close(backend.infer(*args, **kwargs), expected)


def test_input_variants_and_bad_inputs(built) -> None:
    backend, _, _, model = built("mlp")
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    assert_close(backend.infer(x.clone().requires_grad_()), expected)
    assert_close(backend.infer(torch.empty(8, 4).t().copy_(x)), expected)  # non-contiguous
    backend.infer(x).add_(1)  # outputs are writable tensors
    with pytest.raises(UnsupportedInputError, match="expected dtype float32, got float64"):
        backend.infer(x.double())
    with pytest.raises(UnsupportedInputError, match=r"shape \[2, 7\] does not fit"):
        backend.infer(torch.randn(2, 7))
    with pytest.raises(UnsupportedInputError, match="does not match graph"):
        backend.infer(x, x)
    encoder, _, samples, _ = built("encoder")
    with pytest.raises(UnsupportedInputError, match="does not match graph"):
        encoder.infer(*samples[0].args)


def test_the_non_finite_guard_checks_the_array_the_session_is_fed(tmp_path: Path) -> None:
    from torch_tweak.torch.backend.non_finite_guard import NonFiniteGuardBackend

    backend, spec, samples, model = build("mlp", tmp_path)
    fed: list[object] = []
    run = backend._session._run
    backend._session._run = lambda names, feed, options: fed.append(next(iter(feed.values()))) or run(names, feed, options)
    checked: list[object] = []

    def array_ok(array: object) -> bool:
        checked.append(array)
        return bool(torch.from_numpy(array).isfinite().all())

    guard = NonFiniteGuardBackend(backend, model, spec, "test")
    assert guard.serving().__qualname__ == backend.checked_serving(array_ok, None, None).__qualname__
    serve = backend.checked_serving(array_ok, lambda args, kwargs: "refused", lambda *a, **k: "other")
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert_close(serve(x), model(x))
        assert len(fed) == len(checked) == 1 and fed[0] is checked[0]  # one view, checked and fed
        assert serve(torch.full((2, 8), math.nan)) == "refused" and len(fed) == 1
        assert serve(x, x) == "other" and serve(x=x) == "other"
        poisoned = x.clone()
        poisoned[1, 2] = math.inf
        torch.testing.assert_close(guard.serving()(poisoned), model(poisoned), equal_nan=True)
    assert guard.diverted_calls == 1
    (encoder, *_) = build("encoder", tmp_path / "encoder")
    assert encoder.checked_serving(array_ok, None, None) is None  # two inputs: the guard's general walk


def test_concurrent_calls_are_safe(built) -> None:
    backend, _, _, model = built("mlp")
    inputs = [torch.randn(1 + i, 8) for i in range(6)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(30):
                k = (i + offset) % len(inputs)
                torch.testing.assert_close(backend.infer(inputs[k]), expected[k], atol=1e-5, rtol=1e-5)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_session_options_follow_the_config(tmp_path: Path) -> None:
    config = ONNXRuntimeBackendConfig(graph_optimization_level="basic", intra_op_num_threads=1,
                                      execution_mode="parallel")
    backend, _, samples, _ = build("mlp", tmp_path, config)
    import onnxruntime as ort

    options = backend._session.session.get_session_options()
    assert options.intra_op_num_threads == 1 and options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert_close(backend.infer(*samples[0].args), samples[0].outputs)


def test_failed_export_is_a_conversion_error_and_a_report_row(tmp_path: Path) -> None:
    ((spec, samples),) = record(DataDependent(), [(b, ((torch.ones(b, 4),), {})) for b in (1, 2)])
    with pytest.raises(ConversionError, match="torch.export of graph '0' failed") as info:
        ONNXRuntimeBackend().build(DataDependent(), spec, [s.sample for s in samples], CPU, tmp_path / "a")
    assert info.value.__cause__ is not None and "data-dependent" in str(info.value)
    wrapped = tt.Module(DataDependent(), name="dd", strategy=tt.FirstWinsStrategy([ONNXRuntimeBackend(),
                                                                                  TorchEagerBackend()]))
    report = tt.tune(wrapped, [torch.ones(4) for _ in range(2)], batch_sizes=[1, 2])
    failed, chosen = report.modules[0].graphs[0].candidates
    assert failed.status == "build_failed" and failed.error.startswith("ConversionError: torch.export")
    assert chosen.status == "chosen" and chosen.backend == "TorchEagerBackend()"


# INT8 ------------------------------------------------------------------------------------------


def _tune_int8(model: nn.Module, shape: tuple[int, ...], fidelity: FidelityConfig | None = None):
    strategy = tt.FirstWinsStrategy([ONNXRuntimeBackend(INT8), TorchEagerBackend()], fidelity=fidelity)
    wrapped = tt.Module(model, name=type(model).__name__, strategy=strategy)
    report = tt.tune(wrapped, [torch.randn(*shape) for _ in range(4)], batch_sizes=[1, 4])
    return wrapped, report.modules[0].graphs[0].candidates


def test_int8_builds_quantized_and_passes_where_it_should(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    backend, _, _, _ = build("mlp", tmp_path, INT8)  # Gemm nodes are rewritten so that they are quantized
    ops = {node.op_type for node in onnx.load(str(backend.to_dict()["onnx_model"])).graph.node}
    assert "Gemm" not in ops and ops & {"MatMulInteger", "DynamicQuantizeMatMul"}
    wide = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    wrapped, rows = _tune_int8(wide, (16, 64), FidelityConfig(check_non_finite=False))  # finite inputs only
    assert rows[0].status == "chosen" and rows[0].precision == "int8"
    assert rows[0].fidelity["min_cosine"] > 0.999
    x = torch.randn(7, 16, 64)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), wide(x), atol=0.05, rtol=0.05)


class TwoScales(nn.Module):
    """An output channel with weights 1000x the others': one INT8 scale for the whole weight matrix rounds the other
    channels' weights to zero, one scale per output channel keeps them. The two groups are separate outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 8)
        with torch.no_grad():
            self.lin.weight[0] *= 1000
        self.eval()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y[..., :1], y[..., 1:]


def test_int8_weights_take_one_scale_per_matrix_or_per_output_channel(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    shapes = {}
    for name, config in (("tensor", PER_TENSOR), ("channel", INT8)):
        backend, _, _, model = build("mlp", tmp_path / name, config)
        graph = onnx.load(str(backend.to_dict()["onnx_model"])).graph
        scales = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        shapes[name] = [scales[n.input[1]].shape for n in graph.node if n.op_type == "Mul" and n.input[1] in scales]
        x = torch.randn(5, 8)
        with torch.no_grad():
            torch.testing.assert_close(backend.infer(x), model(x), atol=0.05, rtol=0.05)
    assert shapes["tensor"] == [(), ()] and shapes["channel"] == [(16,), (4,)]  # the scales of the two weights


def test_int8_rejected_with_per_tensor_weights_is_retried_per_channel_then_in_float() -> None:
    chain, backend = [], ONNXRuntimeBackend(dataclasses.replace(PER_TENSOR, intra_op_num_threads=1))
    while backend is not None:
        chain.append(backend.describe())
        backend = backend.precision_fallback()
    assert chain == ["ONNXRuntimeBackend(intra_op_num_threads=1,quantization=int8_dynamic_per_tensor)",
                     "ONNXRuntimeBackend(intra_op_num_threads=1,quantization=int8_dynamic)",
                     "ONNXRuntimeBackend(intra_op_num_threads=1)"]
    pytest.importorskip("onnx")
    strategy = tt.HighestThroughputStrategy([ONNXRuntimeBackend(PER_TENSOR)],
                                            fidelity=FidelityConfig(check_non_finite=False))
    wrapped = tt.Module(TwoScales(), name="two_scales", strategy=strategy)
    report = tt.tune(wrapped, [torch.randn(16) for _ in range(4)], batch_sizes=[1, 4], executor="inline")
    rows = {r.backend: r for r in report.modules[0].graphs[0].candidates}
    per_tensor = rows["ONNXRuntimeBackend(quantization=int8_dynamic_per_tensor)"]
    assert per_tensor.status == "rejected" and "tolerance for int8" in per_tensor.error
    per_channel = rows["ONNXRuntimeBackend(quantization=int8_dynamic)"]  # its own row, after the rejected one
    assert per_channel.status in ("passed", "chosen") and per_channel.precision == "int8"
    assert per_channel.fidelity["max_rel_l2"] < 0.05 < per_tensor.fidelity["max_rel_l2"]
    assert "ONNXRuntimeBackend()" not in rows  # passed: no float retry


def test_int8_weights_lose_their_all_zero_zero_points_and_keep_their_outputs(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from torch_tweak.torch.backend._onnx import _drop_zero_weight_zero_points

    backend, _, _, _ = build("mlp", tmp_path, INT8)
    model = onnx.load(str(backend.to_dict()["onnx_model"]))
    products = [node for node in model.graph.node if node.op_type == "MatMulInteger"]
    assert products and all(len(node.input) == 3 for node in products)  # activation, weight, activation's zero point
    assert not [t.name for t in model.graph.initializer if "zero_point" in t.name]
    # against onnxruntime's own output: the same arithmetic, so the same numbers; a non-zero point stays
    source = tmp_path / "float.onnx"
    torch.onnx.export(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), (torch.randn(2, 8),),
                      str(source), input_names=["x"], dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    plain, dropped, uint8 = tmp_path / "plain.onnx", tmp_path / "dropped.onnx", tmp_path / "uint8.onnx"
    for target, weight_type in ((plain, QuantType.QInt8), (uint8, QuantType.QUInt8)):
        quantize_dynamic(source, target, op_types_to_quantize=["MatMul", "Gemm"], per_channel=True,
                         weight_type=weight_type)
    dropped.write_bytes(plain.read_bytes())
    _drop_zero_weight_zero_points(dropped)
    _drop_zero_weight_zero_points(uint8)
    x = {"x": torch.randn(5, 8).numpy()}
    runs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, x)[0] for p in (plain, dropped)]
    assert (runs[0] == runs[1]).all()
    def points(path: Path) -> int:
        return sum(len(n.input) == 4 for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulInteger")

    assert points(plain) > 0 and points(dropped) == 0 and points(uint8) == points(plain)


def test_int8_is_rejected_where_it_should_not_run() -> None:
    _, rows = _tune_int8(Outlier(), (32,), FidelityConfig(check_non_finite=False))
    assert [r.status for r in rows] == ["rejected", "chosen"] and rows[0].precision == "int8"
    assert rows[0].error.startswith("FidelityError") and "tolerance for int8" in rows[0].error
    wide = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    _, rows = _tune_int8(wide, (16, 64))  # one activation scale per tensor: a NaN row comes back finite
    guarded = "non-finite guard" in rows[0].backend  # kept only behind a guard that runs NaN/inf calls eagerly
    assert (rows[0].status == "chosen" and guarded) or (rows[0].status == "rejected" and "NaN" in rows[0].error)


# checkpoints -----------------------------------------------------------------------------------


def test_save_and_load_in_a_fresh_process_without_exporting(tmp_path: Path) -> None:
    from checkpoint_child import build as child_model
    from test_checkpoint import run_fresh

    wrapped = tt.Module(child_model("cnn"), name="cnn", strategy=tt.OneBackendStrategy(ONNXRuntimeBackend()))
    tt.tune(wrapped, [torch.randn(3, 8, 8) for _ in range(2)], batch_sizes=[1, 2])
    inputs = [torch.randn(2, 3, 8, 8), torch.randn(5, 3, 8, 8)]  # batch 5 was never recorded
    expected = [wrapped(x) for x in inputs]
    tt.save(wrapped, tmp_path / "m.tt")
    outputs, info = run_fresh("cnn", tmp_path / "m.tt", inputs, tmp_path)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert info["states"] == {"cnn": "TUNED"} and info["backends"] == {"cnn": ["ONNXRuntimeBackend"]}
    assert sum(info["compiles"].values()) == 0 and info["dynamo_frames"] == 0  # torch.onnx exports via torch.export


def test_a_build_reuses_the_model_exported_from_the_same_weights_and_exports_again_after_a_change(tmp_path, caplog):
    first, spec, samples, model = build("mlp", tmp_path)
    onnx_file = tmp_path / "onnxruntime" / "model.onnx"
    exported_at = onnx_file.stat().st_mtime_ns
    with caplog.at_level("INFO", logger="torch_tweak"):
        again = ONNXRuntimeBackend()
        again.build(model, spec, [s.sample for s in samples], CPU, tmp_path)  # the chosen one, built again
    assert onnx_file.stat().st_mtime_ns == exported_at and "Reusing the ONNX model" in caplog.text
    x = samples[0].sample[0][0]
    torch.testing.assert_close(again.infer(x), first.infer(x))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # other weights: the stored model no longer fits
    changed = ONNXRuntimeBackend()
    changed.build(model, spec, [s.sample for s in samples], CPU, tmp_path)
    assert onnx_file.stat().st_mtime_ns != exported_at
    torch.testing.assert_close(changed.infer(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_twin_that_differs_in_threads_only_shares_the_outputs_key_and_copies_the_exported_model(tmp_path, caplog):
    def outputs_key(**fields) -> str | None:
        return ONNXRuntimeBackend(ONNXRuntimeBackendConfig(**fields)).outputs_key()

    assert outputs_key() == outputs_key(intra_op_num_threads=1) == outputs_key(execution_mode="parallel")
    assert outputs_key() != outputs_key(quantization="int8_dynamic")
    assert outputs_key() != outputs_key(graph_optimization_level="basic")
    first, spec, samples, model = build("mlp", tmp_path / "graph" / "ONNXRuntimeBackend_a")
    twin = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(intra_op_num_threads=1))
    with caplog.at_level("INFO", logger="torch_tweak"):
        twin.build(model, spec, [s.sample for s in samples], CPU, tmp_path / "graph" / "ONNXRuntimeBackend_b")
    assert "Reusing the ONNX model of" in caplog.text and twin._session.threads == 1
    copied = tmp_path / "graph" / "ONNXRuntimeBackend_b" / "onnxruntime" / "model.onnx"
    assert copied.read_bytes() == (tmp_path / "graph" / "ONNXRuntimeBackend_a" / "onnxruntime" / "model.onnx").read_bytes()
    for sample in samples:
        assert_close(twin.infer(*sample.args), sample.outputs)
    other = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(graph_optimization_level="basic"))  # another model: exported
    caplog.clear()
    with caplog.at_level("INFO", logger="torch_tweak"):
        other.build(model, spec, [s.sample for s in samples], CPU, tmp_path / "graph" / "ONNXRuntimeBackend_c")
    assert "Reusing" not in caplog.text


def test_int8_quantizes_the_float_candidates_export_instead_of_exporting_again(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("onnx")
    from torch_tweak.torch.backend import onnxruntime as ort_backend

    first, spec, samples, model = build("mlp", tmp_path / "graph" / "ONNXRuntimeBackend_a")
    exports: list[Path] = []
    real = ort_backend.export_onnx
    monkeypatch.setattr(ort_backend, "export_onnx", lambda *a: exports.append(a[3]) or real(*a))
    int8 = ONNXRuntimeBackend(INT8)
    with caplog.at_level("INFO", logger="torch_tweak"):
        int8.build(model, spec, [s.sample for s in samples], CPU, tmp_path / "graph" / "ONNXRuntimeBackend_b")
    assert exports == [] and "Quantizing the ONNX model of" in caplog.text
    float_file = tmp_path / "graph" / "ONNXRuntimeBackend_a" / "onnxruntime" / "model.onnx"
    assert float_file.is_file() and int8.to_dict()["onnx_model"].read_bytes() != float_file.read_bytes()
    assert not (tmp_path / "graph" / "ONNXRuntimeBackend_b" / "exported.onnx").exists()
    for sample in samples:
        assert_close(int8.infer(*sample.args), sample.outputs, atol=0.1)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # other weights: the float model no longer fits, so the graph is exported
    ONNXRuntimeBackend(INT8).build(model, spec, [s.sample for s in samples], CPU, tmp_path / "graph" / "ONNXRuntimeBackend_c")
    assert len(exports) == 1 and not (tmp_path / "graph" / "ONNXRuntimeBackend_c" / "exported.onnx").exists()


def test_a_twin_whose_model_cannot_be_copied_exports_its_own(tmp_path: Path, caplog) -> None:
    from torch_tweak.torch.backend._artifact_reuse import copy_files

    source = tmp_path / "files"
    source.mkdir()
    (source / "model.onnx").write_bytes(b"graph")
    assert copy_files(source, tmp_path / "whole", ["model.onnx"])
    assert (tmp_path / "whole" / "model.onnx").read_bytes() == b"graph"
    assert not copy_files(source, tmp_path / "part", ["model.onnx", "model.onnx.data"])  # the second is missing
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "part").iterdir())
    first, spec, samples, model = build("mlp", tmp_path / "graph" / "ONNXRuntimeBackend_a")
    (tmp_path / "graph" / "ONNXRuntimeBackend_a" / "onnxruntime" / "model.onnx").unlink()  # its fingerprint stays
    twin = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(intra_op_num_threads=1))
    with caplog.at_level("INFO", logger="torch_tweak"):
        twin.build(model, spec, [s.sample for s in samples], CPU, tmp_path / "graph" / "ONNXRuntimeBackend_b")
    assert "Reusing" not in caplog.text
    for sample in samples:
        assert_close(twin.infer(*sample.args), sample.outputs)


def test_quantizing_leaves_the_applications_logging_as_it_was(tmp_path: Path) -> None:
    """onnxruntime.quantization's advice to its own users stays out of the application's log; its root logger keeps
    its handlers and filters."""
    import logging

    pytest.importorskip("onnx")
    root = logging.getLogger()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    root.addHandler(handler)
    handlers, filters = list(root.handlers), list(root.filters)
    try:
        build("mlp", tmp_path, INT8)
        logging.getLogger("somewhere.else").warning("an application's own warning")
    finally:
        root.removeHandler(handler)
    assert list(root.handlers) == [h for h in handlers if h is not handler] and list(root.filters) == filters
    assert not [r for r in records if "pre-processing" in r.getMessage()]
    assert [r.getMessage() for r in records if r.name == "somewhere.else"] == ["an application's own warning"]


@pytest.mark.parametrize("saturates", [True, False])
def test_int8_weights_take_seven_bits_where_int8_kernels_saturate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  saturates: bool) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    from torch_tweak.torch import environment

    monkeypatch.setattr(environment, "int8_dot_saturates", lambda: saturates)
    backend, _, _, _ = build("mlp", tmp_path, INT8)
    graph = onnx.load(str(backend.to_dict()["onnx_model"])).graph
    weights = [numpy_helper.to_array(t) for t in graph.initializer if t.data_type == onnx.TensorProto.INT8]
    largest = max(int(abs(w.astype("int32")).max()) for w in weights)
    assert largest <= 64 if saturates else largest == 127


def test_openvino_and_onnxruntime_convert_one_export_of_a_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.export runs once per graph and process: ONNX Runtime converts the program OpenVINO converted."""
    pytest.importorskip("openvino")
    from torch_tweak.torch.backend.openvino import OpenVINOBackend, OpenVINOBackendConfig

    exports: list[object] = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(a) or real(*a, **k))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    ((spec, samples),) = record(model, [(b, ((torch.randn(b, 4),), {})) for b in (1, 3)])
    data = [s.sample for s in samples]
    # f32: on CPUs with AVX-512 BF16 or AMX, OpenVINO's default precision is bf16, far outside these tolerances
    ov = OpenVINOBackend(OpenVINOBackendConfig(inference_precision="f32")).build(model, spec, data, CPU, tmp_path / "ov")
    ort = ONNXRuntimeBackend().build(model, spec, data, CPU, tmp_path / "ort")
    assert len(exports) == 1
    x = torch.randn(5, 4)  # a batch size neither export saw
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(ort.infer(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ov.infer(x), expected, atol=1e-4, rtol=1e-4)
