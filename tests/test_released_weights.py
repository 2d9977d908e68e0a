"""Weights released after tuning keep answering placement questions (device, dtype, shapes, state_dict keys)
and refuse, with a clear error, anything that needs their values."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError, ReleasedWeightError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.testing import OwnCopyBackend


def own_copy() -> tt.OneBackendStrategy:
    return tt.OneBackendStrategy(OwnCopyBackend())


def placement(module: nn.Module) -> list[tuple[str, str, torch.dtype, tuple[int, ...], bool]]:
    return [(n, t.device.type, t.dtype, tuple(t.shape), t.requires_grad)
            for n, t in module.state_dict(keep_vars=True).items()]


def test_released_weights_keep_device_dtype_shape_and_keys():
    model = mlp()
    model[0].register_buffer("scale", torch.ones(16, dtype=torch.float64))
    before = placement(model)
    count = sum(p.numel() for p in model.parameters())
    x = torch.randn(2, 8)
    expected = model(x)
    wrapped = tt.Module(model, name="released_mlp", strategy=own_copy())
    tt.tune(wrapped, [torch.randn(8)] * 2)
    assert placement(model) == before
    assert all(type(t).__name__ == "ReleasedTensor" for t in model.state_dict().values())
    assert isinstance(model[0].weight, nn.Parameter)
    assert sum(p.numel() for p in wrapped.parameters()) == count
    model.to("cpu").eval().requires_grad_(False)  # no-ops keep working
    assert torch.allclose(wrapped(x), expected)


@pytest.mark.parametrize("use", [
    lambda w: w + 1,
    lambda w: w.clone(),
    lambda w: w.half(),
    lambda w: w.tolist(),
    lambda w: w.numpy(),
    lambda w: torch.save({"w": w}, io.BytesIO()),
], ids=["arithmetic", "clone", "dtype", "tolist", "numpy", "torch.save"])
def test_using_released_values_raises_a_clear_error(use):
    model = mlp()
    wrapped = tt.Module(model, name="released_values", strategy=own_copy())
    tt.tune(wrapped, [torch.randn(8)] * 2)
    with pytest.raises(ReleasedWeightError, match=r"'released_values' tensor '0.weight'.*device_after_tuning = None"):
        use(model[0].weight)


def test_safetensors_and_original_forward_refuse_released_weights():
    safetensors = pytest.importorskip("safetensors.torch")
    model = mlp()
    wrapped = tt.Module(model, name="released_st", strategy=own_copy())
    tt.tune(wrapped, [torch.randn(8)] * 2)
    with pytest.raises(ReleasedWeightError, match="released after tuning"):
        safetensors.save(model.state_dict())
    with pytest.raises(ReleasedWeightError):
        nn.Sequential.forward(model, torch.randn(1, 8))


class TiedOutside(nn.Module):
    """An embedding inside the wrapped body shares its weight with a head outside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.body[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(ids))


def test_tensor_shared_with_an_unwrapped_module_stays_usable_there():
    model = TiedOutside().eval()
    ids = torch.randint(0, 20, (2, 5))
    expected = model(ids)
    model.body = tt.Module(model.body, name="tied_body", strategy=own_copy())
    tt.tune(model, [torch.randint(0, 20, (5,)) for _ in range(2)])
    assert type(model.body.wrapped[0].weight).__name__ == "ReleasedTensor"
    assert type(model.head.weight) is nn.Parameter
    torch.testing.assert_close(model(ids), expected)


def test_nested_wrapped_module_keeps_its_weights():
    from torch_tweak.torch.module.forward import is_intercepted
    from torch_tweak.torch.module.released import release

    model = mlp()
    inner = tt.Module(model[0], name="nested_inner", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(inner, [torch.randn(8)] * 2)
    assert release(model, "nested_outer", keep=is_intercepted) == 2  # what tuning the outer module would do
    assert type(model[2].weight).__name__ == "ReleasedTensor"
    assert type(inner.wrapped.weight) is nn.Parameter
    x = torch.randn(3, 8)
    torch.testing.assert_close(inner(x), x @ inner.wrapped.weight.T + inner.wrapped.bias)


def test_device_after_tuning_values():
    with pytest.raises(ConfigError, match="'release' frees the weights' memory"):
        tt.config.device_after_tuning = "gpu"
    tt.config.device_after_tuning = "meta"
    model = mlp()
    wrapped = tt.Module(model, name="moved_to_meta", strategy=own_copy())
    tt.tune(wrapped, [torch.randn(8)] * 2)
    assert next(model.parameters()).device.type == "meta"
    assert wrapped(torch.randn(2, 8)).shape == (2, 4)


_RSS_CHILD = textwrap.dedent("""
    import gc, sys, torch
    import torch_tweak.torch as tt
    from torch_tweak.torch.backend import TorchEagerBackend

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    class Drop(TorchEagerBackend):  # holds no weights: what stays resident after tuning is what tuning kept
        requires_original_module = False

        def _build(self, module, graph_spec, data, cache_dir):
            self._graph_spec, self._forward = graph_spec, lambda x: x * 0
            return self

    tt.config.device_after_tuning = None if sys.argv[1] == "keep" else sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(32)]).eval()  # 128 MiB
    wrapped = tt.Module(model, name="big", strategy=tt.OneBackendStrategy(
        Drop(), fidelity=tt.FidelityConfig(check_non_finite=False, metric=lambda ref, out: 1.0, threshold=0.5)))
    tt.tune(wrapped, [torch.randn(1024)] * 2, batch_sizes=[1])
    gc.collect()
    print(rss_mib(), model[0].weight.device.type)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_released_weights_free_resident_memory(tmp_path):
    def child(mode: str) -> tuple[float, str]:
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, mode], capture_output=True, text=True, timeout=300,
                             env={"TT_TEST": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert out.returncode == 0, out.stderr[-2000:]
        rss, device = out.stdout.split()[-2:]
        return float(rss), device

    kept, kept_device = child("keep")
    released, released_device = child("release")
    assert kept_device == released_device == "cpu"
    assert released < kept - 64, (released, kept)  # of 128 MiB of weights, the allocator may keep some cached
