"""TorchAOBackend: quantize + compile on recorded graphs, quantize once, safe config round trips, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import torch_tweak.torch as tt
from torch_tweak.errors import BackendStateError, BuildError, ConfigError
from torch_tweak.torch.backend import _warm_package
from torch_tweak.torch.backend.backend import BackendState
from torch_tweak.torch.backend.torchao import PRESETS, TorchAOBackend, TorchAOBackendConfig
from torch_tweak.torch.module.recording import record

pytest.importorskip("torchao")
pytestmark = pytest.mark.torchao
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "torch_tweak_test_inductor"))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Convolutions stay fp32; only the classifier head is an nn.Linear torchao can quantize."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


class Encoder(nn.Module):
    """A tiny linear-heavy attention block (no nn.TransformerEncoder fast path, which breaks graphs)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(50, 32), nn.LayerNorm(32)
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)
        self.ffn = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(input_ids)
        b, t, _ = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = attention_mask[:, None, None, :].bool()
        attn = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.out(attn.transpose(1, 2).reshape(b, t, 32))
        return {"last_hidden_state": h + self.ffn(h)}


def text(batch: int, seq: int) -> tuple[int, tuple[tuple, dict]]:
    ids = torch.randint(1, 50, (batch, seq))
    return batch, ((), {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long)})


def build(model: nn.Module, calls: list, tmp: Path, config: TorchAOBackendConfig | None = None):
    [(spec, samples)] = record(model, calls)
    backend = TorchAOBackend(config)
    backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"), tmp)
    return backend, spec, samples


def assert_similar(actual, expected) -> None:
    """Quantized outputs: cosine similarity of the flattened outputs >= 0.99, same structure and dtypes."""
    if isinstance(expected, dict):
        assert set(actual) == set(expected)
        for key in expected:
            assert_similar(actual[key], expected[key])
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert nn.functional.cosine_similarity(actual.flatten(), expected.flatten(), dim=0) >= 0.99


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    torch.manual_seed(0)
    model = MLP().eval()
    calls = [(b, ((torch.randn(b, 64),), {})) for b in (2, 4)]
    return (model, *build(model, calls, tmp_path_factory.mktemp("mlp")))


def test_default_int8dq_mlp_and_unseen_batch(mlp):
    model, backend, _, samples = mlp
    assert backend.describe() == "TorchAOBackend()" and backend._config.quantization == "int8dq"
    assert backend.executed_precision == "int8"
    assert type(backend._quantized.net[0].weight) is not nn.Parameter
    assert type(model.net[0].weight) is nn.Parameter  # the original module is untouched
    for s in samples:
        assert_similar(backend.infer(*s.args), s.outputs)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert_similar(backend.infer(x), model(x))


def test_build_leaves_global_compiler_settings_alone(tmp_path):
    from torch._inductor import config as inductor_config

    before, precision = inductor_config.get_config_copy(), torch.get_float32_matmul_precision()
    backend = TorchAOBackend(TorchAOBackendConfig("int8wo"))
    # quantization only: keep the test cheap (no compile)
    backend._module, backend._graph_spec = MLP().eval(), record(MLP(), [(1, ((torch.randn(1, 64),), {}))])[0][0]
    backend._quantize()
    assert inductor_config.get_config_copy() == before and torch.get_float32_matmul_precision() == precision
    assert backend._compile_options.get("force_fuse_int_mm_with_mul") is True  # kept for this backend's compile


def test_cnn_int8wo(tmp_path):
    torch.manual_seed(0)
    model = CNN().eval()
    calls = [(b, ((torch.randn(b, 3, 12, 12),), {})) for b in (1, 2)]
    backend, _, samples = build(model, calls, tmp_path, TorchAOBackendConfig(quantization="int8wo"))
    for s in samples:
        assert_similar(backend.infer(*s.args), s.outputs)
    x = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        assert_similar(backend.infer(x), model(x))


def test_encoder_dynamic_batch_and_sequence(tmp_path):
    torch.manual_seed(0)
    model = Encoder().eval()
    backend, spec, samples = build(model, [text(2, 5), text(4, 5), text(2, 9)], tmp_path)
    assert spec.inputs[0].shape == ("batch0", "dim1")
    for s in samples:
        assert_similar(backend.infer(*s.args, **s.kwargs), s.outputs)
    _, (args, kwargs) = text(3, 7)
    with torch.no_grad():
        assert_similar(backend.infer(*args, **kwargs), model(*args, **kwargs))


def test_activate_does_not_quantize_again(mlp, monkeypatch):
    import torchao.quantization

    _, backend, _, samples = mlp
    backend.deactivate()
    assert backend.state == BackendState.INACTIVE
    with pytest.raises(BackendStateError):
        backend.infer(*samples[0].args)

    def no_quantize(*args, **kwargs):
        raise AssertionError("activate must not quantize again")

    monkeypatch.setattr(torchao.quantization, "quantize_", no_quantize)
    backend.activate()
    assert_similar(backend.infer(*samples[0].args), samples[0].outputs)


