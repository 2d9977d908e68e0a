"""NaN/inf inputs: a tuned module propagates them as eager does; a backend that does not is kept behind the
non-finite guard (the default) or rejected (``FidelityConfig(non_finite="reject")``) by the fidelity probe.

Measured on this project's CPU (OpenVINO 2026.4): OpenVINO maps NaN to a finite value in ReLU, Clamp,
Maximum, MaxPool and ReduceMax at bf16 and f32 alike, so an MLP or CNN with ReLU returns finite numbers
for a NaN row and needs the guard; without such ops (GELU MLP) it propagates NaN and passes. Eager,
Inductor and TorchAO (int8, per-row activation scales) propagate NaN like eager; TorchAO turns an all-+inf
row into +inf where eager gives NaN. The guard itself is tested in test_non_finite_guard.py.
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch
from torch import nn
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError, FidelityError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.fidelity import (
    PROBE_FAILED,
    PROBE_GUARDED,
    PROBE_PASSED,
    PROBE_SKIPPED,
    FidelityConfig,
    compare_non_finite,
    poison_sample,
)
from torch_tweak.torch.module.spec import GraphSpec, TensorSpec
from torch_tweak.torch.module.tree import TENSOR, flatten_sample
from torch_tweak.torch.testing import NaNToZeroBackend

REJECT = FidelityConfig(non_finite="reject")
GUARD = " + non-finite guard"

HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def relu_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 8)).eval()


def gelu_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8)).eval()


def tune_one(model: nn.Module, backend, fidelity: FidelityConfig | None = None, width: int = 16,
             batch_sizes: tuple[int, ...] = (1, 2, 4), **kwargs):
    wrapped = tt.Module(model, strategy=tt.OneBackendStrategy(backend, fidelity=fidelity))
    report = tt.tune(wrapped, [torch.randn(width) for _ in range(4)], batch_sizes=list(batch_sizes), **kwargs)
    (row,) = report.modules[0].graphs[0].candidates
    return wrapped, report.modules[0], row


def probes(row) -> dict[str, dict]:
    return {p["value"]: p for p in row.fidelity["non_finite"]}


def poisoned_batches(width: int) -> list[torch.Tensor]:
    """Batches of 3 with one NaN element, a NaN row, one +inf element and a -inf row in row 1."""
    batches = []
    for value, whole_row in ((math.nan, False), (math.nan, True), (math.inf, False), (-math.inf, True)):
        x = torch.randn(3, width)
        if whole_row:
            x[1] = value
        else:
            x[1, 3] = value
        batches.append(x)
    return batches


def assert_same_non_finite(reference: nn.Module, wrapped: tt.Module, width: int) -> None:
    for x in poisoned_batches(width):
        with torch.no_grad():
            expected, actual = reference(x.clone()), wrapped(x.clone())
        assert torch.equal(expected.isnan(), actual.isnan()), (x[1], expected, actual)
        assert torch.equal(expected.isinf(), actual.isinf()), (x[1], expected, actual)


# every backend on this machine ---------------------------------------------------------------------


def _backend(name: str):
    if name == "eager":
        return TorchEagerBackend()
    if name == "inductor":
        from torch_tweak.torch.backend.torch_inductor import TorchInductorBackend

        return TorchInductorBackend()
    if name == "torchao":
        from torch_tweak.torch.backend.torchao import TorchAOBackend

        return TorchAOBackend()
    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    return OpenVINOBackend(OpenVINOBackendConfig(inference_precision="f32" if name == "openvino-f32" else None))


BACKENDS = [
    pytest.param("eager"),
    pytest.param("inductor"),
    pytest.param("torchao", marks=[pytest.mark.torchao,
                                   pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")]),
    pytest.param("openvino", marks=[pytest.mark.openvino,
                                    pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed")]),
    pytest.param("openvino-f32", marks=[pytest.mark.openvino,
                                        pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed")]),
]
# Found by experiment: OpenVINO's CPU ReLU returns 0 for NaN at every precision; the others keep NaN.
DROPS_NAN_IN_RELU = {"openvino", "openvino-f32"}


def assert_nan_row_dropped(probe: dict, status: str) -> None:
    """The NaN probe of the Linear-ReLU-LayerNorm-Linear MLP on a backend whose ReLU maps NaN to 0."""
    assert probe["status"] == status and probe["output"] == "outputs" and probe["mismatched"] == 8
    assert "eager: 8 NaN" in probe["message"] and "candidate: 0 NaN" in probe["message"]
    assert "8 of them are finite where eager's are not" in probe["message"]


@pytest.mark.parametrize("name", BACKENDS)
def test_relu_mlp_propagates_non_finite_rows_or_is_guarded(name):
    model = relu_mlp()
    reference = copy.deepcopy(model)
    wrapped, module, row = tune_one(model, _backend(name), batch_sizes=(2, 4))  # no batch-1 compile
    assert row.status == "chosen" and module.status == "tuned", row.error
    if name in DROPS_NAN_IN_RELU:
        assert row.backend.endswith(GUARD) and list(wrapped.backends.values())[0].describe() == row.backend
        assert_nan_row_dropped(probes(row)["nan"], PROBE_GUARDED)
        assert "through the non-finite guard" in probes(row)["nan"]["message"]
    else:
        assert not row.backend.endswith(GUARD)
        assert {p["status"] for p in row.fidelity["non_finite"]} == {PROBE_PASSED}
    assert_same_non_finite(reference, wrapped, 16)


@pytest.mark.openvino
@pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed")
@pytest.mark.parametrize("name", ["openvino", "openvino-f32"])
def test_relu_mlp_on_openvino_is_rejected_when_asked(name):
    model = relu_mlp()
    reference = copy.deepcopy(model)
    wrapped, module, row = tune_one(model, _backend(name), REJECT, batch_sizes=(2, 4))
    assert row.status == "rejected" and module.status == "passthrough"
    assert "does not propagate NaN like eager" in row.error and "check_non_finite=False" in row.error
    assert "FidelityConfig(non_finite='guard')" in row.error
    assert_nan_row_dropped(probes(row)["nan"], PROBE_FAILED)
    assert_same_non_finite(reference, wrapped, 16)  # the rejected backend's module runs its original code


@pytest.mark.openvino
@pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed")
@pytest.mark.parametrize("name", ["openvino", "openvino-f32"])
def test_openvino_without_nan_dropping_ops_is_accepted_and_propagates(name):
    model = gelu_mlp()
    reference = copy.deepcopy(model)
    wrapped, _, row = tune_one(model, _backend(name))
    assert row.status == "chosen", row.error
    assert [p["status"] for p in row.fidelity["non_finite"]] == [PROBE_PASSED, PROBE_PASSED]
    assert_same_non_finite(reference, wrapped, 16)


@pytest.mark.torchao
@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
@pytest.mark.parametrize("mode", ["guard", "reject"])
def test_torchao_int8_turns_an_inf_row_into_inf_where_eager_gives_nan_and_is_guarded_or_rejected(mode):
    # Found by experiment: int8 dynamic activation scales of an all-+inf row are inf, and the quantized
    # Linear-ReLU-Linear returns +inf where eager's inf - inf gives NaN. The NaN probe passes.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()
    reference = copy.deepcopy(model)
    wrapped, module, row = tune_one(model, _backend("torchao"), FidelityConfig(non_finite=mode), width=64,
                                    batch_sizes=(2, 4))
    assert row.precision == "int8"
    nan, inf = probes(row)["nan"], probes(row)["inf"]
    assert nan["status"] == PROBE_PASSED
    assert "(eager: 32 NaN, 0 inf; candidate: 0 NaN, 32 inf); the candidate has inf where eager has NaN" in inf["message"]
    if mode == "guard":
        assert row.status == "chosen" and module.status == "tuned" and row.backend.endswith(GUARD)
        assert inf["status"] == PROBE_GUARDED
    else:
        assert row.status == "rejected" and module.status == "passthrough" and inf["status"] == PROBE_FAILED
        assert "does not propagate +inf like eager" in row.error
    x = torch.randn(3, 64)
    x[1] = math.inf
    with torch.no_grad():
        assert torch.equal(wrapped(x).isnan(), reference(x).isnan())


# the probe with test backends ------------------------------------------------------------------------


def test_backend_mapping_nan_to_zero_is_rejected_with_the_reason():
    wrapped, module, row = tune_one(mlp(), NaNToZeroBackend(), REJECT, width=8)
    assert row.status == "rejected" and module.status == "passthrough"
    assert row.error.startswith("FidelityError: the candidate does not propagate NaN like eager: with NaN in row 1 "
                                "of args[0] (axis 0), 4 of the 8 elements of outputs differ in NaN/inf from eager")
    assert "4 of them are finite where eager's are not, so invalid input comes back as plausible output" in row.error
    assert "tolerance for" not in row.error
    assert row.fidelity["passed"] is False and row.fidelity["max_abs_error"] == 0.0
    nan = probes(row)["nan"]
    assert (nan["status"], nan["output"], nan["mismatched"]) == (PROBE_FAILED, "outputs", 4)
    with pytest.raises(FidelityError, match="does not propagate NaN"):
        tune_one(mlp(), NaNToZeroBackend(), REJECT, width=8, ignore_failing_modules=False)


def test_backend_mapping_nan_to_zero_is_guarded_by_default():
    reference = mlp()
    wrapped, module, row = tune_one(mlp(), NaNToZeroBackend(), width=8)
    assert row.status == "chosen" and module.status == "tuned" and row.backend == "NaNToZeroBackend()" + GUARD
    assert row.fidelity["passed"] is True and row.error is None
    nan = probes(row)["nan"]
    assert (nan["status"], nan["output"], nan["mismatched"]) == (PROBE_GUARDED, "outputs", 4)
    assert nan["message"].startswith("with NaN in row 1 of args[0] (axis 0), 4 of the 8 elements of outputs differ")
    assert probes(row)["inf"]["status"] == PROBE_GUARDED  # an all-+inf row gives NaN (inf - inf) in eager
    assert_same_non_finite(reference, wrapped, 8)


def test_probe_can_be_disabled_and_is_validated():
    _, _, row = tune_one(mlp(), NaNToZeroBackend(), FidelityConfig(check_non_finite=False), width=8)
    assert row.status == "chosen" and row.fidelity["non_finite"] == []
    with pytest.raises(ConfigError, match="check_non_finite must be True or False"):
        FidelityConfig(check_non_finite="yes")  # type: ignore[arg-type]


class FiniteOnly(nn.Module):
    """Refuses non-finite input, as a model with input validation does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(x).all()):
            raise ValueError("input must be finite")
        return self.lin(x)


