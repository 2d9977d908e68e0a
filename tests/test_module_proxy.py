"""tt.Module is a transparent proxy that intercepts every call path."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from toy_models import Pipeline, mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError, UnsupportedInputError
from torch_tweak.torch.backend import TorchEagerBackend


def eager() -> tt.OneBackendStrategy:
    return tt.OneBackendStrategy(TorchEagerBackend())


def test_proxy_is_transparent():
    model = mlp()
    wrapped = tt.Module(model, name="mlp")
    assert isinstance(wrapped, nn.Sequential) and isinstance(wrapped, nn.Module)
    assert isinstance(wrapped, tt.Module)
    assert len(wrapped) == 3 and isinstance(wrapped[0], nn.Linear)
    assert [type(m) for m in wrapped] == [nn.Linear, nn.ReLU, nn.Linear]
    assert wrapped.state_dict().keys() == model.state_dict().keys()
    wrapped.extra_attribute = 5
    assert model.extra_attribute == 5
    assert wrapped.training is False
    assert wrapped.wrapped is model
    assert "mlp" in repr(wrapped)


def test_calls_through_parent_and_other_references_are_intercepted():
    pipe = Pipeline()
    raw_encoder = pipe.encoder
    pipe.encoder = tt.Module(pipe.encoder, name="encoder", strategy=eager())
    assert isinstance(pipe._modules["encoder"], tt.Module)
    tt.tune(pipe, [torch.randn(8) for _ in range(2)])
    assert pipe.encoder.state is tt.ModuleState.TUNED
    x = torch.randn(3, 8)
    backend = pipe.encoder.backends["0"]
    calls = []
    original_infer = backend._infer
    backend._infer = lambda *a, **k: calls.append(1) or original_infer(*a, **k)
    pipe(x)
    raw_encoder(x)
    assert len(calls) == 2


def test_forward_hooks_run_once_per_call_in_every_state():
    model = mlp()
    counts = {"pre": 0, "post": 0}
    wrapped = tt.Module(model, strategy=eager())
    wrapped.register_forward_pre_hook(lambda m, a: counts.__setitem__("pre", counts["pre"] + 1))
    wrapped.register_forward_hook(lambda m, a, o: counts.__setitem__("post", counts["post"] + 1))
    wrapped(torch.randn(1, 8))
    assert counts == {"pre": 1, "post": 1}
    tt.tune(wrapped, [torch.randn(8)] * 2, batch_sizes=[1, 2])
    before = dict(counts)
    wrapped(torch.randn(2, 8))
    assert counts == {"pre": before["pre"] + 1, "post": before["post"] + 1}


def test_hook_can_modify_output_after_tuning():
    wrapped = tt.Module(mlp(), strategy=eager())
    tt.tune(wrapped, [torch.randn(8)] * 2)
    wrapped.register_forward_hook(lambda m, a, o: o * 0)
    assert torch.count_nonzero(wrapped(torch.randn(1, 8))) == 0


def test_explicit_names_must_be_unique():
    first = tt.Module(mlp(), name="same")
    with pytest.raises(ConfigError, match="already exists"):
        tt.Module(mlp(), name="same")
    assert first.name == "same"


def test_default_names_are_made_unique():
    a, b = tt.Module(nn.Linear(2, 2)), tt.Module(nn.Linear(2, 2))
    assert a.name != b.name
    assert a.name.startswith("torch.nn.modules.linear.Linear")


def test_wrapping_twice_is_refused():
    model = mlp()
    wrapped = tt.Module(model)
    with pytest.raises(ConfigError, match="already"):
        tt.Module(model)
    with pytest.raises(ConfigError, match="already a tt.Module"):
        tt.Module(wrapped)


def test_bad_constructor_arguments():
    with pytest.raises(UnsupportedInputError):
        tt.Module(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Only one of strategy or strategies"):
        tt.Module(mlp(), strategy=eager(), strategies=[eager()])
    with pytest.raises(ConfigError, match="TuneStrategy"):
        tt.Module(mlp(), strategy="fast")
    with pytest.raises(ConfigError):
        tt.Module(mlp(), name="  ")


def test_calls_outside_tuning_run_the_original_module():
    model = mlp()
    wrapped = tt.Module(model)
    x = torch.randn(2, 8)
    assert torch.equal(wrapped(x), nn.Sequential.forward(model, x))
    assert wrapped.state is tt.ModuleState.INIT



def test_a_tuned_proxy_call_skips_nn_module_call_only_while_no_hook_could_see_the_difference(monkeypatch):
    model, reference = mlp(), mlp()
    wrapped = tt.Module(model, strategy=eager())
    tt.tune(wrapped, [torch.randn(8)] * 2, batch_sizes=[1, 2])
    through = []
    monkeypatch.setattr(nn.Module, "__call__", lambda self, *a, **k: through.append(self) or self._call_impl(*a, **k))
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), reference(x))
        assert all(m is not model for m in through)  # straight to the dispatcher
        seen = []
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
        try:
            torch.testing.assert_close(wrapped(x), reference(x))
        finally:
            handle.remove()
        assert any(m is model for m in through) and "Sequential" in seen  # the hook sees the wrapped module's call
        through.clear()
        wrapped(x)
        assert all(m is not model for m in through)


def test_calls_go_through_the_module_when_its_forward_was_replaced_or_a_trace_runs():
    from torch_tweak.torch.module import forward as _forward

    model = mlp()
    tt.Module(model, strategy=eager())
    interceptor = model.__dict__["forward"]
    assert _forward.calls_straight_through(model, interceptor)
    assert not _forward.calls_straight_through(model, lambda *a: None)  # not the forward installed on the module
    during_trace = []

    def traced(x):
        during_trace.append(_forward.calls_straight_through(model, interceptor))
        return x * 2

    torch.jit.trace(traced, torch.randn(2), check_trace=False)
    assert during_trace and not any(during_trace)
