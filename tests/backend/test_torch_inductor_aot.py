"""TorchInductorAOTBackend: export + package + load, dynamic shapes, loading without recompiling, bad input."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch._inductor
from torch import nn
from toy_models import BnCNN

import torch_tweak.torch as tt
from torch_tweak.errors import BackendStateError, ConfigError, ConversionError, UnsupportedDeviceError
from torch_tweak.torch.backend.backend import BackendState
from torch_tweak.torch.backend.torch_inductor_aot import TorchInductorAOTBackend, TorchInductorAOTBackendConfig
from torch_tweak.torch.module.recording import record

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "torch_tweak_test_inductor"))

Logits = namedtuple("Logits", ["logits", "features"])


class MLP(nn.Module):
    """Keyword argument with a Python float (bound into the package) and a namedtuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> Logits:
        features = torch.relu(self.fc1(x)) * scale
        return Logits(self.fc2(features), features)


class Encoder(nn.Module):
    """A tiny attention block taking one dict argument and returning a dict (ids and mask share the seq axis)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(50, 16), nn.LayerNorm(16)
        self.qkv, self.out, self.pool = nn.Linear(16, 48), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = self.emb(batch["input_ids"])
        b, t, _ = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = batch["attention_mask"][:, None, None, :].bool()
        attn = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.out(attn.transpose(1, 2).reshape(b, t, 16))
        return {"last_hidden_state": h, "pooled": self.pool(h.mean(1))}


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # torch.export cannot capture a branch on tensor values
            return x * 2
        return x - 1


def text(batch: int, seq: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, 50, (batch, seq)), "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


def build(model: nn.Module, calls: list, tmp: Path, config: TorchInductorAOTBackendConfig | None = None):
    [(spec, samples)] = record(model, calls)
    backend = TorchInductorAOTBackend(config)
    backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"), tmp)
    return backend, spec, samples


def assert_close(actual, expected) -> None:
    assert type(actual) is type(expected)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    torch.manual_seed(0)
    model = MLP().eval()
    calls = [(b, ((torch.randn(b, 16),), {"scale": 2.0})) for b in (1, 4)]
    return (model, *build(model, calls, tmp_path_factory.mktemp("mlp")))


def test_mlp_package_matches_eager_at_unseen_batch(mlp):
    model, backend, spec, samples = mlp
    assert backend.state == BackendState.ACTIVE and not backend.requires_original_module
    assert backend.executed_precision == "fp32"
    for s in samples:
        assert_close(backend.infer(*s.args, **s.kwargs), s.outputs)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert_close(backend.infer(x, scale=2.0), model(x, scale=2.0))


def test_cnn_matches_eager(tmp_path):
    torch.manual_seed(0)
    model = BnCNN().eval()
    calls = [(b, ((torch.randn(b, 3, 12, 12),), {})) for b in (2, 4)]
    backend, _, samples = build(model, calls, tmp_path)
    assert (tmp_path / "model.pt2").is_file()
    for s in samples:
        assert_close(backend.infer(*s.args), s.outputs)
    x = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        assert_close(backend.infer(x), model(x))


def test_encoder_dict_io_dynamic_batch_and_sequence(tmp_path):
    torch.manual_seed(0)
    model = Encoder().eval()
    calls = [(2, ((text(2, 5),), {})), (4, ((text(4, 5),), {})), (2, ((text(2, 9),), {}))]
    backend, spec, samples = build(model, calls, tmp_path)
    assert spec.inputs[0].shape == ("batch0", "dim1")
    for s in samples:
        assert_close(backend.infer(*s.args), s.outputs)
    batch = text(3, 7)
    with torch.no_grad():
        assert_close(backend.infer(batch), model(batch))


def test_round_trip_loads_the_package_without_compiling(mlp, tmp_path, monkeypatch):
    model, backend, _, samples = mlp
    state = backend.to_dict()
    assert isinstance(state["package"], Path) and state["package"].name == "model.pt2"
    json.dumps({k: v for k, v in state.items() if k != "package"})
    assert "samples" not in str(state)
    # simulate the checkpoint layer: copy the artifact elsewhere and give from_dict the extracted path
    extracted = shutil.copy(state["package"], tmp_path / "extracted.pt2")
    restored_state = {**json.loads(json.dumps({k: v for k, v in state.items() if k != "package"})),
                      "package": Path(extracted)}

    def no_compile(*args, **kwargs):
        raise AssertionError("the package must be loaded, not compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compile)
    restored = TorchInductorAOTBackend.from_dict(None, restored_state)
    assert restored.state == BackendState.CHECKPOINT_LOADED and restored.key() == backend.key()
    start = time.perf_counter()
    restored.deploy("cpu")
    assert time.perf_counter() - start < 1.0
    assert restored.state == BackendState.DEPLOYED
    for s in samples:
        assert_close(restored.infer(*s.args, **s.kwargs), s.outputs)
    with pytest.raises(BackendStateError):
        restored.deactivate()


def test_state_machine(mlp):
    _, backend, _, samples = mlp
    backend.deactivate()
    assert backend.state == BackendState.INACTIVE
    with pytest.raises(BackendStateError):
        backend.infer(*samples[0].args, **samples[0].kwargs)
    backend.activate()
    assert_close(backend.infer(*samples[0].args, **samples[0].kwargs), samples[0].outputs)


def test_export_failure_is_a_conversion_error_naming_the_cause(tmp_path):
    calls = [(b, ((torch.randn(b, 4),), {})) for b in (1, 2)]
    with pytest.raises(ConversionError, match="torch.export .* failed: .*") as info:
        build(DataDependent(), calls, tmp_path)
    assert "data-dependent" in str(info.value).lower() or "guard" in str(info.value).lower()
    assert info.value.__cause__ is not None and info.value.log_path == str(tmp_path / "build.log")
    assert not (tmp_path / "model.pt2").exists()


def test_contract_errors(mlp, tmp_path):
    with pytest.raises(RuntimeError, match="Please call build\\(\\) first"):
        TorchInductorAOTBackend().to_dict()
    state = mlp[1].to_dict()
    with pytest.raises(ValueError, match="Invalid state_dict type: TorchInductorBackend"):
        TorchInductorAOTBackend.from_dict(None, {**state, "type": "TorchInductorBackend"})
    with pytest.raises(ValueError, match="package"):
        TorchInductorAOTBackend.from_dict(None, {k: v for k, v in state.items() if k != "package"})
    with pytest.raises(UnsupportedDeviceError, match="compiled for 'cpu'"):
        TorchInductorAOTBackend.from_dict(None, state).deploy("xpu")
    missing = TorchInductorAOTBackend.from_dict(None, {**state, "package": tmp_path / "gone.pt2"})
    with pytest.raises(RuntimeError, match="does not exist"):
        missing.deploy("cpu")


def test_config_validation_and_round_trip():
    with pytest.raises(ConfigError, match="unknown Inductor option"):
        TorchInductorAOTBackendConfig(options={"no_such_option": True})
    with pytest.raises(ConfigError, match="strict must be True or False"):
        TorchInductorAOTBackendConfig(strict="no")
    config = TorchInductorAOTBackendConfig(options={"max_autotune": False})
    assert TorchInductorAOTBackendConfig.from_dict(config.to_dict()) == config
    assert TorchInductorAOTBackend(config).describe() == "TorchInductorAOTBackend(options={'max_autotune': False})"


def test_tune_with_one_backend_strategy():
    torch.manual_seed(0)
    reference = MLP().eval()
    inner = MLP().eval()
    inner.load_state_dict(reference.state_dict())
    model = tt.Module(inner, name="mlp", strategy=tt.OneBackendStrategy(TorchInductorAOTBackend()))
    width = reference.fc1.in_features
    report = tt.tune(model, [torch.randn(width) for _ in range(4)], batch_sizes=[1, 4], ignore_failing_modules=False)
    assert report.module("mlp").status == "tuned"
    assert report.module("mlp").graphs[0].chosen.startswith("TorchInductorAOTBackend")
    x = torch.randn(3, width)
    with torch.no_grad():
        assert_close(model(x), reference(x))
