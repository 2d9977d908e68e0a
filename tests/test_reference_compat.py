"""Code written for the reference Torch Tweak runs here unchanged (docs/migrating.md).

Each test follows a usage pattern the reference documents (its quick start, tuning and deployment guides and
its examples), written afresh for tiny CPU models; the deliberate differences (no pickle, default strategy,
default device) are checked in tests/test_reference_compat_errors.py.
"""

from __future__ import annotations

import gc
import importlib
import logging

import pytest
import torch
from torch import nn
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.profiling.stop_rules import (
    NumStepsMeasuringStopStrategy,
    ThroughputSaturatedProfilingStopStrategy,
)

FAST = ProfilingConfig(warmup_calls=1, window_size=2, min_calls=2, min_time_s=0.0, max_calls=4, max_time_s=0.05,
                       pause_s=0.0)


def eager_only() -> tt.OneBackendStrategy:
    return tt.OneBackendStrategy(TorchEagerBackend()).enable_find_max_batch_size(False)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 16))  # most of the time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embed(x))


class Embedder:
    """A pipeline object (not an nn.Module) holding a model, as sentence-embedding libraries do."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = Encoder()

    def encode(self, sentences: torch.Tensor) -> torch.Tensor:
        return self.model(sentences).mean(dim=-1)


def test_minimal_pattern_highest_throughput_with_results():
    strategy = tt.HighestThroughputStrategy(
        backends=[TorchEagerBackend()], profiling=FAST,
        measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=3),
        profiling_stop_strategy=ThroughputSaturatedProfilingStopStrategy(0.05, 0),
    ).enable_find_max_batch_size(False)
    assert strategy.profiling.max_calls == 3 and strategy.profiling.saturation_patience == 1
    module = tt.Module(mlp(), name="mlp", strategy=strategy)
    x = torch.randn(4, 8)
    expected = module(x)
    tt.tune(module, torch.randn(8), batch_sizes=[1, 4], device="cpu")
    assert module.state is tt.ModuleState.TUNED and strategy.results
    torch.testing.assert_close(module(x), expected)


def test_every_strategy_has_the_chainable_max_batch_size_setters():
    for strategy in (tt.FirstWinsStrategy([TorchEagerBackend()]), tt.OneBackendStrategy(TorchEagerBackend()),
                     tt.HighestThroughputStrategy([TorchEagerBackend()]), tt.LowestLatencyStrategy([TorchEagerBackend()])):
        assert strategy.enable_find_max_batch_size(False) is strategy and not strategy.find_max_batch_size
        assert strategy.set_find_max_batch_size_profiling_config(FAST) is strategy
        assert strategy.set_find_max_batch_size_default_backend_class(TorchEagerBackend) is strategy
        assert strategy.enable_find_max_batch_size() is strategy and strategy.find_max_batch_size


def test_first_wins_runs_the_max_batch_size_search_when_enabled():
    strategy = (tt.FirstWinsStrategy([TorchEagerBackend()]).enable_find_max_batch_size(True)
                .set_find_max_batch_size_profiling_config(FAST)
                .set_find_max_batch_size_default_backend_class(TorchEagerBackend))
    strategy.max_batch_size_limit = 8
    module = tt.Module(mlp(), name="mlp", strategy=strategy)
    report = tt.tune(module, [torch.randn(8) for _ in range(2)], batch_sizes=[1, 2])
    search = report.modules[0].graphs[0].batch_search
    assert search is not None and search["batch_sizes"] == [1, 2, 4, 8] and "max_batch_size" in search


def test_embedding_pattern_inspect_fraction_wrap_dry_run_tune_save_load(tmp_path):
    pipe = Embedder()
    sentences = [torch.randn(8) for _ in range(4)]
    # enough iterations that a preemption outside the modules (a busy machine) cannot push them all under 10 %
    info = tt.inspect(pipe.model, sentences, inference_function=pipe.encode, number_of_iterations=8,
                      warmup_iterations=1, min_depth=1)
    modules = info.get_modules(min_execution_percentage=0.1)  # a fraction: modules taking >= 10 % of the time
    assert modules and all(info.share(m) >= 10 for m in modules)
    top = modules[0]
    assert top.execution_count == top.calls == 8 and top.total_execution_time == top.total_time_s
    assert top.average_execution_time == pytest.approx(top.total_time_s / 8)
    assert top.module_type in ("Linear", "Sequential") and top.num_layers == len(list(top.module.children()))

    tt.wrap(pipe.model, modules, strategy=eager_only())
    dry = tt.tune(pipe.encode, sentences, batch_sizes=[1], dry_run=True)
    assert dry.dry_run
    x = torch.stack(sentences)
    expected = pipe.encode(x)
    tt.tune(pipe.encode, sentences, batch_sizes=[1, 2, 4])
    torch.testing.assert_close(pipe.encode(x), expected, rtol=1e-3, atol=1e-3)
    path = tt.save(pipe.model, tmp_path / "e5.tt")

    tt.config.device_after_tuning = "cpu"
    fresh = Embedder()  # built again, same weights: the tuned pipe is still alive (the notebook flow)
    tt.load(fresh.model, path)
    torch.testing.assert_close(fresh.encode(x), expected, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(pipe.encode(x), expected, rtol=1e-3, atol=1e-3)  # the old one keeps working


def test_load_into_a_fresh_model_while_the_tuned_one_is_alive_takes_the_name(tmp_path):
    from torch_tweak.torch.module_registry import MODULE_REGISTRY

    tuned = tt.Module(mlp(), name="mlp", strategy=eager_only())
    tt.tune(tuned, [torch.randn(8) for _ in range(2)])
    x = torch.randn(3, 8)
    expected = tuned(x)
    tt.save(tuned, tmp_path / "mlp.tt")
    loaded = tt.load(mlp(), tmp_path / "mlp.tt", device_map={"": "cpu"})  # "": the whole object
    assert MODULE_REGISTRY.get("mlp") is loaded and loaded.name == tuned.name == "mlp"
    torch.testing.assert_close(loaded(x), expected)
    torch.testing.assert_close(tuned(x), expected)
    assert tuned.state is tt.ModuleState.TUNED


def test_local_torch_storage_and_the_reference_argument_order(tmp_path):
    storage = tt.LocalTorchStorage(base_folder=tmp_path / "checkpoints", remove_checkpoint_after_tune=True)
    module = tt.Module(mlp(), name="mlp", strategy=eager_only())
    tt.tune(module, [torch.randn(8) for _ in range(2)], disable_external_logging=True)
    x = torch.randn(2, 8)
    expected = module(x)
    written = tt.save(module, "tuned_model.tt", storage=storage)
    assert written == tmp_path / "checkpoints" / "tuned_model.tt"
    assert (tmp_path / "checkpoints" / "tuned_model_sha256_sums.txt").is_file()
    assert tt.save(module, "tuned_model", storage) == written  # positional storage, .tt added
    loaded = tt.load(mlp(), "tuned_model.tt", storage, {"mlp": "cpu"}, True)  # load(obj, path, storage, device_map)
    torch.testing.assert_close(loaded(x), expected)
    del loaded
    gc.collect()
    again = tt.load(mlp(), "tuned_model.tt", storage=storage, device_map={"": torch.device("cpu")},
                    disable_external_logging=True)
    torch.testing.assert_close(again(x), expected)


def test_disable_external_logging_drops_other_libraries_records_only_during_the_call(caplog):
    other = logging.getLogger("some_compiler")
    module = tt.Module(mlp(), name="mlp", strategy=eager_only())

    def run(x: torch.Tensor) -> torch.Tensor:
        other.warning("noise from another library")
        return module(x)

    with caplog.at_level(logging.INFO):
        tt.tune(run, [torch.randn(8)], disable_external_logging=True)
        assert not [r for r in caplog.records if r.name == "some_compiler"]
        assert [r for r in caplog.records if r.name.startswith("torch_tweak")]
        other.warning("after")
    assert [r.message for r in caplog.records if r.name == "some_compiler"] == ["after"]


def test_module_members_of_the_reference():
    module = tt.Module(mlp(), name="mlp", strategy=eager_only())
    assert module.device == torch.device("cpu") and module.module.state is tt.ModuleState.INIT
    assert not hasattr(module.module, "module")  # unwrapping helpers stop at the view
    module.enable_recording()  # INIT: nothing to do
    tt.tune(module, [torch.randn(8) for _ in range(2)])
    state = module.to_dict()
    assert tt.Module.is_state_dict_valid(state) and not tt.Module.is_state_dict_valid({"type": "Module"})
    assert state["name"] == "mlp" and state["graphs"][0]["backend"] == module.backends["0"].describe()
    assert module.module.backends == module.backends and module.device == torch.device("cpu")
    module.enable_recording(force=True)
    assert module.state is tt.ModuleState.INIT
    tt.tune(module, [torch.randn(8) for _ in range(2)])
    assert module.state is tt.ModuleState.TUNED
    module.enable_passthrough(force=True)
    assert module.state is tt.ModuleState.PASSTHROUGH


def test_wrapped_model_attributes_named_device_or_module_win():
    class HasBoth(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

        @property
        def device(self) -> torch.device:
            return torch.device("meta")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    inner = HasBoth()
    wrapped = tt.Module(inner, name="both")
    assert wrapped.module is inner.module and wrapped.device == torch.device("meta")


def test_data_loader_factory_with_a_collate_function():
    calls: list[int] = []

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        calls.append(len(items))
        return {"x": torch.stack([item["features"] for item in items])}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    factory = tt.DataLoaderFactory([{"features": torch.randn(8)} for _ in range(4)], collate_fn=collate)
    batch = next(iter(factory.create_dataloader(batch_size=2)))
    assert batch["x"].shape == (2, 8)
    module = tt.Module(Model(), name="model", strategy=eager_only())
    tt.tune(module, factory, batch_sizes=[1, 2])
    assert module.state is tt.ModuleState.TUNED and 2 in calls
    info = tt.inspect(Model(), tt.DataLoaderFactory([torch.randn(8)]), number_of_iterations=1, warmup_iterations=0)
    assert info.get_modules()


def test_config_fields_and_cache_dir_function(tmp_path):
    tt.config.min_num_samples = 10
    tt.config.enable_hf_integrations = False
    assert tt.config.min_num_samples == 10 and tt.config.enable_hf_integrations is False
    tt.config.cache_dir = tmp_path / "c"
    assert tt.torch_tweak_cache_dir() == tmp_path / "c"
    with pytest.raises(ConfigError, match="min_num_samples"):
        tt.config.min_num_samples = 0


@pytest.mark.parametrize("path, names", [
    ("torch_tweak.torch.backend.torch_inductor_backend", ["TorchInductorBackend", "TorchInductorBackendConfig"]),
    ("torch_tweak.torch.backend.torchao_backend", ["TorchAOBackend", "TorchAOBackendConfig"]),
    ("torch_tweak.torch.backend.torch_eager", ["TorchEagerBackend", "TorchEagerBackendConfig"]),
    ("torch_tweak.torch.backend.backend", ["Backend", "BackendConfig", "BackendState"]),
    ("torch_tweak.torch.backend.openvino", ["OpenVINOBackend", "OpenVINOBackendConfig"]),
    ("torch_tweak.torch.module.graph_spec", ["GraphSpec"]),
    ("torch_tweak.torch.module.tensor_spec", ["TensorSpec"]),
    ("torch_tweak.torch.module.wrapper_module", ["Module", "ModuleState"]),
    ("torch_tweak.torch.tune_strategy.tune_strategy", ["TuneStrategy"]),
    ("torch_tweak.torch.tune_strategy.first_wins_strategy", ["FirstWinsStrategy"]),
    ("torch_tweak.torch.tune_strategy.one_backend_strategy", ["OneBackendStrategy"]),
    ("torch_tweak.torch.tune_strategy.highest_throughput_strategy", ["HighestThroughputStrategy"]),
    ("torch_tweak.torch.tune_strategy.extension", ["TuneStrategyFindMaxBatchSizeExtension"]),
    ("torch_tweak.torch.checkpoint.local_torch_storage", ["LocalTorchStorage"]),
    ("torch_tweak.torch.dataloader", ["DataLoaderFactory"]),
    ("torch_tweak.torch.inspecting.inspecting", ["inspect"]),
    ("torch_tweak.torch.inspecting.module_info", ["ModuleInfo", "InspectedModulesInfo"]),
    ("torch_tweak.torch.inspecting.wrapping", ["wrap"]),
    ("torch_tweak.torch.module_registry", ["MODULE_REGISTRY"]),
    ("torch_tweak.torch.task.profiling", ["NumStepsMeasuringStopStrategy", "StableWindowMeasuringStopStrategy",
                                          "ThroughputSaturatedProfilingStopStrategy", "AllSamplesProfilingStopStrategy"]),
])
def test_reference_import_paths(path, names):
    module = importlib.import_module(path)
    for name in names:
        value = getattr(module, name)
        public = getattr(tt, name, None) or getattr(importlib.import_module("torch_tweak.torch.backend"), name, None)
        if public is not None:
            assert value is public, f"{path}.{name} is not the same object as the public one"