def test_to_dict_from_dict_round_trip(mlp):
    model, backend, _, samples = mlp
    state = backend.to_dict()
    package = state.pop(_warm_package.STATE_PACKAGE)  # the warm-load package of the quantized graph: a file
    assert isinstance(package, Path) and package.is_file()
    state = json.loads(json.dumps(state))  # otherwise JSON only: no tensors, no artifacts, no samples
    assert state["config"] == {"quantization": "int8dq", "quantization_config": None}
    for stored in (package, None):  # served from the package, or quantized and compiled again without it
        restored = TorchAOBackend.from_dict(model, {**state, _warm_package.STATE_PACKAGE: stored})
        assert restored.state == BackendState.CHECKPOINT_LOADED and restored.key() == backend.key()
        restored.deploy("cpu")
        assert restored.state == BackendState.DEPLOYED
        assert (restored._quantized is None) is (stored is not None)  # the package needs no quantized copy
        for s in samples:
            assert_similar(restored.infer(*s.args), s.outputs)
    with pytest.raises(ValueError, match="Invalid state_dict type: TorchEagerBackend"):
        TorchAOBackend.from_dict(model, {**state, "type": "TorchEagerBackend"})
    with pytest.raises(ValueError, match="original module"):
        TorchAOBackend.from_dict(None, state)
    with pytest.raises(RuntimeError, match="Please call build\\(\\) first"):
        TorchAOBackend().to_dict()


def test_config_object_round_trip_through_the_allowlist():
    from torchao.quantization import Int8WeightOnlyConfig, PerRow

    config = TorchAOBackendConfig(quantization_config=Int8WeightOnlyConfig(granularity=PerRow()))
    payload = json.loads(json.dumps(config.to_dict()))
    restored = TorchAOBackendConfig.from_dict(payload)
    assert restored == config and restored.key() == config.key()
    assert TorchAOBackend(restored).describe().startswith("TorchAOBackend(quantization_config=Int8WeightOnlyConfig(")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"_type": "AOPerModuleConfig", "_data": {}}, "not supported"),
        ({"_type": "Int8WeightOnlyConfig", "_data": {"granularity": {"_type": "Path", "_data": "/"}}}, "'Path'"),
        ({"_type": "Float8WeightOnlyConfig", "_data": {"weight_dtype": {"_type": "torch.dtype", "_data": "load"}}},
         "unknown dtype"),
        ({"_data": {}}, "must be a dict with '_type'"),
    ],
)
def test_unsafe_or_unknown_config_payloads_are_refused(payload, message):
    with pytest.raises(ConfigError, match=message):
        TorchAOBackendConfig.from_dict({"quantization": None, "quantization_config": payload})


def test_config_validation():
    from torchao.quantization import Int8WeightOnlyConfig

    with pytest.raises(ConfigError, match="both given"):
        TorchAOBackendConfig(quantization="int8wo", quantization_config=Int8WeightOnlyConfig())
    with pytest.raises(ConfigError, match=r"valid presets: \['fp8dq', 'fp8wo', 'int8dq', 'int8wo'\]"):
        TorchAOBackendConfig(quantization="int3")
    with pytest.raises(ConfigError, match="AOBaseConfig"):
        TorchAOBackendConfig(quantization_config=object())
    assert set(PRESETS) >= {"int8wo", "int8dq"}
    assert TorchAOBackendConfig().quantization == "int8dq" and TorchAOBackendConfig() == TorchAOBackendConfig("int8dq")


def test_config_that_applies_to_no_layer_is_a_build_error(tmp_path):
    convs = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    calls = [(b, ((torch.randn(b, 3, 8, 8),), {})) for b in (1, 2)]
    with pytest.raises(BuildError, match="applied to no layer"):
        build(convs, calls, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_fp8_dynamic_on_cpu_is_a_clear_error(tmp_path):
    calls = [(b, ((torch.randn(b, 64),), {})) for b in (1, 2)]
    with pytest.raises(BuildError, match="float8 quantization needs hardware .* use quantization='int8dq'") as info:
        build(MLP().eval(), calls, tmp_path, TorchAOBackendConfig("fp8dq"))
    assert info.value.log_path == str(tmp_path / "build.log")


def test_importing_the_backend_does_not_import_torchao():
    code = "import sys, torch_tweak.torch.backend.torchao as m; m.TorchAOBackendConfig(); print('torchao' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


def test_tune_with_one_backend_strategy():
    torch.manual_seed(0)
    reference = MLP().eval()
    inner = MLP().eval()
    inner.load_state_dict(reference.state_dict())
    model = tt.Module(inner, name="mlp", strategy=tt.OneBackendStrategy(TorchAOBackend()))
    width = reference.net[0].in_features
    report = tt.tune(model, [torch.randn(width) for _ in range(4)], batch_sizes=[1, 4], ignore_failing_modules=False)
    assert report.module("mlp").status == "tuned"
    assert report.module("mlp").graphs[0].chosen.startswith("TorchAOBackend")
    x = torch.randn(3, width)
    with torch.no_grad():
        assert_similar(model(x), reference(x))
