"""TorchInductorBackend: build + infer on recorded graphs, dynamic shapes, state machine, round trip, bad input."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn
from toy_models import BnCNN

import torch_tweak.torch as tt
from torch_tweak.errors import BackendStateError, BuildError, ConfigError
from torch_tweak.torch.backend import _warm_package
from torch_tweak.torch.backend.backend import BackendState
from torch_tweak.torch.backend.torch_inductor import TorchInductorBackend, TorchInductorBackendConfig
from torch_tweak.torch.module.recording import record

# One Inductor cache for the whole test session: repeated compiles of a graph hit the FX graph cache.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "torch_tweak_test_inductor"))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Encoder(nn.Module):
    """A tiny pre-LN encoder called with keyword tensors, returning a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.pool = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.encoder(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)
        return {"last_hidden_state": hidden, "pooled": self.pool(hidden.mean(1))}


class GraphBreak(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent Python branch: a graph break for torch.compile
            return x * 2
        return x - 1


def text_call(batch: int, seq: int) -> tuple[int, tuple[tuple, dict]]:
    ids = torch.randint(1, 50, (batch, seq))
    return batch, ((), {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long)})


def build(model: nn.Module, calls: list, tmp: Path, config: TorchInductorBackendConfig | None = None):
    torch.manual_seed(0)
    [(spec, samples)] = record(model, calls)
    backend = TorchInductorBackend(config)
    backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"), tmp)
    return backend, spec, samples


def assert_close(actual, expected, atol: float = 1e-4) -> None:
    if isinstance(expected, dict):
        assert set(actual) == set(expected)
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], atol=atol, rtol=1e-4)
    else:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    torch.manual_seed(0)
    model = MLP().eval()
    calls = [(1, ((torch.randn(1, 16),), {})), (4, ((torch.randn(4, 16),), {}))]
    return (model, *build(model, calls, tmp_path_factory.mktemp("mlp")))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    torch.manual_seed(0)
    model = Encoder().eval()
    calls = [text_call(2, 5), text_call(4, 5), text_call(2, 9)]
    return (model, *build(model, calls, tmp_path_factory.mktemp("encoder")))


def test_mlp_matches_eager_and_serves_unseen_batch_without_recompiling(mlp):
    model, backend, spec, samples = mlp
    assert backend.state == BackendState.ACTIVE and backend.executed_precision == "fp32"
    for s in samples:
        assert_close(backend.infer(*s.args, **s.kwargs), s.outputs)
    x = torch.randn(3, 16)
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        assert_close(backend.infer(x), model(x))
        assert_close(backend.infer(x[:1]), model(x[:1]))


def test_cnn_matches_eager(tmp_path):
    torch.manual_seed(0)
    model = BnCNN().eval()
    calls = [(2, ((torch.randn(2, 3, 12, 12),), {})), (4, ((torch.randn(4, 3, 12, 12),), {}))]
    backend, _, samples = build(model, calls, tmp_path)
    for s in samples:
        assert_close(backend.infer(*s.args), s.outputs)
    x = torch.randn(3, 3, 12, 12)
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        assert_close(backend.infer(x), model(x))


def test_encoder_dynamic_batch_and_sequence(encoder):
    model, backend, spec, samples = encoder
    assert spec.inputs[0].shape == ("batch0", "dim1")
    for s in samples:
        assert_close(backend.infer(*s.args, **s.kwargs), s.outputs)
    _, (args, kwargs) = text_call(3, 7)
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        assert_close(backend.infer(*args, **kwargs), model(*args, **kwargs))


def test_state_machine_and_deactivate_keeps_other_backends_compiled(mlp, encoder):
    _, backend, _, samples = encoder
    backend.deactivate()
    assert backend.state == BackendState.INACTIVE and backend._compiled is None
    with pytest.raises(BackendStateError):
        backend.infer(*samples[0].args, **samples[0].kwargs)
    # the other tuned module's compiled code survives (no global reset): no recompilation needed
    mlp_model, mlp_backend, _, _ = mlp
    x = torch.randn(2, 16)
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        assert_close(mlp_backend.infer(x), mlp_model(x))
    backend.activate()
    assert backend.state == BackendState.ACTIVE
    assert_close(backend.infer(*samples[1].args, **samples[1].kwargs), samples[1].outputs)
    with pytest.raises(BackendStateError):
        backend.build(encoder[0], encoder[2], [], torch.device("cpu"), Path(tempfile.mkdtemp()))