def test_probe_is_skipped_when_eager_raises():
    wrapped, _, row = tune_one(FiniteOnly(), TorchEagerBackend(), width=8)
    assert row.status == "chosen"
    assert [p["status"] for p in row.fidelity["non_finite"]] == [PROBE_SKIPPED, PROBE_SKIPPED]
    assert "eager raised ValueError: input must be finite with NaN in row 1 of args[0]" in probes(row)["nan"]["message"]
    assert wrapped(torch.randn(2, 8)).shape == (2, 4)


class RaisesOnNonFinite(TorchEagerBackend):
    """Eager, but refuses non-finite inputs the module itself accepts."""

    def _infer(self, *args, **kwargs):
        if not bool(torch.isfinite(args[0]).all()):
            raise RuntimeError("non-finite input")
        return super()._infer(*args, **kwargs)


def test_candidate_raising_where_eager_does_not_is_rejected_or_guarded():
    _, _, row = tune_one(mlp(), RaisesOnNonFinite(), REJECT, width=8)
    assert row.status == "rejected"
    assert "the candidate raised RuntimeError: non-finite input, where eager returned outputs" in row.error
    wrapped, _, row = tune_one(mlp(), RaisesOnNonFinite(), width=8)
    assert row.status == "chosen" and row.backend.endswith(GUARD)
    assert {p["status"] for p in row.fidelity["non_finite"]} == {PROBE_GUARDED}
    assert "the candidate raised RuntimeError: non-finite input" in probes(row)["nan"]["message"]
    assert_same_non_finite(mlp(), wrapped, 8)  # the guard never lets the candidate see NaN/inf


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).sum(1)


