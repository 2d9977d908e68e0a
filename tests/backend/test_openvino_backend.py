"""OpenVINOBackend: config, state machine, conversion paths, inference fidelity and bad inputs."""

from __future__ import annotations

import collections
import gc
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("openvino")

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
from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig  # noqa: E402
from torch_tweak.torch.backend.backend import BackendState  # noqa: E402
from torch_tweak.torch.module.recording import record  # noqa: E402

pytestmark = pytest.mark.openvino
CPU = torch.device("cpu")
F32 = {"inference_precision": "f32"}
Scores = collections.namedtuple("Scores", ["logits", "total"])


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4, 3),
    ).eval()


class KwargsModel(nn.Module):
    """Tensor kwarg, None kwarg and float kwarg; dict output holding a namedtuple and a string."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                scale: float = 1.0) -> dict:
        y = self.lin(x) * scale
        if mask is not None:
            y = y * mask
        if bias is not None:
            y = y + bias
        return {"scores": Scores(y, y.sum(dim=-1)), "tag": "ok", "ids": x.argmax(dim=-1)}


class Encoder(nn.Module):
    """nn.TransformerEncoder with batch_first and a variable sequence length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


class DataDependent(nn.Module):
    """A branch on a tensor value: torch.export cannot capture it, tracing bakes the branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


def kwargs_calls() -> list:
    def call(b: int) -> tuple:
        return b, ((torch.randn(b, 6),), {"mask": torch.rand(b, 6), "bias": None, "scale": 2.0})

    return [call(b) for b in (1, 2, 4)]


MODELS = {
    "mlp": (mlp, lambda: [(b, ((torch.randn(b, 8),), {})) for b in (1, 2, 8)]),
    "cnn": (cnn, lambda: [(b, ((torch.randn(b, 3, 8, 8),), {})) for b in (1, 3)]),
    "kwargs": (KwargsModel, kwargs_calls),
    "encoder": (Encoder, lambda: [(b, ((torch.randn(b, s, 16),), {})) for b, s in ((1, 5), (2, 9), (3, 7))]),
    # a pad position's query row sees no key: eager returns zeros there, OpenVINO's attention NaN unless rewritten
    "padded_attention": (PaddedCausalAttention, lambda: [(b, left_padded_call(b, s)) for b, s in ((2, 6), (3, 8))]),
    "padded_additive": (lambda: PaddedCausalAttention(additive=True),
                        lambda: [(b, left_padded_call(b, s)) for b, s in ((2, 6), (3, 8))]),
}


def build(name: str, tmp_path: Path, **config) -> tuple[OpenVINOBackend, tt.GraphSpec, list, nn.Module]:
    factory, calls = MODELS[name]
    model = factory()
    torch.manual_seed(1)
    with torch.no_grad():
        ((spec, samples),) = record(model, calls())
        backend = OpenVINOBackend(OpenVINOBackendConfig(**config))
        backend.build(model, spec, [s.sample for s in samples], CPU, tmp_path / "cache")
    return backend, spec, samples, model


def assert_close(actual, expected, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_close(actual[key], expected[key], atol, rtol)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_close(a, e, atol, rtol)
    else:
        assert actual == expected


# config ----------------------------------------------------------------------------------------


def test_import_and_config_do_not_import_openvino() -> None:
    code = (
        "import sys; from torch_tweak.torch.backend.openvino import OpenVINOBackend, OpenVINOBackendConfig;"
        "OpenVINOBackend(OpenVINOBackendConfig(performance_hint='THROUGHPUT')).describe();"
        "assert 'openvino' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_defaults_describe_key_round_trip() -> None:
    default = OpenVINOBackendConfig()
    assert (default.use_dynamo, default.performance_hint, default.inference_precision) == (True, "LATENCY", None)
    assert OpenVINOBackend().describe() == "OpenVINOBackend()"
    backend = OpenVINOBackend(OpenVINOBackendConfig(use_dynamo=False, performance_hint="THROUGHPUT"))
    assert backend.describe() == "OpenVINOBackend(use_dynamo=False,performance_hint=THROUGHPUT)"
    assert backend.key() == f"OpenVINOBackend_{backend._config.key()}"
    assert backend.key() != OpenVINOBackend().key()
    config = OpenVINOBackendConfig(performance_hint="cumulative_throughput", inference_precision="FP32")
    assert (config.performance_hint, config.inference_precision) == ("CUMULATIVE_THROUGHPUT", "f32")
    assert OpenVINOBackendConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert OpenVINOBackend(config).device is None and not OpenVINOBackend(config).is_active


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"performance_hint": "FAST"}, "LATENCY"),
        ({"performance_hint": None}, "THROUGHPUT"),
        ({"use_dynamo": "yes"}, "use_dynamo"),
        ({"inference_precision": "int8"}, "'bf16'"),
        ({"num_threads": 0}, "num_threads must be"),
        ({"num_threads": True}, "num_threads must be"),
        ({"num_threads": "1"}, "num_threads must be"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OpenVINOBackendConfig(**kwargs)


def test_config_from_dict_refuses_unknown_fields() -> None:
    with pytest.raises(ConfigError, match="num_streams"):
        OpenVINOBackendConfig.from_dict({"num_streams": 4})


# state machine ---------------------------------------------------------------------------------


def test_state_machine_before_build() -> None:
    backend = OpenVINOBackend()
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
    backend, spec, samples, _ = build("mlp", tmp_path, **F32)
    x = samples[0].args[0]
    assert backend.state == BackendState.ACTIVE and backend.is_active and backend.device == CPU
    with pytest.raises(BackendStateError, match="build should be called only once"):
        backend.build(mlp(), spec, [], CPU, tmp_path / "other")
    with pytest.raises(BackendStateError, match="should be loaded from a checkpoint"):
        backend.deploy(CPU)
    backend.deactivate()
    assert backend.state == BackendState.INACTIVE and not backend.is_active
    with pytest.raises(BackendStateError, match="should be activated first"):
        backend.infer(x)
    backend.activate()
    assert backend.state == BackendState.ACTIVE
    assert_close(backend.infer(x), samples[0].outputs)

    state = backend.to_dict()
    assert isinstance(state[OpenVINOBackend.STATE_OV_MODEL_DIR], Path)
    json.dumps({k: v for k, v in state.items() if not isinstance(v, Path)})
    assert state[OpenVINOBackend.STATE_DEVICE] == "cpu"
    loaded = OpenVINOBackend.from_dict(None, state)
    assert loaded.state == BackendState.CHECKPOINT_LOADED and loaded.describe() == backend.describe()
    with pytest.raises(BackendStateError, match="has already been deployed"):
        loaded.deactivate()
    with pytest.raises(BackendStateError, match="should be activated first"):
        loaded.infer(x)
    loaded.deploy(None)
    assert loaded.state == BackendState.DEPLOYED and loaded.device == CPU
    assert_close(loaded.infer(x), samples[0].outputs)
    for method in (loaded.activate, loaded.deactivate):
        with pytest.raises(BackendStateError, match="already deployed"):
            method()
    again = OpenVINOBackend.from_dict(None, state)
    again.activate()
    assert again.state == BackendState.ACTIVE
    assert_close(again.infer(x), samples[0].outputs)


def test_from_dict_errors(tmp_path: Path) -> None:
    backend, _, samples, _ = build("mlp", tmp_path, **F32)
    state = backend.to_dict()
    with pytest.raises(ValueError, match="Invalid state_dict type: TorchEagerBackend"):
        OpenVINOBackend.from_dict(None, {**state, "type": "TorchEagerBackend"})
    with pytest.raises(ValueError, match=r"Checkpoint is missing OpenVINO model path \(ov_model_dir\)."):
        OpenVINOBackend.from_dict(None, {k: v for k, v in state.items() if k != OpenVINOBackend.STATE_OV_MODEL_DIR})
    with pytest.raises(CheckpointError, match="lacks model.xml"):
        OpenVINOBackend.from_dict(None, {**state, OpenVINOBackend.STATE_OV_MODEL_DIR: tmp_path / "nowhere"})

    ir_dir = state[OpenVINOBackend.STATE_OV_MODEL_DIR]
    (ir_dir / "model.xml").write_text("<net><garbage", encoding="utf-8")
    corrupt = OpenVINOBackend.from_dict(None, state)
    with pytest.raises(CheckpointError, match="corrupt"):
        corrupt.deploy(CPU)
    backend.deactivate()
    with pytest.raises(CheckpointError, match="corrupt"):
        backend.activate()
    (ir_dir / "model.bin").unlink()
    with pytest.raises(CheckpointError, match="lacks model.bin"):
        OpenVINOBackend.from_dict(None, state)


# conversion and fidelity -----------------------------------------------------------------------


@pytest.mark.parametrize("use_dynamo", [True, False], ids=["export", "trace"])
@pytest.mark.parametrize("name", list(MODELS))
def test_build_and_infer_match_eager(name: str, use_dynamo: bool, tmp_path: Path) -> None:
    backend, spec, samples, model = build(name, tmp_path, use_dynamo=use_dynamo, **F32)
    assert backend.executed_precision == "fp32"
    xml = tmp_path / "cache" / "openvino" / "model.xml"
    assert xml.is_file() and (xml.parent / "model.bin").is_file()
    for sample in samples:
        assert_close(backend.infer(*sample.args, **sample.kwargs), sample.outputs)
    # a batch size (and sequence length) not seen while recording but inside the tuned range
    args, kwargs = spec.example_inputs(batch_size=spec.batch_range()[1] - 1)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    assert_close(backend.infer(*args, **kwargs), expected)


def test_kwargs_model_names_and_structure(tmp_path: Path) -> None:
    backend, spec, samples, _ = build("kwargs", tmp_path, **F32)
    out = backend.infer(*samples[1].args, **samples[1].kwargs)
    assert isinstance(out["scores"], Scores) and out["tag"] == "ok" and out["ids"].dtype == torch.int64
    import openvino as ov

    model = ov.Core().read_model(tmp_path / "cache" / "openvino" / "model.xml")
    assert [p.get_any_name() for p in model.inputs] == ["args_0", "kwargs_mask"]
    assert [p.get_any_name() for p in model.outputs] == [t.name for t in spec.outputs]
    with pytest.raises(UnsupportedInputError, match="does not match graph"):
        backend.infer(*samples[1].args, mask=samples[1].kwargs["mask"], bias=None, scale=3.0)


@pytest.mark.parametrize("hint", ["LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT"])
@pytest.mark.parametrize("use_dynamo", [True, False], ids=["export", "trace"])
def test_performance_hints(hint: str, use_dynamo: bool, tmp_path: Path) -> None:
    backend, _, samples, _ = build("mlp", tmp_path, use_dynamo=use_dynamo, performance_hint=hint, **F32)
    assert backend._compiled_model.get_property("PERFORMANCE_HINT") == hint
    for sample in samples:
        assert_close(backend.infer(*sample.args), sample.outputs)


def test_one_thread_shares_the_ir_of_its_every_core_twin_and_compiles_it_for_one_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one = OpenVINOBackendConfig(num_threads=1, **F32)
    assert OpenVINOBackend(one).describe() == "OpenVINOBackend(inference_precision=f32,num_threads=1)"
    assert OpenVINOBackend(one).outputs_key() == OpenVINOBackend(OpenVINOBackendConfig(**F32)).outputs_key()
    assert OpenVINOBackend(one).key() != OpenVINOBackend(OpenVINOBackendConfig(**F32)).key()
    model = mlp()
    ((spec, samples),) = record(model, MODELS["mlp"][1]())
    all_cores = OpenVINOBackend(OpenVINOBackendConfig(**F32))
    all_cores.build(model, spec, [s.sample for s in samples], CPU, tmp_path / "OpenVINOBackend_a")
    from torch_tweak.torch.backend.openvino import converter

    def fail(*args, **kwargs):
        raise AssertionError("the sibling's IR should have been copied")

    monkeypatch.setattr(converter, "to_ov_model", fail)
    backend = OpenVINOBackend(one)
    backend.build(model, spec, [s.sample for s in samples], CPU, tmp_path / "OpenVINOBackend_b")
    weights = [tmp_path / f"OpenVINOBackend_{c}" / "openvino" / "model.bin" for c in "ab"]
    assert weights[0].stat().st_ino == weights[1].stat().st_ino  # linked, not copied (one file system here)
    assert int(backend._compiled_model.get_property("INFERENCE_NUM_THREADS")) == 1
    assert int(all_cores._compiled_model.get_property("INFERENCE_NUM_THREADS")) != 1
    for sample in samples:
        assert_close(backend.infer(*sample.args), sample.outputs)
    loaded = OpenVINOBackend.from_dict(None, json.loads(json.dumps(backend.to_dict(), default=str)))
    loaded.deploy(CPU)
    assert loaded._config == one and int(loaded._compiled_model.get_property("INFERENCE_NUM_THREADS")) == 1
    assert_close(loaded.infer(*samples[0].args), samples[0].outputs)


def test_one_thread_is_refused_on_xpu_before_converting(tmp_path: Path) -> None:
    ((spec, samples),) = record(mlp(), MODELS["mlp"][1]())
    with pytest.raises(UnsupportedDeviceError, match=r"OpenVINOBackend\(num_threads=1\) sets the threads of "
                                                     r"OpenVINO's CPU plugin, so it runs on cpu only, not on xpu:0"):
        OpenVINOBackend(OpenVINOBackendConfig(num_threads=1)).build(mlp(), spec, [s.sample for s in samples],
                                                                    "xpu:0", tmp_path)
    assert not (tmp_path / "openvino").exists()


def test_release_scratch_frees_buffers_and_the_next_call_allocates_again(tmp_path: Path) -> None:
    backend, _, samples, _ = build("mlp", tmp_path, performance_hint="THROUGHPUT", **F32)
    for sample in samples:
        backend.infer(*sample.args)
    backend.release_scratch()
    for sample in samples:  # same results at every size after the buffers were released
        assert_close(backend.infer(*sample.args), sample.outputs)
    backend.deactivate()
    backend.release_scratch()  # nothing compiled: nothing to free, no error


def test_reactivating_a_build_compiles_from_its_own_blobs_and_a_loaded_ir_from_the_cache(tmp_path: Path) -> None:
    factory, calls = MODELS["mlp"]
    model = factory()
    with torch.no_grad():
        ((spec, samples),) = record(model, calls())
    backend = OpenVINOBackend(OpenVINOBackendConfig(**F32))
    backend.build(model, spec, [s.sample for s in samples], CPU, tmp_path / "build" / "candidate")
    assert backend.reactivates_quickly()
    own_blobs, cached_blobs = tmp_path / "build" / "candidate" / "openvino_model_cache", tt.config.cache_dir / "openvino_model_cache"
    blobs = sorted(own_blobs.iterdir())
    backend.deactivate()
    backend.activate()  # a strategy set it aside; its blob beside the IR serves, nothing lands in the user's cache
    assert_close(backend.infer(*samples[0].args), samples[0].outputs)
    assert sorted(own_blobs.iterdir()) == blobs and not cached_blobs.exists()
    loaded = OpenVINOBackend.from_dict(None, backend.to_dict())
    loaded.activate()  # an IR from a checkpoint: compiled into torch_tweak's cache, never beside the IR
    assert_close(loaded.infer(*samples[0].args), samples[0].outputs)
    assert any(cached_blobs.iterdir()) and sorted(own_blobs.iterdir()) == blobs


def test_default_precision_is_reported(tmp_path: Path) -> None:
    backend, _, samples, _ = build("encoder", tmp_path)
    expected = backend._compiled_model.get_property("INFERENCE_PRECISION_HINT").to_string()
    assert backend.executed_precision == {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}[expected]
    for sample in samples:
        assert_close(backend.infer(*sample.args), sample.outputs, atol=0.1, rtol=0.05)


def test_tune_with_one_backend_strategy(tmp_path: Path) -> None:
    model = tt.Module(mlp(), name="mlp", strategy=tt.OneBackendStrategy(OpenVINOBackend(OpenVINOBackendConfig(**F32))))
    data = [torch.randn(8) for _ in range(4)]
    tt.tune(model, data, batch_sizes=[1, 4])
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = mlp()(x)
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)
    path = tt.save(model, tmp_path / "mlp.tt")
    del model
    gc.collect()
    restored = tt.load(mlp(), path)
    with torch.no_grad():
        torch.testing.assert_close(restored(x), expected, atol=1e-4, rtol=1e-4)


# inputs -----------------------------------------------------------------------------------------


def test_input_variants_and_bad_inputs(tmp_path: Path) -> None:
    backend, _, samples, model = build("mlp", tmp_path, **F32)
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    assert_close(backend.infer(x.clone().requires_grad_()), expected)
    assert_close(backend.infer(torch.empty(8, 4).t().copy_(x)), expected)  # non-contiguous
    larger = torch.randn(9, 8)  # a batch larger than any recorded one: served like eager serves it
    with torch.no_grad():
        assert_close(backend.infer(larger), model(larger))
    with pytest.raises(UnsupportedInputError, match=r"shape \[2, 7\] does not fit the graph's shape \['batch0', 8\]"):
        backend.infer(torch.randn(2, 7))
    with pytest.raises(UnsupportedInputError, match="expected dtype float32, got float64"):
        backend.infer(x.double())
    with pytest.raises(UnsupportedInputError, match="does not match graph"):
        backend.infer(x, x)


def test_concurrent_calls_are_safe(tmp_path: Path) -> None:
    backend, _, _, model = build("mlp", tmp_path, performance_hint="THROUGHPUT", **F32)
    inputs = [torch.randn(1 + i % 8, 8) for i in range(8)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(40):
                k = (i + offset) % len(inputs)
                torch.testing.assert_close(backend.infer(inputs[k]), expected[k], atol=1e-4, rtol=1e-4)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_unsupported_device(tmp_path: Path) -> None:
    _, _, calls = None, None, MODELS["mlp"][1]()
    ((spec, samples),) = record(mlp(), calls)
    with pytest.raises(UnsupportedDeviceError, match="cuda"):
        OpenVINOBackend().build(mlp(), spec, [s.sample for s in samples], "cuda:0", tmp_path)
    import openvino as ov

    if not any(d.startswith("GPU") for d in ov.Core().available_devices):
        with pytest.raises(UnsupportedDeviceError, match="GPU.1"):
            OpenVINOBackend().build(mlp(), spec, [s.sample for s in samples], "xpu:1", tmp_path / "x")


def test_export_failure_suggests_trace_path(tmp_path: Path) -> None:
    ((spec, samples),) = record(DataDependent(), [(b, ((torch.ones(b, 4),), {})) for b in (1, 2)])
    data = [s.sample for s in samples]
    with pytest.raises(ConversionError, match="use_dynamo=False") as info:
        OpenVINOBackend().build(DataDependent(), spec, data, CPU, tmp_path / "a")
    assert info.value.__cause__ is not None
    assert not (tmp_path / "a" / "openvino" / "model.xml").exists()
    traced = OpenVINOBackend(OpenVINOBackendConfig(use_dynamo=False, **F32))
    traced.build(DataDependent(), spec, data, CPU, tmp_path / "b")
    assert_close(traced.infer(torch.ones(2, 4)), torch.ones(2, 4) * 2)


def test_ir_is_reused_when_nothing_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend, spec, samples, model = build("mlp", tmp_path, **F32)
    from torch_tweak.torch.backend.openvino import converter

    def fail(*args, **kwargs):
        raise AssertionError("the IR should have been reused")

    monkeypatch.setattr(converter, "to_ov_model", fail)
    again = OpenVINOBackend(OpenVINOBackendConfig(**F32))
    again.build(model, spec, [s.sample for s in samples], CPU, tmp_path / "cache")
    assert_close(again.infer(samples[0].args[0]), samples[0].outputs)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # other weights: the IR must be rebuilt
    with pytest.raises(AssertionError, match="reused"):
        OpenVINOBackend(OpenVINOBackendConfig(**F32)).build(model, spec, [s.sample for s in samples], CPU,
                                                             tmp_path / "cache")


def test_shared_and_copied_inputs_alternate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_tweak.torch.backend.openvino import runner as openvino_runner

    backend, _, _, model = build("mlp", tmp_path, **F32)
    monkeypatch.setattr(openvino_runner, "COPY_INPUT_MAX_BYTES", 64)  # batch 1 copied, larger batches shared
    for batch in (1, 5, 1, 8, 2, 1):
        x = torch.randn(batch, 8)
        with torch.no_grad():
            expected = model(x)
        assert_close(backend.infer(x), expected)


class BatchSecond(nn.Module):
    """Batch on axis 0 of the input and axis 1 of one output: the split must concatenate on the right axes."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 3, x.transpose(0, 1) + 1


