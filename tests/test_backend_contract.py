"""The seed's Backend contract, exercised through the eager backend."""

from __future__ import annotations

import json
import os

import pytest
import torch
from toy_models import mlp

from torch_tweak.errors import ConfigError, UnsupportedDeviceError
from torch_tweak.torch.backend import BackendState, TorchEagerBackend, TorchEagerBackendConfig
from torch_tweak.torch.module.recording import record


@pytest.fixture
def graph():
    model = mlp()
    ((spec, samples),) = record(model, [(bs, ((torch.randn(bs, 8),), {})) for bs in (1, 2)])
    return model, spec, samples


def built(graph, tmp_path, backend=None):
    model, spec, samples = graph
    backend = backend or TorchEagerBackend()
    return backend.build(model, spec, [s.sample for s in samples], torch.device("cpu"), tmp_path / "b")


def test_state_machine_messages(graph, tmp_path):
    backend = TorchEagerBackend()
    assert backend.state is BackendState.INIT and backend.name == "TorchEagerBackend"
    with pytest.raises(RuntimeError, match="^Cannot activate backend TorchEagerBackend, backend should be built first$"):
        backend.activate()
    with pytest.raises(RuntimeError, match="^Cannot deactivate backend TorchEagerBackend, backend should be built first$"):
        backend.deactivate()
    with pytest.raises(RuntimeError, match="^Cannot run inference, backend TorchEagerBackend should be activated first$"):
        backend.infer(torch.randn(1, 8))
    with pytest.raises(RuntimeError, match="^Cannot deploy backend TorchEagerBackend, backend should be loaded from a checkpoint$"):
        backend.deploy(None)
    assert built(graph, tmp_path, backend) is backend
    assert backend.state is BackendState.ACTIVE and backend.is_active and backend.device == torch.device("cpu")
    with pytest.raises(RuntimeError, match="^Backend TorchEagerBackend build should be called only once$"):
        built(graph, tmp_path, backend)
    backend.deactivate()
    assert backend.state is BackendState.INACTIVE and not backend.is_active
    backend.deactivate()  # no-op
    with pytest.raises(RuntimeError, match="should be activated first"):
        backend.infer(torch.randn(1, 8))
    backend.activate()
    backend.activate()  # no-op
    assert backend.infer(torch.randn(2, 8)).shape == (2, 4)


def test_checkpoint_states(graph, tmp_path):
    model, _, _ = graph
    state = built(graph, tmp_path).to_dict()
    json.dumps(state)
    loaded = TorchEagerBackend.from_dict(model, state)
    assert loaded.state is BackendState.CHECKPOINT_LOADED
    with pytest.raises(RuntimeError, match="^Cannot deactivate backend TorchEagerBackend, backend has already been deployed$"):
        loaded.deactivate()
    loaded.deploy(None)
    assert loaded.state is BackendState.DEPLOYED and loaded.device == torch.device("cpu")
    with pytest.raises(RuntimeError, match="^Cannot activate backend TorchEagerBackend, backend is already deployed$"):
        loaded.activate()
    with pytest.raises(RuntimeError, match="^Cannot deactivate backend TorchEagerBackend, backend is already deployed$"):
        loaded.deactivate()
    x = torch.randn(2, 8)
    assert torch.equal(loaded.infer(x), model(x))
    reloaded = TorchEagerBackend.from_dict(model, state)
    reloaded.activate()
    assert reloaded.state is BackendState.ACTIVE


def test_from_dict_and_to_dict_errors(graph, tmp_path):
    with pytest.raises(RuntimeError, match="Please call build\\(\\) first"):
        TorchEagerBackend().to_dict()
    state = built(graph, tmp_path).to_dict()
    with pytest.raises(ValueError, match="Invalid state_dict type: OpenVINOBackend"):
        TorchEagerBackend.from_dict(graph[0], {**state, "type": "OpenVINOBackend"})
    with pytest.raises(ValueError, match="needs the original module"):
        TorchEagerBackend.from_dict(None, state)


def test_unsupported_device(graph, tmp_path):
    model, spec, samples = graph
    with pytest.raises(UnsupportedDeviceError, match="Unsupported device 'cuda:0'"):
        TorchEagerBackend().build(model, spec, [], "cuda:0", tmp_path)


def test_config_key_describe_json(tmp_path):
    default, changed = TorchEagerBackendConfig(), TorchEagerBackendConfig(autocast_enabled=True, autocast_dtype=torch.bfloat16)
    assert default.describe() == ""
    assert changed.describe() == "autocast_enabled=True,autocast_dtype=bfloat16"
    assert default.key() == TorchEagerBackendConfig().key() != changed.key()
    assert TorchEagerBackend(changed).key() == f"TorchEagerBackend_{changed.key()}"
    assert TorchEagerBackend(changed).describe() == "TorchEagerBackend(autocast_enabled=True,autocast_dtype=bfloat16)"
    path = tmp_path / "config.json"
    changed.to_json(path)
    assert json.loads(path.read_text()) == {"autocast_enabled": True, "autocast_dtype": "bfloat16"}
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert TorchEagerBackendConfig.from_dict(changed.to_dict()) == changed
    with pytest.raises(ConfigError, match="no field"):
        TorchEagerBackendConfig.from_dict({"bogus": 1})


def test_config_validation():
    with pytest.raises(ConfigError, match="autocast_dtype"):
        TorchEagerBackendConfig(autocast_enabled=True, autocast_dtype="int8")
    with pytest.raises(ConfigError, match="no effect"):
        TorchEagerBackendConfig(autocast_dtype="bfloat16")
    with pytest.raises(ConfigError):
        TorchEagerBackendConfig(autocast_enabled="yes")  # type: ignore[arg-type]


def test_autocast_runs_bf16_and_restores_dtype(graph, tmp_path):
    backend = built(graph, tmp_path, TorchEagerBackend(TorchEagerBackendConfig(autocast_enabled=True)))
    assert backend.executed_precision == "bf16"
    out = backend.infer(torch.randn(2, 8))
    assert out.dtype == torch.float32
