"""Task metrics of the fidelity check: their values on known cases, thresholds, and bad settings."""

from __future__ import annotations

import math

import pytest
import torch
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.fidelity import check_calls
from torch_tweak.torch.fidelity_metrics import cosine, relative_l2, task_metric, topk_agreement
from torch_tweak.torch.testing import WrongOutputBackend


def test_cosine_is_the_worst_vector_along_the_last_axis():
    eager = {"hidden": torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]), "pooled": torch.tensor([[3.0, 4.0]])}
    same_direction = {"hidden": eager["hidden"] * 5, "pooled": eager["pooled"] * 0.1}
    assert cosine(eager, same_direction) == pytest.approx(1.0)
    turned = {"hidden": torch.tensor([[[1.0, 0.0], [1.0, 1.0]]]), "pooled": eager["pooled"]}
    assert cosine(eager, turned) == pytest.approx(math.cos(math.pi / 4))
    zeros = {"hidden": torch.zeros(1, 2, 2), "pooled": torch.zeros(1, 2)}
    assert cosine(zeros, zeros) == 1.0 and cosine(zeros, {**zeros, "pooled": torch.ones(1, 2)}) == 0.0


def test_topk_agreement_compares_index_sets_of_each_row():
    eager = torch.tensor([[0.1, 0.9, 0.5, 0.2], [0.7, 0.1, 0.2, 0.6]])
    swapped_top2 = torch.tensor([[0.1, 0.5, 0.9, 0.2], [0.7, 0.1, 0.2, 0.6]])
    assert topk_agreement(eager, eager, k=1) == 1.0
    assert topk_agreement(eager, swapped_top2, k=1) == 0.5  # row 0's arg-max moved
    assert topk_agreement(eager, swapped_top2, k=2) == 1.0  # but its top-2 set did not
    assert topk_agreement((eager, torch.arange(3)), (swapped_top2, torch.arange(3)), k=1) == 0.5  # ints ignored


def test_relative_l2_over_every_float_output():
    eager = (torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0]))
    assert relative_l2(eager, eager) == 0.0
    assert relative_l2(eager, (torch.tensor([3.0, 0.5]), torch.tensor([0.0, 4.0]))) == pytest.approx(0.1)
    assert relative_l2(torch.zeros(2), torch.zeros(2)) == 0.0 and relative_l2(torch.zeros(2), torch.ones(2)) == math.inf


def test_thresholds_by_direction_and_the_worst_sample():
    assert task_metric("cosine").judge([0.999, 0.995]) == (0.995, True)
    assert task_metric("cosine", threshold=0.998).judge([0.999, 0.995]) == (0.995, False)
    assert task_metric("rel_l2").judge([0.01, 0.06]) == (0.06, False)
    assert task_metric("topk", k=5).describe() == "top5 >= 0.99"
    assert task_metric("rel_l2").describe() == "rel_l2 <= 0.05"
    nan_value, ok = task_metric("cosine").judge([math.nan])
    assert math.isnan(nan_value) and not ok


def test_user_metric_with_threshold_and_direction():
    def answer_matches(reference, candidate):
        return float(reference.argmax() == candidate.argmax())

    metric = task_metric(answer_matches, threshold=1.0)
    assert metric.name == "answer_matches" and metric.judge([1.0, 1.0]) == (1.0, True)
    lower = task_metric(lambda r, c: float((r - c).abs().max()), threshold=0.1, higher_is_better=False)
    assert lower.judge([0.05, 0.2]) == (0.2, False)


