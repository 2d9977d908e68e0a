"""Where torch_tweak deliberately differs from the reference Torch Tweak, the reference spelling says so.

Differences (docs/migrating.md): no pickle (reference checkpoints and ``from_dict`` are refused), the default
strategy and device, fractions for ``min_execution_percentage``, storage options that need another format,
and stop strategies or profiling configs other than the mapped ones. Also the environment switches.
"""

from __future__ import annotations

import io
import logging
import zipfile

import pytest
import torch
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import CheckpointError, ConfigError, TuningError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.checkpoint import verify
from torch_tweak.utils.capture import capture_output


def eager() -> tt.OneBackendStrategy:
    return tt.OneBackendStrategy(TorchEagerBackend())


def reference_checkpoint(folder, name: str = "tuned_model"):
    """What the reference writes: a zip holding a pickled state_dict.pt and a sums file beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.tt"
    buffer = io.BytesIO()
    torch.save({"mlp": {"type": "Module"}}, buffer)  # a pickle; torch_tweak must never open it
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/state_dict.pt", buffer.getvalue())
    (folder / f"{name}_sha256_sums.txt").write_text("0" * 64 + f"  checkpoints/{name}/state_dict.pt\n")
    return path


def test_a_reference_checkpoint_is_refused_without_unpickling(tmp_path, monkeypatch):
    path = reference_checkpoint(tmp_path / "checkpoints")

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    for call in (lambda: tt.load(mlp(), path), lambda: verify(path),
                 lambda: tt.load(mlp(), "tuned_model.tt", storage=tt.LocalTorchStorage(tmp_path / "checkpoints"))):
        with pytest.raises(CheckpointError, match=r"reference Torch Tweak.*pickle.*Re-tune"):
            call()
    folder = tmp_path / "unpacked"
    folder.mkdir()
    (folder / "state_dict.pt").write_bytes(b"\x80\x05.")
    with pytest.raises(CheckpointError, match="pickle"):
        tt.load(mlp(), folder)


def test_a_checkpoint_where_the_reference_puts_them_is_pointed_out(tmp_path, monkeypatch):
    module = tt.Module(mlp(), name="mlp", strategy=eager())
    tt.tune(module, [torch.randn(8)])
    monkeypatch.chdir(tmp_path)
    tt.save(module, "m.tt", storage=tt.LocalTorchStorage())
    with pytest.raises(CheckpointError, match=r"checkpoints/m.tt.*LocalTorchStorage"):
        tt.load(mlp(), "m.tt")


def test_from_dict_is_refused_with_the_way_to_restore():
    with pytest.raises(CheckpointError, match=r"tt.load"):
        tt.Module.from_dict(mlp(), {"type": "Module", "name": "x", "graphs": []}, "cpu")
    module = tt.Module(mlp(), name="mlp", strategy=eager())
    with pytest.raises(TuningError, match="not TUNED"):
        module.to_dict()


def test_min_execution_percentage_above_one_names_the_fraction_form():
    info = tt.inspect(mlp(), [torch.randn(8)], number_of_iterations=1, warmup_iterations=0)
    with pytest.raises(ConfigError, match=r"fraction.*0.1 means 10 %.*for 10 % write 0.1"):
        info.get_modules(min_execution_percentage=10)
    assert info.get_modules(min_execution_percentage=1) == []  # 100 % of the time is never reached by a child


def test_default_strategy_is_reported_and_the_reference_constant_explains(caplog):
    module = tt.Module(mlp(), name="mlp")
    with caplog.at_level(logging.INFO, logger="torch_tweak"):
        tt.tune(module, [torch.randn(8)], dry_run=True)
    assert any("FirstWinsStrategy([OpenVINO, Inductor])" in r.message for r in caplog.records)
    from torch_tweak.torch.module import wrapper_module

    with pytest.raises(ConfigError, match="HighestThroughputStrategy"):
        wrapper_module.DEFAULT_STRATEGY  # noqa: B018


def test_default_device_is_cpu():
    assert tt.config.default_device == "cpu"
    module = tt.Module(mlp(), name="mlp", strategy=eager())
    assert tt.tune(module, [torch.randn(8)]).device == "cpu"


def test_storage_options_that_need_another_format_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="compress_checkpoint"):
        tt.LocalTorchStorage(compress_checkpoint=False)
    with pytest.raises(ConfigError, match="SHA-256"):
        tt.LocalTorchStorage(sha_type="512")
    with pytest.raises(ConfigError, match="checkpoint_path"):
        tt.Storage(save_tasks=[object()])
    with pytest.raises(ConfigError, match="tt.Storage"):
        tt.save(mlp(), tmp_path / "x.tt", storage="checkpoints")
    module = tt.Module(mlp(), name="mlp", strategy=eager())
    tt.tune(module, [torch.randn(8)])
    keep = tt.LocalTorchStorage(tmp_path, overwrite_checkpoint_on_tune=False)
    tt.save(module, "m.tt", storage=keep)
    with pytest.raises(CheckpointError, match="overwrite_checkpoint_on_tune"):
        tt.save(module, "m.tt", storage=keep)


def test_unknown_device_map_names_still_fail(tmp_path):
    module = tt.Module(mlp(), name="mlp", strategy=eager())
    tt.tune(module, [torch.randn(8)])
    tt.save(module, tmp_path / "m.tt")
    with pytest.raises(CheckpointError, match=r"\"\" stands for all"):
        tt.load(mlp(), tmp_path / "m.tt", device_map={"encoder": "cpu"})


def test_strategy_settings_the_reference_allows_but_torch_tweak_cannot_map():
    with pytest.raises(ConfigError, match="ProfilingConfig"):
        tt.FirstWinsStrategy().set_find_max_batch_size_profiling_config({"batch_sizes": [1, 2]})
    with pytest.raises(ConfigError, match="Backend subclass"):
        tt.OneBackendStrategy(TorchEagerBackend()).set_find_max_batch_size_default_backend_class(TorchEagerBackend())
    with pytest.raises(ConfigError, match="measurement_stop_strategy"):
        tt.HighestThroughputStrategy(measurement_stop_strategy=object())
    with pytest.raises(ConfigError, match="profiling_stop_strategy"):
        tt.HighestThroughputStrategy(profiling_stop_strategy=object())


def test_enable_recording_of_a_tuned_module_needs_force():
    module = tt.Module(mlp(), name="mlp", strategy=eager())
    tt.tune(module, [torch.randn(8)])
    with pytest.raises(TuningError, match="force=True"):
        module.enable_recording()


def test_environment_switches(monkeypatch, caplog, capsys, tmp_path):
    for variable in ("TORCH_TWEAK_CONSOLE_OUTPUT", "TORCH_TWEAK_SYSTEM_MONITOR", "TORCH_TWEAK_INSPECT_DEBUG"):
        monkeypatch.setenv(variable, "1")
    tt.config.reset()  # the defaults are read from the environment
    assert tt.config.console_output and tt.config.system_monitor and tt.config.inspect_debug
    with capture_output(tmp_path / "build.log", console=True):
        print("compiler says hello")
    assert "compiler says hello" in capsys.readouterr().out
    assert "compiler says hello" in (tmp_path / "build.log").read_text()
    with caplog.at_level(logging.DEBUG, logger="torch_tweak"):
        tt.inspect(mlp(), [torch.randn(8)], number_of_iterations=1, warmup_iterations=0)
        assert any("inspect visits" in r.message for r in caplog.records)
        module = tt.Module(mlp(), name="mlp", strategy=eager())
        caplog.clear()
        tt.tune(module, [torch.randn(8)])
    assert any(r.levelno == logging.INFO and "System resources" in r.message for r in caplog.records)
    monkeypatch.setenv("TORCH_TWEAK_CONSOLE_OUTPUT", "maybe")
    with pytest.raises(ConfigError, match="TORCH_TWEAK_CONSOLE_OUTPUT"):
        tt.config.reset()
