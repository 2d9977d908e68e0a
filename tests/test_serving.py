"""Serving functions: a tuned call takes one precomputed path per graph, made again after any backend state change,
and answers exactly as ``infer`` does (outputs, routing, errors)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import BackendStateError, SignatureMismatchError, UnsupportedInputError
from torch_tweak.torch.backend import (
    BatchRouterBackend,
    NonFiniteGuardBackend,
    ONNXRuntimeBackend,
    OpenVINOBackend,
    TorchEagerBackend,
)
from torch_tweak.torch.module.recording import record
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.testing import FakeClock, TimedBackend

CPU = torch.device("cpu")


def _recorded(model, batches=(2, 4)):
    torch.manual_seed(1)
    ((spec, samples),) = record(model, [(b, ((torch.randn(b, 8),), {})) for b in batches])
    return spec, [s.sample for s in samples]


def _timed(clock, model, spec, tmp_path, label):
    backend = TimedBackend(clock, ms_per_call=1.0, label=label)
    backend.build(model, spec, [], CPU, tmp_path / label)
    return backend


def test_a_tuned_module_makes_its_serving_function_once_and_again_after_a_backend_state_change(monkeypatch):
    made = []
    original = TorchEagerBackend._serving

    def counted(self):
        made.append(self)
        return original(self)

    monkeypatch.setattr(TorchEagerBackend, "_serving", counted)
    model, reference = mlp(), mlp()
    wrapped = tt.Module(model, name="serving_once", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2])
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(wrapped(x), reference(x))
        assert len(made) == 1
        wrapped.deactivate()
        with pytest.raises(BackendStateError, match="should be activated first"):
            wrapped(x)
        wrapped.activate()
        torch.testing.assert_close(wrapped(x), reference(x))
    assert len(made) == 2


def test_calls_of_one_tensor_find_their_graph_by_rank_and_unknown_ranks_still_fail():
    torch.manual_seed(3)
    model = torch.nn.Linear(8, 4).eval()
    wrapped = tt.Module(model, name="by_rank", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8), torch.randn(3, 8)], batch_sizes=[1, 2])
    assert len(wrapped.graph_specs) == 2
    with torch.no_grad():
        for x in (torch.randn(2, 8), torch.randn(1, 3, 8), torch.randn(3, 8), torch.randn(2, 3, 8)):
            torch.testing.assert_close(wrapped(x), torch.nn.functional.linear(x, model.weight, model.bias))
        with pytest.raises(SignatureMismatchError, match="match none of its 2 tuned"):
            wrapped(torch.randn(8))
        with pytest.raises(SignatureMismatchError):
            wrapped(torch.randn(8))  # an unknown rank is never remembered as served


def test_a_router_serving_function_routes_like_infer_and_refuses_once_deactivated(tmp_path):
    clock, model = FakeClock(), mlp()
    spec, _ = _recorded(model)
    small, large = _timed(clock, model, spec, tmp_path, "small"), _timed(clock, model, spec, tmp_path, "large")
    router = BatchRouterBackend([(2, small), (None, large)], spec)
    serve = router.serving()
    with torch.no_grad():
        for batch, route in ((1, small), (2, small), (3, large), (9, large)):
            before = route.calls
            x = torch.randn(batch, 8)
            torch.testing.assert_close(serve(x), model(x))
            assert route.calls == before + 1
    router.deactivate()
    with pytest.raises(BackendStateError, match="should be activated first"):
        router.serving()(torch.randn(1, 8))


def test_a_guard_serving_function_diverts_non_finite_calls_to_the_module(tmp_path):
    clock, model = FakeClock(), mlp()
    spec, _ = _recorded(model)
    inner = _timed(clock, model, spec, tmp_path, "inner")
    guard = NonFiniteGuardBackend(inner, model, spec, "test", quiet=True)
    serve = guard.serving()
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(serve(x), model(x))
        x[1, 0] = float("nan")
        assert serve(x)[1].isnan().all()
    assert inner.calls == 1 and guard.diverted_calls == 1


def _runtime_backend(name: str):
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    return ONNXRuntimeBackend() if name == "onnxruntime" else OpenVINOBackend()


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_the_one_input_fast_path_answers_and_fails_like_infer(runtime, tmp_path):
    backend, model = _runtime_backend(runtime), mlp()
    spec, samples = _recorded(model)
    backend.build(model, spec, samples, CPU, tmp_path / runtime)
    serve = backend.serving()
    with torch.no_grad():
        for batch in (1, 5):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(serve(x), backend.infer(x))
            torch.testing.assert_close(serve(x), model(x), atol=0.05, rtol=0.05)  # bf16 where the CPU has it
        needs_grad = torch.randn(3, 8, requires_grad=True)  # the general path detaches it, as infer does
        torch.testing.assert_close(serve(needs_grad), backend.infer(needs_grad.detach()))
    for bad in (torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 9)):
        with pytest.raises(UnsupportedInputError) as served:
            serve(bad)
        with pytest.raises(UnsupportedInputError) as inferred:
            backend.infer(bad)
        assert str(served.value) == str(inferred.value)
    with pytest.raises(UnsupportedInputError, match="does not match graph"):
        serve(x=torch.randn(2, 8))
    backend.deactivate()
    with pytest.raises(BackendStateError):
        backend.serving()(torch.randn(2, 8))


def test_tuning_times_the_serving_function_a_tuned_module_calls(monkeypatch):
    served, checked = [0], [0]
    infer = TorchEagerBackend._infer

    def counted_serving(self):
        def serve(*args, **kwargs):
            served[0] += 1
            return infer(self, *args, **kwargs)
        return serve

    def counted_infer(self, *args, **kwargs):
        checked[0] += 1
        return infer(self, *args, **kwargs)

    monkeypatch.setattr(TorchEagerBackend, "_serving", counted_serving)
    monkeypatch.setattr(TorchEagerBackend, "_infer", counted_infer)
    fast = ProfilingConfig(warmup_calls=1, min_calls=3, window_size=3, min_time_s=0.0, max_time_s=0.05)
    strategy = tt.HighestThroughputStrategy([TorchEagerBackend()], profiling=fast)
    wrapped = tt.Module(mlp(), name="timed_served", strategy=strategy)
    report = tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2], executor="inline")
    timed = sum(run["calls"] for row in report.modules[0].graphs[0].candidates
                for run in (row.measurements or {}).get("runs", []))
    assert timed > 0 and served[0] >= timed  # every timed call went through the serving function
    assert checked[0] > 0  # fidelity checks and warm-up calls use infer