def test_graph_without_float_inputs_skips_the_probe():
    wrapped = tt.Module(TokenModel(), strategy=tt.OneBackendStrategy(NaNToZeroBackend()))
    report = tt.tune(wrapped, [torch.randint(0, 20, (5,)) for _ in range(3)], batch_sizes=[1, 2])
    (row,) = report.modules[0].graphs[0].candidates
    assert row.status == "chosen"
    assert [p["status"] for p in row.fidelity["non_finite"]] == [PROBE_SKIPPED, PROBE_SKIPPED]
    assert "no floating-point input tensor" in row.fidelity["non_finite"][0]["message"]


class Capturing(tt.OneBackendStrategy):
    tasks: list = []  # a class attribute: tt.Module deep-copies strategies

    def _tune(self, task):
        Capturing.tasks.append(task)
        return super()._tune(task)


def test_recorded_samples_and_module_buffers_are_not_poisoned():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()  # forward updates the running stats
    Capturing.tasks.clear()
    wrapped = tt.Module(model, strategy=Capturing(TorchEagerBackend()))
    report = tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[2, 4])
    (row,) = report.modules[0].graphs[0].candidates
    assert row.status == "chosen" and {p["status"] for p in row.fidelity["non_finite"]} == {PROBE_PASSED}
    (task,) = Capturing.tasks
    for sample in task.samples:
        leaves, _ = flatten_sample(*sample.sample)
        assert all(bool(torch.isfinite(t).all()) for t in leaves)
    assert all(bool(torch.isfinite(b).all()) for b in model[1].buffers() if b.is_floating_point())


