"""The fidelity check compares candidate outputs with eager outputs by executed precision."""

from __future__ import annotations

import json

import pytest
import torch
from toy_models import Pair

from torch_tweak.errors import ConfigError
from torch_tweak.torch.fidelity import (
    PROBE_FAILED,
    PROBE_GUARDED,
    PROBE_PASSED,
    PROBE_SKIPPED,
    FidelityConfig,
    NonFiniteProbe,
    Tolerance,
    check_fidelity,
    guarded_probes,
)


def test_identical_outputs_pass():
    out = {"a": torch.randn(3, 4), "b": [torch.arange(3), None]}
    result = check_fidelity(out, out, "fp32")
    assert result.passed and result.max_abs_error == 0.0 and result.min_cosine == pytest.approx(1.0)


def test_fp32_tight_tolerance():
    ref = torch.randn(64, 64)
    assert check_fidelity(ref, ref + 1e-6, "fp32").passed
    result = check_fidelity(ref, ref + 1e-2, "fp32")
    assert not result.passed and "exceed atol" in result.message
    assert result.max_abs_error == pytest.approx(1e-2, rel=1e-3)


def test_bf16_error_passes_bf16_tolerance_but_not_fp32():
    ref = torch.randn(128, 128)
    bf16 = ref.to(torch.bfloat16).float()
    assert check_fidelity(ref, bf16, "bf16").passed
    assert not check_fidelity(ref, bf16, "fp32").passed


def test_int8_uses_cosine_and_relative_error():
    ref = torch.randn(256)
    noisy = ref + 0.05 * torch.randn(256)
    assert check_fidelity(ref, noisy, "int8").passed
    result = check_fidelity(ref, torch.randn(256), "int8")
    assert not result.passed and "relative L2" in result.message


def test_nan_and_inf_are_rejected():
    ref = torch.ones(4)
    for bad in (float("nan"), float("inf")):
        broken = ref.clone()
        broken[2] = bad
        result = check_fidelity(ref, broken, "bf16")
        assert not result.passed and "NaN/Inf" in result.message


def test_nan_where_eager_was_nan_is_accepted():
    ref = torch.tensor([1.0, float("nan")])
    assert check_fidelity(ref, ref.clone(), "fp32").passed


def test_structure_shape_and_count_mismatches():
    ref = Pair(torch.ones(2), torch.ones(3))
    assert "output tensor" in check_fidelity(ref, Pair(torch.ones(2), torch.ones(4)), "fp32").message
    assert "expected 2 output tensor" in check_fidelity(ref, torch.ones(2), "fp32").message
    assert "structure" in check_fidelity(ref, (torch.ones(2), torch.ones(3)), "fp32").message
    assert "structure" in check_fidelity((torch.ones(1), 1), (torch.ones(1), 2), "fp32").message


def test_integer_outputs_must_match_exactly_in_fp32():
    ref = torch.arange(100)
    almost = ref.clone()
    almost[0] = 7
    assert not check_fidelity(ref, almost, "fp32").passed
    assert check_fidelity(ref, almost, "bf16").passed


def test_custom_tolerances_and_validation():
    config = FidelityConfig({"fp32": Tolerance(atol=0.1, rtol=0.0)})
    ref = torch.zeros(3)
    assert check_fidelity(ref, ref + 0.05, "fp32", config).passed
    with pytest.raises(ConfigError):
        Tolerance(atol=-1.0, rtol=0.0)
    with pytest.raises(ConfigError):
        Tolerance(atol=1e-3)
    with pytest.raises(ConfigError):
        Tolerance(min_cosine=2.0)
    with pytest.raises(ConfigError):
        Tolerance()
    with pytest.raises(ConfigError):
        FidelityConfig({"fp32": 1e-3})  # type: ignore[dict-item]


def test_non_finite_probe_config_is_validated():
    assert FidelityConfig().check_non_finite is True
    assert FidelityConfig(check_non_finite=False).check_non_finite is False
    for bad in (1, "false", None):
        with pytest.raises(ConfigError, match="check_non_finite"):
            FidelityConfig(check_non_finite=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="dict of Tolerance"):
        FidelityConfig([Tolerance(atol=0.1, rtol=0.0)])  # type: ignore[arg-type]
    assert FidelityConfig().non_finite == "guard" and FidelityConfig(non_finite="reject").non_finite == "reject"
    for bad in ("Guard", "", None, True):
        with pytest.raises(ConfigError, match="FidelityConfig.non_finite must be one of 'guard', 'reject'"):
            FidelityConfig(non_finite=bad)  # type: ignore[arg-type]


def test_failed_probe_fails_the_result_and_lands_in_its_dict():
    result = check_fidelity(torch.ones(2), torch.ones(2), "bf16")
    assert result.non_finite == [] and result.failed_probe() is None
    result.add_probes([NonFiniteProbe("nan", PROBE_SKIPPED, "eager raised ValueError: bad input"),
                       NonFiniteProbe("inf", PROBE_FAILED, "with +inf in row 1 of args[0] (axis 0), ...", "outputs", 3)])
    assert not result.passed and result.failed_probe().value == "inf"
    assert result.message.startswith("the candidate does not propagate +inf like eager: with +inf in row 1")
    assert "check_non_finite=False" in result.message and "FidelityConfig(non_finite='guard')" in result.message
    as_dict = json.loads(json.dumps(result.to_dict()))
    assert as_dict["non_finite"][1] == {"value": "inf", "status": "failed", "output": "outputs", "mismatched": 3,
                                        "message": "with +inf in row 1 of args[0] (axis 0), ..."}
    merged = check_fidelity(torch.ones(2), torch.ones(2), "bf16").merge(result)
    assert not merged.passed and len(merged.non_finite) == 2


def test_guarded_probes_keep_the_candidates_failure_and_say_what_the_guard_did():
    bare = [NonFiniteProbe("nan", PROBE_FAILED, "with NaN in row 1, 4 elements differ", "outputs", 4),
            NonFiniteProbe("inf", PROBE_PASSED, "+inf in row 1: same NaN/inf positions as eager")]
    through = [NonFiniteProbe("nan", PROBE_PASSED, "NaN in row 1: same"), NonFiniteProbe("inf", PROBE_PASSED, "same")]
    nan, inf = guarded_probes(bare, through)
    assert (nan.status, nan.output, nan.mismatched) == (PROBE_GUARDED, "outputs", 4)
    assert nan.message.startswith("with NaN in row 1, 4 elements differ; through the non-finite guard")
    assert inf == bare[1]
    result = check_fidelity(torch.ones(2), torch.ones(2), "fp32").add_probes([nan, inf])
    assert result.passed and result.failed_probe() is None
    still = [NonFiniteProbe("nan", PROBE_FAILED, "2 elements differ", "outputs", 2), through[1]]
    nan, _ = guarded_probes(bare, still)
    assert (nan.status, nan.output, nan.mismatched) == (PROBE_FAILED, "outputs", 2)
    assert nan.message == "with NaN in row 1, 4 elements differ; through the non-finite guard: 2 elements differ"
    result = check_fidelity(torch.ones(2), torch.ones(2), "fp32").add_probes([nan])
    assert not result.passed and "non_finite='guard'" not in result.message  # the guard was tried: no such advice
