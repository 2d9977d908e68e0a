"""The non-finite guard: a backend that maps NaN/inf differently from eager stays usable, and the rule holds.

A candidate that passes the recorded samples but fails a non-finite probe is wrapped in a
NonFiniteGuardBackend (the default, ``FidelityConfig(non_finite="guard")``): finite calls go to the
candidate, calls with NaN/inf inputs run the module's original forward. These tests cover the choice by a
strategy, the per-call routing, the state machine, checkpoints (in a fresh process, inside a batch router,
and crafted ones whose nested backends the audit must still check).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import logging
import math

import numpy as np
import pytest
import torch
from checkpoint_helpers import rewrite, save_mlp
from test_checkpoint import run_fresh
from test_measuring_strategies import strategy, tune
from torch import nn
from toy_models import cnn, mlp

import torch_tweak.torch as tt
from torch_tweak.errors import BackendStateError, CheckpointError, ConfigError
from torch_tweak.torch.backend import BatchRouterBackend, NonFiniteGuardBackend, TorchEagerBackend
from torch_tweak.torch.checkpoint import verify
from torch_tweak.torch.checkpoint.codec import components
from torch_tweak.torch.fidelity import FidelityConfig
from torch_tweak.torch.module.recording import record
from torch_tweak.torch.module.serving import note_state_change
from torch_tweak.torch.module.state import internals
from torch_tweak.torch.testing import FakeClock, NaNToZeroBackend, TimedBackend
from torch_tweak.torch.tune_strategy import TuneStrategy

HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
GUARD_CLASS = "torch_tweak.torch.backend.non_finite_guard:NonFiniteGuardBackend"


def needs_openvino(test):
    return pytest.mark.openvino(pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed")(test))


@pytest.fixture
def clock():
    return FakeClock()


def relu_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


def poisoned(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x[1] = value
    return x


def assert_like_eager(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], atol=2e-2, rtol=2e-2)


def openvino(**config):
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    return OpenVINOBackend(OpenVINOBackendConfig(**config))


# chosen by a strategy ----------------------------------------------------------------------------------


@needs_openvino
def test_openvino_relu_mlp_is_kept_behind_the_guard_and_serves_non_finite_rows_like_eager(monkeypatch, caplog):
    model, reference = relu_mlp(), relu_mlp()
    wrapped = tt.Module(model, name="relu_mlp_guarded", strategy=tt.OneBackendStrategy(openvino()))
    report = tt.tune(wrapped, [torch.randn(16) for _ in range(4)], batch_sizes=[1, 4])
    (row,) = report.modules[0].graphs[0].candidates
    (guard,) = wrapped.backends.values()
    assert isinstance(guard, NonFiniteGuardBackend) and type(guard.inner).__name__ == "OpenVINOBackend"
    assert row.status == "chosen" and row.backend == guard.describe() == f"{guard.inner.describe()} + non-finite guard"
    assert report.modules[0].graphs[0].chosen == row.backend
    assert {p["status"] for p in row.fidelity["non_finite"]} == {"guarded"}
    assert not internals(wrapped).offloaded  # the guard runs the module's own weights, so they stay
    served = []
    run = guard.inner._runner._run
    monkeypatch.setattr(guard.inner._runner, "_run", lambda arrays: served.append(len(arrays[0])) or run(arrays))
    note_state_change()  # the module makes its serving functions again, now through the counter
    # a one-tensor call is checked on the array the runner feeds OpenVINO, not on a second view of the tensor
    checked = guard.inner.checked_serving(lambda a: True, None, None)
    assert checked is not None and guard.serving().__qualname__ == checked.__qualname__
    x = torch.randn(4, 16)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="torch_tweak.torch.backend.non_finite_guard"):
        assert_like_eager(wrapped(x), reference(x))
        assert_like_eager(wrapped(x[:1]), reference(x[:1]))
        assert served == [4, 1] and guard.diverted_calls == 0
        for value in (math.nan, math.inf, -math.inf):
            assert_like_eager(wrapped(poisoned(x, value)), reference(poisoned(x, value)))
        assert wrapped(poisoned(x, math.nan))[1].isnan().all()  # invalid input stays invalid
    assert served == [4, 1] and guard.diverted_calls == 4
    warnings = [r.getMessage() for r in caplog.records if "runs the module's original code" in r.getMessage()]
    assert len(warnings) == 1 and "does not propagate NaN/inf" in warnings[0] and "fidelity probe" in warnings[0]


@needs_openvino
def test_openvino_relu_mlp_is_rejected_when_asked():
    wrapped = tt.Module(relu_mlp(), name="relu_mlp_rejected", strategy=tt.OneBackendStrategy(
        openvino(), fidelity=FidelityConfig(non_finite="reject")))
    report = tt.tune(wrapped, [torch.randn(16) for _ in range(4)], batch_sizes=[1, 4])
    (row,) = report.modules[0].graphs[0].candidates
    assert row.status == "rejected" and "does not propagate NaN like eager" in row.error
    assert report.modules[0].status == "passthrough" and "guard" not in row.backend


class _Bf16NaNToZero(TimedBackend):
    """Fast, 'bf16', exact on finite inputs but NaN becomes 0 (like OpenVINO's ReLU); has an f32 variant."""

    @property
    def executed_precision(self) -> str:
        return "bf16"

    def _infer(self, *args, **kwargs):
        return torch.nan_to_num(super()._infer(*args, **kwargs), nan=0.0)

    def precision_fallback(self):
        return TimedBackend(self.clock, ms_per_call=self.timing.ms_per_call * 2, label="f32")


@pytest.mark.parametrize("mode", ["guard", "reject"])
def test_measuring_strategy_measures_and_chooses_the_guarded_candidate_without_a_precision_retry(clock, mode):
    fast = _Bf16NaNToZero(clock, ms_per_call=0.2)
    strat = strategy(tt.HighestThroughputStrategy, clock, [fast], eager_ms=1.0,
                     fidelity=FidelityConfig(non_finite=mode))
    wrapped, _, graph = tune(strat)
    statuses = [(c.backend, c.status) for c in graph.candidates]
    if mode == "guard":
        assert statuses[1:] == [(f"{fast.describe()} + non-finite guard", "chosen")]  # no f32 retry
        assert graph.chosen == statuses[1][0] and graph.candidates[1].measurements["selection"]["throughput"] > 0
        x = poisoned(torch.randn(3, 8), math.nan)
        with torch.no_grad():
            assert torch.equal(wrapped(x).isnan(), mlp()(x).isnan())
    else:  # a probe rejection may come from reduced precision (int8 scales), so the f32 variant is tried
        assert statuses[1:] == [(fast.describe(), "rejected"), ("TimedBackend(ms_per_call=0.4,label=f32)", "chosen")]


# the backend itself ------------------------------------------------------------------------------------


def _built_guard(tmp_path, inner=None):
    model = mlp()
    ((spec, samples),) = record(model, [(b, ((torch.randn(b, 8),), {})) for b in (1, 2, 4)])
    inner = inner or NaNToZeroBackend()
    inner.build(model, spec, [s.sample for s in samples], torch.device("cpu"), tmp_path / "inner")
    return model, spec, NonFiniteGuardBackend(inner, model, spec, "test reason")


def test_guard_arguments_state_machine_and_description(tmp_path):
    model, spec, guard = _built_guard(tmp_path)
    inner = guard.inner
    assert guard.state.value == "active" and guard.components() == [guard, inner]
    assert guard.requires_original_module and guard.runtime == inner.runtime and guard.executed_precision == "fp32"
    assert guard.describe() == "NaNToZeroBackend() + non-finite guard"
    assert guard.key().startswith("NonFiniteGuardBackend_") and guard.key() != inner.key()
    assert guard.key() == NonFiniteGuardBackend(inner, model, spec).key()
    with pytest.raises(ConfigError, match="not itself guarded"):
        NonFiniteGuardBackend(guard, model, spec)
    with pytest.raises(ConfigError, match="needs the wrapped nn.Module"):
        NonFiniteGuardBackend(inner, None, spec)  # type: ignore[arg-type]
    with pytest.raises(BackendStateError, match="needs a built and active backend"):
        NonFiniteGuardBackend(TorchEagerBackend(), model, spec)
    with pytest.raises(BackendStateError, match="assembled by a strategy"):
        guard._build(model, spec, [], tmp_path)
    guard.deactivate()
    assert inner.state.value == "inactive" and guard.state.value == "inactive"
    with pytest.raises(BackendStateError):
        guard.infer(torch.randn(2, 8))
    guard.activate()
    x = poisoned(torch.randn(3, 8), math.nan)
    assert inner.state.value == "active" and torch.equal(guard.infer(x).isnan(), model(x).isnan())
    assert not guard.infer(x).isnan().all() and not inner.infer(x).isnan().any()  # the inner one hides NaN
    guard.release()
    assert inner.state.value == "inactive"


def test_guard_checks_every_floating_input_without_walking_plain_tensor_calls():
    from torch_tweak.torch.backend.non_finite_guard import all_finite, call_tensors

    a, ids = torch.randn(2, 3), torch.arange(3)
    assert [t is u for t, u in zip(call_tensors((a,), {"ids": ids}), [a, ids], strict=True)] == [True, True]
    assert call_tensors((a,), {}) is not None and call_tensors((a,), {})[0] is a
    assert [t is a for t in call_tensors(([a, None],), {"scale": 2.0})] == [True]  # nested: flattened once
    large = torch.randn(4, 3, 64, 64, requires_grad=True)  # checked by numpy (torch's sum would wake its pool)
    assert all_finite([a, ids, large, large.bfloat16()]) and all_finite([torch.zeros(0)])
    for value in (math.nan, math.inf, -math.inf):
        for t in (a, a.t(), large.detach(), large.detach()[:, :, ::2]):  # small (also strided), large (also strided)
            for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
                assert not all_finite([ids, poisoned(t, value).to(dtype)]), (t.shape, dtype, value)
    assert all_finite([torch.full((64, 64), 60000.0).half()])  # 16-bit inputs are summed in float32: no overflow
    assert all_finite([torch.full((2, 3), 1e18), torch.full((2, 3), -1e150, dtype=torch.float64)])  # squares fit
    # the same test on the numpy view a backend feeds its runtime (the guard's short path)
    from torch_tweak.torch.backend.non_finite_guard import array_finite

    assert array_finite(np.arange(3)) and array_finite(np.full((2, 2), 60000.0, dtype=np.float16))
    for value in (math.nan, math.inf, -math.inf):
        for t in (a, large.detach()):
            for dtype in (torch.float32, torch.float64, torch.float16):
                assert not array_finite(poisoned(t, value).to(dtype).numpy()), (t.shape, dtype, value)
                assert array_finite(t.to(dtype).numpy())


def test_guard_round_trips_through_to_dict_and_from_dict(tmp_path):
    model, spec, guard = _built_guard(tmp_path)
    state = guard.to_dict()
    assert state["inner"]["backend_type"] == "NaNToZeroBackend" and state["reason"] == "test reason"
    assert [t for t, _, _ in components("NonFiniteGuardBackend", GUARD_CLASS, state)] == [
        "NonFiniteGuardBackend", "NaNToZeroBackend"]
    loaded = NonFiniteGuardBackend.from_dict(model, copy.deepcopy(state))
    assert loaded.state.value == loaded.inner.state.value == "checkpoint_loaded" and loaded.reason == "test reason"
    loaded.deploy("cpu")
    assert loaded.state.value == loaded.inner.state.value == "deployed"
    x = poisoned(torch.randn(3, 8), math.inf)
    assert_like_eager(loaded.infer(x), model(x))
    with pytest.raises(ValueError, match="needs the original module"):
        NonFiniteGuardBackend.from_dict(None, state)
    for broken in ({"inner": None}, {"inner": dict(state["inner"], backend_type="NonFiniteGuardBackend")},
                   {"inner": dict(state["inner"], state="x")}, {"reason": 3}):
        with pytest.raises(ValueError, match="inner backend|reason"):
            NonFiniteGuardBackend.from_dict(model, {**state, **broken})


# checkpoints -------------------------------------------------------------------------------------------


@needs_openvino
def test_guarded_openvino_module_serves_nan_rows_like_eager_in_a_fresh_process(tmp_path):
    reference = cnn()
    wrapped = tt.Module(cnn(), name="cnn_fresh", strategy=tt.OneBackendStrategy(openvino(inference_precision="f32")))
    tt.tune(wrapped, [torch.randn(3, 8, 8) for _ in range(4)], batch_sizes=[1, 4])
    assert isinstance(wrapped.backends["0"], NonFiniteGuardBackend)
    x = torch.randn(4, 3, 8, 8)
    inputs = [x, poisoned(x, math.nan), poisoned(x, math.inf), x[:1].clone()]
    tt.save(wrapped, tmp_path / "cnn.tt")
    outputs, info = run_fresh("cnn", tmp_path / "cnn.tt", inputs, tmp_path)
    with torch.no_grad():
        for got, x in zip(outputs, inputs):
            assert_like_eager(got, reference(x))
    assert outputs[1][1].isnan().all() and outputs[0].isfinite().all()
    assert info["backends"] == {"cnn_fresh": ["NonFiniteGuardBackend"]} and info["states"] == {"cnn_fresh": "TUNED"}
    assert not info["offloaded"]["cnn_fresh"] and sum(info["compiles"].values()) == 0


class _Hints(TuneStrategy):
    def _tune(self, task):
        backends = [self.try_backend(openvino(performance_hint=h, inference_precision="f32"), task)[0]
                    for h in ("LATENCY", "THROUGHPUT")]
        return BatchRouterBackend([(1, backends[0]), (None, backends[1])], task.graph_spec)


@needs_openvino
def test_guards_inside_router_routes_round_trip(tmp_path):
    wrapped = tt.Module(cnn(), name="cnn_routed", strategy=_Hints())
    tt.tune(wrapped, [torch.randn(3, 8, 8) for _ in range(4)], batch_sizes=[1, 4])
    assert all(isinstance(b, NonFiniteGuardBackend) for _, b in wrapped.backends["0"].routes)
    tt.save(wrapped, tmp_path / "cnn.tt")
    assert verify(tmp_path / "cnn.tt")["modules"][0]["graphs"][0]["backend"] == "BatchRouterBackend"
    del wrapped
    gc.collect()
    loaded = tt.load(cnn(seed=5), tmp_path / "cnn.tt")  # the checkpoint's weights serve the diverted calls
    (router,) = loaded.backends.values()
    assert [b.describe().endswith(" + non-finite guard") for _, b in router.routes] == [True, True]
    assert {b.state.value for _, b in router.routes} == {"deployed"}
    with torch.no_grad():
        for batch in (1, 4):
            x = torch.randn(batch, 3, 8, 8)
            x[0, 0, 0, 0] = math.nan
            assert_like_eager(loaded(x), cnn()(x))


def _guarded(data: dict, inner_type: str, inner_module: str, routed: bool = False, **inner_state) -> None:
    """Make the stored eager backend a guard around ``inner_type`` (inside a router's last route if ``routed``)."""
    backend = data["modules"][0]["graphs"][0]["backend"]
    eager = backend["state"]
    guard = {"type": "NonFiniteGuardBackend", "graph_spec": eager["graph_spec"], "device": "cpu", "reason": None,
             "inner": {"backend_type": inner_type, "backend_class": f"{inner_module}:{inner_type}",
                       "state": {**eager, "type": inner_type, **inner_state}}}
    backend["type"], backend["class"], backend["state"] = "NonFiniteGuardBackend", GUARD_CLASS, guard
    if routed:
        eager_route = {"backend_type": "TorchEagerBackend",
                       "backend_class": "torch_tweak.torch.backend.torch_eager:TorchEagerBackend", "state": eager}
        guard_route = {"backend_type": "NonFiniteGuardBackend", "backend_class": GUARD_CLASS, "state": guard}
        backend["state"] = {"type": "BatchRouterBackend", "graph_spec": eager["graph_spec"], "device": "cpu",
                            "routes": [{"max_batch_size": 1, **eager_route}, {"max_batch_size": None, **guard_route}]}
        backend["type"], backend["class"] = ("BatchRouterBackend",
                                             "torch_tweak.torch.backend.batch_router:BatchRouterBackend")


UNSAFE_INDUCTOR = {"config": {"fullgraph": False, "dynamic": None, "mode": None, "autocast_enabled": False,
                              "autocast_dtype": None, "options": {"cpp.cxx": "/tmp/evil.sh"}}}


@pytest.mark.parametrize("routed", [False, True])
def test_crafted_checkpoints_cannot_hide_a_backend_inside_a_guard(tmp_path, routed):
    path, x, expected = save_mlp(tmp_path / "ok.tt")
    rewrite(path, lambda d: _guarded(d, "TorchEagerBackend", "torch_tweak.torch.backend.torch_eager", routed))
    loaded = tt.load(mlp(seed=3), path)  # the honest nesting loads
    torch.testing.assert_close(loaded(x), expected)
    del loaded
    gc.collect()
    aot = ("TorchInductorAOTBackend", "torch_tweak.torch.backend.torch_inductor_aot")
    cases = [("TorchInductorBackend", "torch_tweak.torch.backend.torch_inductor", UNSAFE_INDUCTOR, True,
              "may not carry: Inductor option 'cpp.cxx'"),
             (*aot, {"config": {"options": None, "strict": False}, "package": "/tmp/model.pt2"}, True,
              "'package' is '/tmp/model.pt2', not a file inside the checkpoint"),
             (*aot, {"config": {"options": None, "strict": False}, "package": None}, False, "carries native code")]
    for i, (inner_type, module, state, audited, match) in enumerate(cases):
        bad, _, _ = save_mlp(tmp_path / f"bad{i}.tt")
        rewrite(bad, lambda d: _guarded(d, inner_type, module, routed, **state))  # noqa: B023 - called at once
        with pytest.raises(CheckpointError, match=match):
            tt.load(mlp(), bad)
        if audited:  # refused by the audit itself, even when native code is trusted
            with pytest.raises(CheckpointError, match=match):
                tt.load(mlp(), bad, trust_native_code=True)
            with pytest.raises(CheckpointError, match=match):
                verify(bad)