def test_to_dict_from_dict_round_trip(encoder):
    model, backend, spec, samples = encoder
    state = backend.to_dict()
    package = state.pop(_warm_package.STATE_PACKAGE)  # the warm-load package: the one artifact, a file
    assert isinstance(package, Path) and package.is_file()
    json.dumps(state)  # otherwise no tensors, no artifacts: JSON only
    assert "samples" not in json.dumps(state)
    for stored in (package, None):  # served from the package, or compiled again without it
        restored = TorchInductorBackend.from_dict(model, {**json.loads(json.dumps(state)),
                                                          _warm_package.STATE_PACKAGE: stored})
        assert restored.state == BackendState.CHECKPOINT_LOADED
        assert restored.key() == backend.key() and restored.describe() == backend.describe()
        restored.deploy("cpu")
        assert restored.state == BackendState.DEPLOYED
        assert isinstance(restored._compiled, _warm_package.PackageRunner) is (stored is not None)
        for s in samples:
            assert_close(restored.infer(*s.args, **s.kwargs), s.outputs)
        with pytest.raises(BackendStateError):
            restored.deactivate()


def test_autocast_restores_output_dtype(tmp_path):
    torch.manual_seed(0)
    model = MLP().eval()
    config = TorchInductorBackendConfig(autocast_enabled=True, autocast_dtype=torch.bfloat16)
    backend, _, samples = build(model, [(2, ((torch.randn(2, 16),), {}))], tmp_path, config)
    assert backend.executed_precision == "bf16"
    out = backend.infer(*samples[0].args)
    assert out.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(out.flatten(), samples[0].outputs.flatten(), dim=0) > 0.99
    assert "autocast_enabled=True" in backend.describe()


def test_fullgraph_with_graph_break_is_a_clear_build_error(tmp_path):
    config = TorchInductorBackendConfig(fullgraph=True)
    with pytest.raises(BuildError, match="fullgraph=True") as info:
        build(GraphBreak(), [(1, ((torch.randn(1, 4),), {})), (2, ((torch.randn(2, 4),), {}))], tmp_path, config)
    assert str(tmp_path / "build.log") in str(info.value) and info.value.log_path == str(tmp_path / "build.log")
    assert info.value.__cause__ is not None


def test_contract_errors(mlp):
    with pytest.raises(RuntimeError, match="Please call build\\(\\) first"):
        TorchInductorBackend().to_dict()
    state = mlp[1].to_dict()
    with pytest.raises(ValueError, match="Invalid state_dict type: TorchEagerBackend"):
        TorchInductorBackend.from_dict(mlp[0], {**state, "type": "TorchEagerBackend"})
    with pytest.raises(ValueError, match="original module"):
        TorchInductorBackend.from_dict(None, state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "max-autotune", "options": {"freezing": True}}, "both given"),
        ({"mode": "fastest"}, "valid modes: .*max-autotune-no-cudagraphs"),
        ({"options": {"no_such_option": 1}}, "unknown Inductor option"),
        ({"options": {"freezing": object()}}, "must be a bool, number"),
        ({"dynamic": "yes"}, "dynamic must be"),
        ({"autocast_dtype": "bfloat16"}, "autocast_enabled is False"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TorchInductorBackendConfig(**kwargs)


def test_config_key_describe_and_dict_round_trip():
    config = TorchInductorBackendConfig(options={"freezing": True}, dynamic=True)
    assert TorchInductorBackendConfig.from_dict(config.to_dict()) == config
    assert config.key() != TorchInductorBackendConfig().key()
    assert TorchInductorBackend(config).describe() == "TorchInductorBackend(dynamic=True,options={'freezing': True})"


def test_tune_with_one_backend_strategy():
    torch.manual_seed(0)
    reference = MLP().eval()
    inner = MLP().eval()
    inner.load_state_dict(reference.state_dict())
    model = tt.Module(inner, name="mlp", strategy=tt.OneBackendStrategy(TorchInductorBackend()))
    width = reference.net[0].in_features
    report = tt.tune(model, [torch.randn(width) for _ in range(4)], batch_sizes=[1, 4], ignore_failing_modules=False)
    assert report.module("mlp").status == "tuned"
    assert report.module("mlp").graphs[0].chosen.startswith("TorchInductorBackend")
    x = torch.randn(3, width)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), atol=1e-4, rtol=1e-4)
