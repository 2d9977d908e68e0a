"""tt.save / tt.load: round trips (in process and in a fresh process per backend) and every kind of bad input."""

from __future__ import annotations

import gc
import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_child import ToyPipeline, build
from checkpoint_helpers import assert_untouched, eager, members, save_mlp, snapshot
from safetensors.torch import load_file, save_file
from torch import nn
from toy_models import KwargsModel, Pipeline, mlp

import torch_tweak.torch as tt
from torch_tweak.errors import CheckpointError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.checkpoint import archive, verify
from torch_tweak.torch.module.state import internals

CHILD = Path(__file__).parent / "checkpoint_child.py"


@pytest.fixture
def saved(tmp_path):
    """An eager checkpoint of an MLP, an input and its expected output; the tuned module is gone."""
    return save_mlp(tmp_path / "mlp.tt")


def forget(*objects: object) -> None:
    del objects
    gc.collect()


def run_fresh(kind: str, checkpoint: Path, inputs: list[torch.Tensor], tmp_path: Path, *extra: str):
    """Load ``checkpoint`` in a new Python process; return its outputs and its report."""
    data, out = tmp_path / "inputs.safetensors", tmp_path / "outputs.safetensors"
    save_file({f"input.{i}": x.contiguous() for i, x in enumerate(inputs)}, data)
    proc = subprocess.run([sys.executable, str(CHILD), kind, str(checkpoint), str(data), str(out), *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = load_file(out)
    return [outputs[f"output.{i}"] for i in range(len(inputs))], json.loads(proc.stdout.strip().splitlines()[-1])


# round trips ----------------------------------------------------------------------------------------


def test_save_writes_zip_and_sums_owner_only_and_loads_in_process(saved, tmp_path):
    path, x, expected = saved
    sums = archive.sums_path(path)
    assert path.name == "mlp.tt" and sums.name == "mlp_sha256_sums.txt"
    for f in (path, sums):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    names = sorted(members(path))
    assert names == ["manifest.json", "tensors/m0.safetensors"]
    assert sums.read_text().splitlines()[0].endswith("  manifest.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "mlp.tt", "mlp_sha256_sums.txt"]
    loaded = tt.load(mlp(seed=7), path)  # different weights: the checkpoint's must be used
    assert type(loaded) is tt.Module and loaded.name == "mlp" and loaded.state is tt.ModuleState.TUNED
    assert torch.allclose(loaded(x), expected)
    summary = verify(path)
    assert summary["modules"] == [{"name": "mlp", "path": "<root>", "class": "torch.nn.modules.container:Sequential",
                                   "graphs": [{"name": "0", "backend": "TorchEagerBackend"}]}]


def test_model_with_wrapped_children_and_kwargs_namedtuple_outputs(tmp_path):
    pipe = Pipeline()
    pipe.encoder = tt.Module(pipe.encoder, name="encoder", strategy=eager())
    pipe.head = tt.Module(pipe.head, name="head", strategy=eager())
    tt.tune(pipe, [torch.randn(8) for _ in range(3)])
    kw = tt.Module(KwargsModel(), name="kw", strategy=eager())
    tt.tune(lambda x: kw(x, mask=torch.ones_like(x), scale=2.0), [torch.randn(6) for _ in range(2)])
    x, y = torch.randn(2, 8), torch.randn(2, 6)
    expected, expected_kw = pipe(x), kw(y, mask=torch.ones_like(y), scale=2.0)
    tt.save(pipe, tmp_path / "pipe.tt")
    tt.save(kw, tmp_path / "kw.tt")
    forget(pipe, kw)
    del pipe, kw
    gc.collect()
    fresh = Pipeline()
    assert tt.load(fresh, tmp_path / "pipe.tt") is fresh
    assert type(fresh._modules["encoder"]) is tt.Module and fresh.encoder.name == "encoder"
    assert torch.allclose(fresh(x), expected)
    kw = tt.load(KwargsModel(), tmp_path / "kw.tt")
    out = kw(y, mask=torch.ones_like(y), scale=2.0)
    assert type(out).__name__ == "Pair" and torch.allclose(out.first, expected_kw.first)


def test_load_into_an_already_wrapped_model_reuses_the_proxy(saved):
    path, x, expected = saved
    wrapped = tt.Module(mlp(seed=3), name="mlp")
    assert tt.load(wrapped, path) is wrapped
    assert torch.allclose(wrapped(x), expected) and wrapped.state is tt.ModuleState.TUNED
    assert tt.load(wrapped.wrapped, path) is wrapped  # through the inner module too; never wrapped twice
    assert torch.allclose(wrapped(x), expected)


def test_tied_weights_are_stored_once(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    model[1].weight = model[0].weight
    wrapped = tt.Module(model, name="tied", strategy=eager())
    tt.tune(wrapped, [torch.randn(4) for _ in range(2)])
    x = torch.randn(2, 4)
    expected = wrapped(x)
    tt.save(wrapped, tmp_path / "tied.tt")
    data = json.loads(members(tmp_path / "tied.tt")["manifest.json"])
    assert data["modules"][0]["aliases"] == {"1.weight": "0.weight"}
    forget(wrapped, model)
    del wrapped, model
    gc.collect()
    loaded = tt.load(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval(), tmp_path / "tied.tt")
    assert torch.allclose(loaded(x), expected)


class FoldersBackend(TorchEagerBackend):
    """Eager, plus artifact folders the test chooses; loading records what each one held."""

    folders: list[Path] = []
    loaded: list[dict[str, dict[str, bytes]]] = []

    def to_dict(self):
        return {**super().to_dict(), "folders": list(self.folders)}

    @classmethod
    def from_dict(cls, module, state_dict):
        state = dict(state_dict)
        cls.loaded.append({f"{i}": {p.name: p.read_bytes() for p in folder.iterdir()}
                           for i, folder in enumerate(state.pop("folders"))})
        return super().from_dict(module, state)


def test_artifacts_with_the_same_files_are_stored_once_and_each_reference_loads_them(tmp_path):
    contents = [{"model.bin": b"w" * 4096, "model.xml": b"<net/>"}, {"model.bin": b"w" * 4096, "model.xml": b"<net/>"},
                {"model.bin": b"w" * 4095 + b"v", "model.xml": b"<net/>"}]
    FoldersBackend.folders = []
    for i, files in enumerate(contents):  # copies, not links: equal bytes are enough
        folder = tmp_path / f"build{i}"
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
        FoldersBackend.folders.append(folder)
    wrapped = tt.Module(mlp(), name="folders", strategy=tt.OneBackendStrategy(FoldersBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(2)])
    tt.save(wrapped, tmp_path / "folders.tt")
    stored = members(tmp_path / "folders.tt")
    assert sorted(n for n in stored if n.endswith("model.bin")) == ["artifacts/m0/g0/a0/model.bin",
                                                                      "artifacts/m0/g0/a2/model.bin"]
    graph = json.loads(stored["manifest.json"])["modules"][0]["graphs"][0]["backend"]
    assert graph["artifacts"] == ["artifacts/m0/g0/a0", "artifacts/m0/g0/a2"]
    forget(wrapped)
    FoldersBackend.loaded = []
    tt.load(mlp(), tmp_path / "folders.tt")
    assert FoldersBackend.loaded == [{f"{i}": files for i, files in enumerate(contents)}]


def test_loading_a_checkpoint_again_reuses_the_model_openvino_compiled_for_the_first_load(tmp_path):
    pytest.importorskip("openvino")
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    strategy = tt.OneBackendStrategy(OpenVINOBackend(OpenVINOBackendConfig(inference_precision="f32")))
    wrapped = tt.Module(mlp(), name="mlp", strategy=strategy)
    tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 4])
    path = tt.save(wrapped, tmp_path / "mlp.tt")
    blobs = tt.config.cache_dir / "openvino_model_cache"
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = mlp()(x)
        for _ in range(3):  # each load extracts to a folder of its own; the compiled model is keyed by content
            loaded = tt.load(mlp(), path)
            torch.testing.assert_close(loaded(x), expected, atol=1e-4, rtol=1e-4)
            assert [p.suffix for p in blobs.iterdir()] == [".blob"]


def test_device_map(saved):
    path, x, expected = saved
    model = mlp()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=r"does not have; its modules are \['mlp'\]"):
        tt.load(model, path, device_map={"nope": "cpu"})
    with pytest.raises(CheckpointError, match="device_map\\['mlp'\\]"):
        tt.load(model, path, device_map={"mlp": "cuda"})
    assert_untouched(model, before)
    loaded = tt.load(model, path, device_map={"mlp": "cpu"})
    assert loaded.backends["0"].device == torch.device("cpu") and torch.allclose(loaded(x), expected)


@pytest.mark.openvino
def test_fresh_process_pipeline_with_openvino_and_eager(tmp_path):
    pytest.importorskip("openvino")
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    pipe = ToyPipeline()
    # OpenVINO alone, so that its weights can leave the module: without the NaN probe, whose failure on this
    # ReLU CNN would put it behind the non-finite guard (tests/test_non_finite_guard.py saves and loads that)
    pipe.encoder = tt.Module(pipe.encoder, name="encoder", strategy=tt.OneBackendStrategy(
        OpenVINOBackend(OpenVINOBackendConfig(inference_precision="f32")),
        fidelity=tt.FidelityConfig(check_non_finite=False)))
    pipe.heads["score"] = tt.Module(pipe.heads["score"], name="score", strategy=eager())
    pipe.stages[0] = tt.Module(pipe.stages[0], name="stage", strategy=eager())
    tt.tune(pipe, [torch.randn(3, 8, 8) for _ in range(2)])
    assert internals(pipe.encoder).offloaded  # OpenVINO holds the weights; the module's went to meta
    inputs = [torch.randn(1, 3, 8, 8), torch.randn(2, 3, 8, 8)]
    expected = [pipe(x) for x in inputs]
    tt.save(pipe, tmp_path / "pipe.tt")
    assert any(n.endswith("/model.xml") for n in members(tmp_path / "pipe.tt"))
    outputs, info = run_fresh("pipeline", tmp_path / "pipe.tt", inputs, tmp_path)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert info["returned"] == "ToyPipeline"
    assert info["backends"] == {"encoder": ["OpenVINOBackend"], "score": ["TorchEagerBackend"],
                                "stage": ["TorchEagerBackend"]}
    assert info["offloaded"]["encoder"] and not info["offloaded"]["score"]
    assert all(v == 0 for v in info["compiles"].values()) and info["dynamo_frames"] == 0


def _fresh_process_single(tmp_path, backend, kind: str, atol: float, *child_args: str, **save_kwargs) -> dict:
    model = build(kind)
    wrapped = tt.Module(model, name=kind, strategy=tt.OneBackendStrategy(backend))
    shape = (3, 8, 8) if kind == "cnn" else (64,)
    tt.tune(wrapped, [torch.randn(*shape) for _ in range(2)])
    inputs = [torch.randn(2, *shape), torch.randn(1, *shape)]
    expected = [wrapped(x) for x in inputs]
    tt.save(wrapped, tmp_path / "m.tt", **save_kwargs)
    outputs, info = run_fresh(kind, tmp_path / "m.tt", inputs, tmp_path, *child_args)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    assert info["returned"] == "tt.Module" and info["states"] == {kind: "TUNED"}
    return info


def test_fresh_process_eager(tmp_path):
    info = _fresh_process_single(tmp_path, TorchEagerBackend(), "cnn", 1e-6)
    assert sum(info["compiles"].values()) == 0


@pytest.mark.slow
def test_fresh_process_inductor_aot_loads_without_compiling(tmp_path):
    from torch_tweak.torch.backend import TorchInductorAOTBackend

    info = _fresh_process_single(tmp_path, TorchInductorAOTBackend(), "cnn", 1e-5, "--trust-native-code")
    assert sum(info["compiles"].values()) == 0 and info["dynamo_frames"] == 0


@pytest.mark.slow
def test_fresh_process_signed_native_checkpoint_loads_with_the_key(tmp_path):
    from torch_tweak.torch.backend import TorchInductorAOTBackend

    secret = bytes(range(32))
    _fresh_process_single(tmp_path, TorchInductorAOTBackend(), "cnn", 1e-5, "--verify-key", secret.hex(),
                          signing_key=secret)

# Inductor and TorchAO in a fresh process, trusted (no compile) and untrusted (compiles and warns):
# tests/test_warm_load.py.