# unit level ----------------------------------------------------------------------------------------


def _spec(shape, min_shape, batch_axis=None) -> GraphSpec:
    multipliers = {batch_axis: 1} if batch_axis is not None else {}
    inputs = [TensorSpec("args_0", "args[0]", shape, min_shape, min_shape, "float32", multipliers),
              TensorSpec("args_1", "args[1]", (2,), (2,), (2,), "int64")]
    structure = ("tuple", (("tuple", (TENSOR, TENSOR)), ("dict", (), ())))
    return GraphSpec("0", inputs, [], structure, TENSOR)


def test_poison_uses_the_batch_axis_and_never_touches_the_sample():
    x, ids = torch.zeros(3, 4), torch.arange(2)
    sample = ((x, ids), {})
    poisoned, where = poison_sample(sample, _spec(("dim0", "batch0"), (3, 4), batch_axis=1), math.nan)
    assert where == "NaN in row 1 of args[0] (axis 1)"
    px, pids = poisoned[0]
    assert torch.equal(px.isnan(), torch.tensor([[False, True, False, False]] * 3))
    assert torch.equal(pids, ids) and not x.isnan().any()


def test_poison_single_row_writes_one_element_and_without_spec_axis_uses_axis_0():
    poisoned, where = poison_sample(((torch.zeros(1, 4), torch.arange(2)), {}), _spec(("batch0", 4), (1, 4)),
                                    math.inf)
    assert where == "+inf in one element of args[0]" and int(poisoned[0][0].isinf().sum()) == 1
    poisoned, where = poison_sample(((torch.zeros(2, 3), torch.arange(2)), {}), _spec((2, 3), (2, 3)), math.nan)
    assert where == "NaN in row 1 of args[0] (axis 0)" and poisoned[0][0][1].isnan().all()
    poisoned, why = poison_sample(((torch.arange(3),), {}), _spec((3,), (3,)), math.nan)
    assert poisoned is None and why == "the graph has no floating-point input tensor"


def test_compare_non_finite_reports_the_output_and_count():
    expected = {"a": torch.tensor([1.0, math.nan, math.inf]), "ids": torch.tensor([1, 2])}
    assert compare_non_finite(expected, {"a": torch.tensor([2.0, math.nan, math.inf]), "ids": torch.tensor([7, 7])}) \
        == ("", None, 0)
    message, output, count = compare_non_finite(expected, {"a": torch.tensor([1.0, 0.0, 5.0]), "ids": expected["ids"]})
    assert (output, count) == ("output tensor 0", 2)
    assert "eager: 1 NaN, 1 inf; candidate: 0 NaN, 0 inf); 2 of them are finite where eager's are not" in message
    swapped = compare_non_finite(torch.tensor([math.nan, 1.0]), torch.tensor([math.inf, 1.0]))[0]
    assert swapped.endswith("(eager: 1 NaN, 0 inf; candidate: 0 NaN, 1 inf); the candidate has inf where eager has NaN "
                            "or back")
    spurious = compare_non_finite(torch.tensor([1.0, 1.0]), torch.tensor([math.nan, 1.0]))[0]
    assert spurious.endswith("1 of them are NaN/inf where eager's are finite")
    assert compare_non_finite(expected, torch.ones(3))[0] == "the output structure differs from eager"