@pytest.mark.parametrize("hint", ["THROUGHPUT", "CUMULATIVE_THROUGHPUT"])
def test_throughput_hint_splits_large_batches(hint: str, tmp_path: Path) -> None:
    model = BatchSecond()
    ((spec, samples),) = record(model, [(b, ((torch.randn(b, 5),), {})) for b in (1, 2, 9)])
    backend = OpenVINOBackend(OpenVINOBackendConfig(performance_hint=hint, **F32))
    backend.build(model, spec, [s.sample for s in samples], CPU, tmp_path)
    split = backend._runner._split
    assert split >= 2  # one request per stream (2 streams on 2 cores, environment.md G17)
    for batch in (1, 2, 7, 9):
        x = torch.randn(batch, 5)
        chunks = backend._runner._chunks([x.numpy()])
        assert chunks is None if batch == 1 else (sum(chunks) == batch and len(chunks) == min(batch, split))
        assert_close(backend.infer(x), model(x))


def test_conversion_error_names_the_failing_operator() -> None:
    from torch_tweak.torch.backend.openvino.converter import _conversion_error

    cause = RuntimeError("OpConversionFailure: No conversion rule found for operations: aten::my_op, aten::other")
    error = _conversion_error("OpenVINO conversion (TorchScript trace)", cause, use_dynamo=False)
    assert isinstance(error, ConversionError)
    assert "aten::my_op, aten::other" in str(error) and "use_dynamo=False" not in str(error)
    assert "use_dynamo=False" in str(_conversion_error("torch.export", ValueError("boom"), use_dynamo=True))