def _logits(rows: int, flip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    eager = torch.tensor([[2.0, 1.0, 0.0]] * rows)
    return eager, (eager.flip(-1) if flip else eager + 0.01)


def test_topk_is_pooled_over_calls_other_metrics_are_judged_by_the_worst_call():
    calls = [(*_logits(1, flip=i == 3), i % 2 == 1) for i in range(10)]  # batch-1 calls, one arg-max flipped
    result = check_calls(iter(calls), "int8", tt.FidelityConfig(metric="topk", threshold=0.85))
    assert result.passed and result.metric_value == pytest.approx(0.9)  # call by call, the flip would give 0
    assert (result.samples, result.held_out_samples) == (10, 5)
    result = check_calls(iter(calls), "int8", tt.FidelityConfig(metric="topk", threshold=0.95))
    assert not result.passed and "top1 = 0.9 over 10 rows of 10 call(s)" in result.message
    weighted = check_calls(iter([(*_logits(3), False), (*_logits(1, flip=True), True)]), "int8",
                           tt.FidelityConfig(metric="topk", threshold=0.5))
    assert weighted.passed and weighted.metric_value == pytest.approx(0.75)  # rows, not calls, are averaged
    worst = check_calls(iter(calls), "int8", tt.FidelityConfig(metric="cosine", threshold=0.99))
    assert not worst.passed and worst.samples == 4  # the flipped call fails, and ends the check
    assert check_calls(iter([]), "fp32") is None


@pytest.mark.parametrize("kwargs, match", [
    ({"metric": "accuracy"}, "not a built-in metric"),
    ({"metric": 3}, "must be None, a built-in name or a callable"),
    ({"metric": lambda r, c: 1.0}, "needs a threshold"),
    ({"metric": "cosine", "threshold": "high"}, "threshold must be None or a number"),
    ({"metric": "rel_l2", "higher_is_better": True}, "lower is better"),
    ({"metric": "topk", "k": 0}, "k must be an integer >= 1"),
])
def test_bad_metric_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        task_metric(**kwargs)


# through the public API --------------------------------------------------------------------------------

_NAMES = iter(range(1 << 30))


def _tune_with(fidelity, offset):
    wrapped = tt.Module(mlp(), name=f"metric_{next(_NAMES)}",
                        strategy=tt.OneBackendStrategy(WrongOutputBackend(offset=offset), fidelity=fidelity))
    report = tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2])
    (row,) = report.modules[0].graphs[0].candidates
    return wrapped, report, row


def test_a_task_metric_accepts_what_the_task_cannot_tell_apart_and_reports_its_value():
    _, _, strict = _tune_with(None, 0.002)
    assert strict.status == "rejected" and "exceed atol" in strict.error
    wrapped, report, row = _tune_with(tt.FidelityConfig(metric="cosine"), 0.002)
    assert row.status == "chosen" and wrapped.state is tt.ModuleState.TUNED
    assert row.fidelity["metric"] == "cosine >= 0.99" and 0.99 <= row.fidelity["metric_value"] < 1.0
    assert row.fidelity["tolerance"] == "cosine >= 0.99" and row.fidelity["max_abs_error"] == pytest.approx(0.002, rel=1e-4)
    # a metric keeps more recorded calls: 4 calls at batch 1 and 2 at batch 2, 2 in memory, 1 of the 4 others held out
    assert (row.fidelity["samples"], row.fidelity["held_out_samples"]) == (3, 1)
    assert f"(cosine {row.fidelity['metric_value']:.4g} vs >= 0.99; 1 of 3 calls held out)" in str(report)


def test_a_task_metric_rejects_what_changes_the_task_answer():
    wrapped, _, row = _tune_with(tt.FidelityConfig(metric="rel_l2", threshold=0.01), 1.0)
    assert row.status == "rejected" and wrapped.state is tt.ModuleState.PASSTHROUGH
    assert "task metric rel_l2 = " in row.error and "needs rel_l2 <= 0.01" in row.error
    assert row.fidelity["metric_value"] > 0.01


def test_a_user_metric_is_judged_on_every_sample_and_its_errors_are_rows():
    seen = []

    def same_answer(reference, candidate):
        seen.append(1)
        return float((reference.argmax(-1) == candidate.argmax(-1)).float().mean())

    _, _, row = _tune_with(tt.FidelityConfig(metric=same_answer, threshold=1.0), 0.002)
    assert row.status == "chosen" and row.fidelity["metric"] == "same_answer >= 1" and len(seen) >= 2

    def broken(reference, candidate):
        raise ValueError("no labels here")

    _, _, row = _tune_with(tt.FidelityConfig(metric=broken, threshold=1.0), 0.002)
    assert row.status == "rejected" and "the task metric broken raised ValueError: no labels here" in row.error


def test_threshold_without_a_metric_is_refused():
    with pytest.raises(ConfigError, match="apply to a metric"):
        tt.FidelityConfig(threshold=0.5)


def test_built_in_metrics_pickle_with_their_settings():
    import pickle

    reference, candidate = torch.tensor([[0.1, 0.9, 0.3], [0.5, 0.2, 0.4]]), torch.tensor([[0.2, 0.8, 0.9], [0.5, 0.1, 0.6]])
    for config in (tt.FidelityConfig(metric="topk", k=2), tt.FidelityConfig(metric="cosine", threshold=0.5),
                   tt.FidelityConfig(metric="rel_l2")):
        copy = pickle.loads(pickle.dumps(config))
        assert copy.task.describe() == config.task.describe()
        assert copy.task.function(reference, candidate) == config.task.function(reference, candidate)
        assert (copy.task.weight is None) == (config.task.weight is None)
    top2 = pickle.loads(pickle.dumps(tt.FidelityConfig(metric="topk", k=2))).task
    assert top2.function(reference, candidate) == topk_agreement(reference, candidate, k=2) and top2.weight(reference) == 2.0
