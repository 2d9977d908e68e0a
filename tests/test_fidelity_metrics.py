"""Task metrics of the fidelity check: their values on known cases, thresholds, and bad settings."""

from __future__ import annotations

import math

import pytest
import torch

from torch_tweak.errors import ConfigError
from torch_tweak.torch.fidelity_metrics import cosine, relative_l2, task_metric, topk_agreement


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
