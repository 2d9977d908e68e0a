"""Lean imports and global settings."""

from __future__ import annotations

import subprocess
import sys

import pytest

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError, TorchTweakError


def test_import_does_not_load_heavy_dependencies():
    code = (
        "import sys, torch_tweak; assert 'torch' not in sys.modules, 'torch_tweak imported torch';"
        "import torch_tweak.torch, torch_tweak.torch.backend;"
        "bad = [m for m in ('openvino', 'torchao', 'onnxruntime', 'onnx', 'onnxscript', 'nncf') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_openvino_int8_configs_do_not_import_nncf():
    """NNCF is imported only when a quantized candidate builds (not for configs, default variants or loading)."""
    code = (
        "import sys; import torch_tweak.torch;"
        "from torch_tweak.torch.backend.openvino import OpenVINOBackend, OpenVINOBackendConfig, quantize;"
        "variants = [b.describe() for b in OpenVINOBackend.default_variants()];"
        "OpenVINOBackend(OpenVINOBackendConfig(quantization='int8')).describe();"
        "assert 'nncf' not in sys.modules, 'nncf was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_surface():
    for name in ("Module", "tune", "config", "TuningReport", "FirstWinsStrategy", "OneBackendStrategy", "TuneStrategy"):
        assert name in tt.__all__ and hasattr(tt, name)
    assert tt.__all__ == sorted(tt.__all__)


def test_config_validation():
    with pytest.raises(ConfigError, match="max_num_samples_stored"):
        tt.config.max_num_samples_stored = 0
    with pytest.raises(ConfigError, match="strict_mode"):
        tt.config.strict_mode = "yes"
    with pytest.raises(ConfigError, match="Unsupported device"):
        tt.config.default_device = "cuda"
    with pytest.raises(ConfigError, match="no setting"):
        tt.config.cache_directory = "/tmp"
    with pytest.raises(ConfigError, match="on_unknown_signature"):
        tt.config.on_unknown_signature = "ignore"
    tt.config.default_device = "XPU"
    assert tt.config.default_device == "xpu:0"


def test_errors_subclass_builtins():
    from torch_tweak import errors

    assert issubclass(errors.BackendStateError, RuntimeError)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.UnsupportedInputError, TypeError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), TorchTweakError)


def test_int8_kernels_saturate_on_x86_without_vnni_or_amx(monkeypatch):
    from torch_tweak.torch import environment

    cases = [({"sse4_1", "avx2", "fma"}, True), ({"sse4_1", "avx2", "avx512f", "avx512_vnni"}, False),
             ({"sse4_1", "avx2", "avx_vnni"}, False), ({"sse4_1", "avx2", "amx_tile", "amx_int8"}, False),
             ({"asimd", "sve"}, False), (None, False)]
    for flags, expected in cases:
        info = environment.CpuInfo("test CPU", None if flags is None else frozenset(flags), 2)
        monkeypatch.setattr(environment, "cpu_info", lambda info=info: info)
        assert environment.int8_dot_saturates() is expected, flags
