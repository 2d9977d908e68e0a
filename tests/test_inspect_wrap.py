"""tt.inspect finds and times modules; tt.wrap installs proxies in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from toy_models import Pipeline

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import TorchEagerBackend


class Heavy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        self.small = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(self.big(x))


class Pipe:
    """A pipeline object: modules in an attribute, a dict and a list; one module reachable twice."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Heavy()
        self.parts = {"post": nn.Linear(64, 8)}
        self.steps = [nn.ReLU()]
        self.alias = self.model
        self.unused = nn.Linear(3, 3)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.steps[0](self.parts["post"](self.model(x)))


class Broken(Pipe):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.model(x)
        raise RuntimeError("pipeline failure")


def data():
    return [torch.randn(64) for _ in range(3)]


def test_inspect_times_modules_and_restores_hooks():
    pipe = Pipe()
    report = tt.inspect(pipe, data(), number_of_iterations=4, warmup_iterations=1)
    names = {m.name: m for m in report.modules}
    assert "alias" not in names and "unused" in names  # visited once, found even if not executed
    model = names["model"]
    assert model.calls == 4 and model.total_time_s > 0 and model.depth == 1
    assert names["model.big"].depth == 2 and names["model.big"].parent == "model"
    assert names["unused"].calls == 0
    assert not pipe.model._forward_hooks and not pipe.model._forward_pre_hooks
    table = report.table()
    for column in ("module", "calls", "total ms", "mean ms", "share %", "params", "precisions", "model.big"):
        assert column in table


def test_get_modules_outermost_first_with_min_depth_and_filters():
    pipe = Pipe()
    report = tt.inspect(pipe, data(), number_of_iterations=3, warmup_iterations=0)
    top = [m.name for m in report.get_modules()]
    assert top[0] == "model" and set(top) == {"model", "parts['post']", "steps[0]"}
    assert [m.name for m in report.get_modules(limit=1)] == ["model"]
    assert [m.name for m in report.get_modules(min_execution_percentage=0.5)] == ["model"]  # a fraction: 50 %
    deeper = tt.inspect(pipe.model, data(), number_of_iterations=2, warmup_iterations=0, min_depth=1)
    assert [m.name for m in deeper.get_modules()] == ["big", "small"]
    for bad in ({"min_execution_percentage": 1.5}, {"min_execution_percentage": -1}, {"limit": 0}, {"limit": 1.5}):
        with pytest.raises(ConfigError):
            report.get_modules(**bad)
    with pytest.raises(ConfigError, match=r"0.1 means 10 %.*for 5 % write 0.05"):
        report.get_modules(min_execution_percentage=5)


def test_inspect_bad_arguments():
    with pytest.raises(ConfigError, match="number_of_iterations"):
        tt.inspect(Pipe(), data(), number_of_iterations=0)
    with pytest.raises(ConfigError, match="not callable"):
        tt.inspect(object(), data())


def test_pipeline_error_propagates_and_nothing_stays_patched():
    pipe = Broken()
    with pytest.raises(RuntimeError, match="pipeline failure"):
        tt.inspect(pipe, data(), number_of_iterations=2, warmup_iterations=0)
    for module in (pipe.model, pipe.model.big, pipe.parts["post"]):
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_wrap_installs_proxies_in_attributes_dicts_and_lists_and_tunes():
    pipe = Pipe()
    reference = pipe(torch.ones(2, 64))
    report = tt.inspect(pipe, data(), number_of_iterations=2, warmup_iterations=0)
    hand = tt.Module(pipe.steps[0], name="by_hand", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    pipe.steps[0] = hand
    result = tt.wrap(pipe, report.get_modules(), strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    assert result is pipe
    assert isinstance(pipe.model, tt.Module) and pipe.model.name == "model"
    assert isinstance(pipe.parts["post"], tt.Module)
    assert pipe.steps[0] is hand
    tuned = tt.tune(pipe, data())
    assert {m.name for m in tuned.modules} == {"model", pipe.parts["post"].name, "by_hand"}
    assert torch.allclose(pipe(torch.ones(2, 64)), reference)


def test_wrap_root_module_returns_proxy():
    model = Pipeline()
    report = tt.inspect(model, [torch.randn(8)], number_of_iterations=1, warmup_iterations=0)
    (root,) = report.get_modules()
    wrapped = tt.wrap(model, [root])
    assert isinstance(wrapped, tt.Module) and wrapped.wrapped is model and wrapped.name == "Pipeline"


def test_wrap_bad_input():
    pipe = Pipe()
    with pytest.raises(ConfigError, match="not reachable"):
        tt.wrap(pipe, [nn.Linear(2, 2)])
    with pytest.raises(ConfigError, match="inside 'model'"):
        tt.wrap(pipe, [pipe.model, pipe.model.big])
    with pytest.raises(ConfigError, match="Only one of strategy or strategies"):
        tt.wrap(pipe, [pipe.model], strategy=tt.FirstWinsStrategy(), strategies=[tt.FirstWinsStrategy()])
