"""tt.tune end to end with the eager backend, deliberately broken backends and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from toy_models import KwargsModel, Pair, Pipeline, SeqModel, cnn, mlp

import torch_tweak.torch as tt
from torch_tweak.errors import (
    BuildError,
    ConfigError,
    DatasetError,
    FidelityError,
    SignatureMismatchError,
    TuningError,
    UnsupportedDeviceError,
    UnsupportedInputError,
)
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.testing import (
    FailingBuildBackend,
    NaNBackend,
    OwnCopyBackend,
    WrongOutputBackend,
    WrongShapeBackend,
)


def one(backend=None) -> tt.OneBackendStrategy:
    return tt.OneBackendStrategy(backend or TorchEagerBackend())


def test_tune_returns_report_and_dispatches():
    model = cnn()
    wrapped = tt.Module(model, name="cnn", strategy=one())
    report = tt.tune(wrapped, [torch.randn(3, 8, 8) for _ in range(4)], batch_sizes=[1, 2, 4])
    assert isinstance(report, tt.TuningReport)
    (module,) = report.modules
    assert module.name == "cnn" and module.status == "tuned"
    (cand,) = module.graphs[0].candidates
    assert cand.status == "chosen" and cand.precision == "fp32" and cand.fidelity["passed"]
    x = torch.randn(3, 3, 8, 8)
    assert torch.equal(wrapped(x), torch.nn.Sequential.forward(model, x))
    assert "cnn" in str(report) and "chosen" in str(report)
    assert tt.TuningReport.from_dict(report.to_dict()).modules[0].graphs[0].chosen == cand.backend


def test_first_wins_skips_broken_candidates_and_reports_them():
    strategy = tt.FirstWinsStrategy([FailingBuildBackend(), NaNBackend(), WrongOutputBackend(), WrongShapeBackend(),
                                     TorchEagerBackend()])
    wrapped = tt.Module(mlp(), name="mlp", strategy=strategy)
    report = tt.tune(wrapped, [torch.randn(8) for _ in range(2)])
    rows = report.modules[0].graphs[0].candidates
    assert [r.status for r in rows] == ["build_failed", "rejected", "rejected", "rejected", "chosen"]
    assert "deliberate build failure" in rows[0].error
    log = Path(rows[0].log_path)
    assert log.name == "build.log" and "compiler output that should land in build.log" in log.read_text()
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    assert "NaN/Inf" in rows[1].error
    assert "exceed atol" in rows[2].error and rows[2].fidelity["max_abs_error"] == pytest.approx(1.0)
    assert "shape" in rows[3].error
    assert report.modules[0].graphs[0].chosen == "TorchEagerBackend()"


def test_all_candidates_failing_falls_back_to_passthrough():
    model = mlp()
    wrapped = tt.Module(model, strategy=tt.FirstWinsStrategy([NaNBackend(), FailingBuildBackend()]))
    report = tt.tune(wrapped, [torch.randn(8)] * 2)
    module = report.modules[0]
    assert module.status == "passthrough" and "There is no valid backend" in module.error
    assert wrapped.state is tt.ModuleState.PASSTHROUGH
    x = torch.randn(2, 8)
    assert torch.equal(wrapped(x), torch.nn.Sequential.forward(model, x))


def test_a_module_that_fails_says_why_and_an_unexpected_error_logs_its_traceback(caplog):
    class Broken(tt.FirstWinsStrategy):
        def _tune(self, task):
            raise AssertionError()  # a bug, not one of the library's errors: its message is empty

    expected = tt.Module(mlp(), strategy=tt.FirstWinsStrategy([NaNBackend()]))
    broken = tt.Module(mlp(), strategy=Broken([TorchEagerBackend()]))
    with caplog.at_level("WARNING", logger="torch_tweak.torch.tuning"):
        tt.tune(expected, [torch.randn(8)] * 2)
        report = tt.tune(broken, [torch.randn(8)] * 2)
    assert report.modules[0].status == "passthrough" and report.modules[0].error == "AssertionError: "
    first, second = [r for r in caplog.records if "it will run its original code" in r.getMessage()]
    assert "TuningError: There is no valid backend" in first.getMessage() and not first.exc_info
    assert second.getMessage().endswith("original code: AssertionError: ") and second.exc_info[0] is AssertionError


def test_failures_propagate_when_not_ignored():
    wrapped = tt.Module(mlp(), strategy=tt.FirstWinsStrategy([NaNBackend()]))
    with pytest.raises(TuningError, match="There is no valid backend"):
        tt.tune(wrapped, [torch.randn(8)] * 2, ignore_failing_modules=False)


def test_one_backend_strategy_reraises_the_original_error():
    wrapped = tt.Module(mlp(), strategy=one(FailingBuildBackend()))
    with pytest.raises(BuildError, match="deliberate build failure"):
        tt.tune(wrapped, [torch.randn(8)] * 2, ignore_failing_modules=False)
    wrong = tt.Module(mlp(), strategy=one(WrongOutputBackend(offset=0.5)))
    with pytest.raises(FidelityError, match="exceed atol"):
        tt.tune(wrong, [torch.randn(8)] * 2, ignore_failing_modules=False)


def test_unseen_batch_size_and_structured_io():
    model = KwargsModel()
    wrapped = tt.Module(model, strategy=one())
    items = [((torch.randn(6),), {"mask": torch.ones(6), "scale": 2.0}) for _ in range(4)]
    tt.tune(wrapped, items, batch_sizes=[1, 2, 4])
    out = wrapped(torch.randn(3, 6), mask=torch.ones(3, 6), scale=2.0)
    assert isinstance(out, Pair) and out.first.shape == (3, 6)


def test_unknown_signature_error_names_expected_and_got():
    wrapped = tt.Module(mlp(), name="mlp", strategy=one())
    tt.tune(wrapped, [torch.randn(8)] * 2)
    with pytest.raises(SignatureMismatchError) as info:
        wrapped(torch.randn(2, 3, 8))
    message = str(info.value)
    assert "got:      args[0]: float32[2, 3, 8]" in message
    assert "graph 0: args[0]: float32[batch0, 8]" in message
    assert "on_unknown_signature" in message


def test_unknown_signature_passthrough_when_configured():
    tt.config.on_unknown_signature = "passthrough"
    model = mlp()
    wrapped = tt.Module(model, strategy=one())
    tt.tune(wrapped, [torch.randn(8)] * 2)
    x = torch.randn(2, 3, 8)
    assert torch.equal(wrapped(x), torch.nn.Sequential.forward(model, x))


def test_weights_offloaded_when_no_backend_needs_them():
    wrapped = tt.Module(mlp(), strategy=one(OwnCopyBackend()))
    tt.tune(wrapped, [torch.randn(8)] * 2)
    weight = next(wrapped.wrapped.parameters())
    assert weight.device.type == "cpu" and weight.dtype == torch.float32 and type(weight).__name__ == "ReleasedTensor"
    assert wrapped(torch.randn(2, 8)).shape == (2, 4)
    with pytest.raises(TuningError, match="offloaded"):
        wrapped.enable_passthrough()


def test_weights_stay_when_offloading_is_disabled():
    tt.config.device_after_tuning = None
    wrapped = tt.Module(mlp(), strategy=one(OwnCopyBackend()))
    tt.tune(wrapped, [torch.randn(8)] * 2)
    assert next(wrapped.wrapped.parameters()).device.type == "cpu"


def test_pipeline_modules_are_tuned_in_call_order():
    pipe = Pipeline()
    pipe.head = tt.Module(pipe.head, name="head", strategy=one())
    pipe.encoder = tt.Module(pipe.encoder, name="encoder", strategy=one())
    report = tt.tune(pipe, [torch.randn(8) for _ in range(3)])
    assert [m.name for m in report.modules] == ["encoder", "head"]
    assert pipe.encoder.state is pipe.head.state is tt.ModuleState.TUNED


def test_strategies_per_graph_as_list_and_dict():
    items = [((torch.randn(6),), {}), ((torch.randn(6),), {"mask": torch.ones(6)})]
    listed = tt.Module(KwargsModel(), strategies=[one(), tt.FirstWinsStrategy([TorchEagerBackend()])])
    report = tt.tune(listed, items)
    assert [g.strategy.split("(")[0] for g in report.modules[0].graphs] == ["OneBackendStrategy", "FirstWinsStrategy"]
    keyed = tt.Module(KwargsModel(), strategies={"0": one(), "1": one()})
    assert tt.tune(keyed, items).modules[0].status == "tuned"
    short = tt.Module(KwargsModel(), strategies=[one()])
    with pytest.raises(TuningError, match="one strategy per graph"):
        tt.tune(short, items, ignore_failing_modules=False)
    missing = tt.Module(KwargsModel(), strategies={"0": one()})
    with pytest.raises(TuningError, match=r"no strategy for graph\(s\) \['1'\]"):
        tt.tune(missing, items, ignore_failing_modules=False)


@pytest.mark.parametrize(
    "dataset",
    [
        torch.randn(8),
        [torch.randn(8) for _ in range(3)],
        [(torch.randn(8),) for _ in range(3)],
        [((torch.randn(8),), {}) for _ in range(3)],
        torch.utils.data.TensorDataset(torch.randn(4, 8)),
    ],
    ids=["tensor", "list-of-tensors", "list-of-tuples", "args-kwargs", "torch-dataset"],
)
def test_dataset_forms(dataset):
    wrapped = tt.Module(mlp(), strategy=one())
    report = tt.tune(wrapped, dataset, batch_sizes=[1, 2])
    assert report.modules[0].status == "tuned"
    assert wrapped.graph_specs[0].inputs[0].shape == ("batch0", 8)


def test_dict_items_with_ragged_lengths():
    items = [{"input_ids": torch.randint(0, 50, (n,)), "attention_mask": torch.ones(n)} for n in (3, 6)]
    wrapped = tt.Module(SeqModel(), strategy=one())
    tt.tune(wrapped, items, batch_sizes=[1, 2], max_num_batches_per_batch_size=5)
    out = wrapped(input_ids=torch.randint(0, 50, (2, 4)), attention_mask=torch.ones(2, 4))
    assert out["pooled"].shape == (2, 8)


def test_bad_devices():
    wrapped = tt.Module(mlp(), strategy=one())
    for device in ("cuda:0", "tpu", "xpu:abc"):
        with pytest.raises(UnsupportedDeviceError, match="Unsupported device") as info:
            tt.tune(wrapped, [torch.randn(8)], device=device)
        assert isinstance(info.value, ValueError)
    with pytest.raises(UnsupportedDeviceError, match="torch.xpu.is_available"):
        tt.tune(wrapped, [torch.randn(8)], device="xpu")


def test_bad_datasets_and_arguments():
    wrapped = tt.Module(mlp(), strategy=one())
    with pytest.raises(DatasetError, match="empty"):
        tt.tune(wrapped, [])
    with pytest.raises(UnsupportedInputError, match=r"dataset\[1\] has unsupported type object") as info:
        tt.tune(wrapped, [torch.randn(8), object()])
    assert isinstance(info.value, TypeError)
    with pytest.raises(UnsupportedInputError):
        tt.tune(wrapped, {1, 2})
    with pytest.raises(ConfigError, match="batch_sizes"):
        tt.tune(wrapped, [torch.randn(8)], batch_sizes=[0, 2])
    with pytest.raises(ConfigError, match="max_num_batches_per_batch_size"):
        tt.tune(wrapped, [torch.randn(8)], max_num_batches_per_batch_size=0)


def test_nothing_recorded():
    wrapped = tt.Module(mlp(), strategy=one())
    with pytest.raises(TuningError, match="No tt.Module was called"):
        tt.tune(lambda x: x, [torch.randn(8)])
    with pytest.raises(TuningError, match="recorded nothing"):
        wrapped.tune()


def test_tuning_twice_is_refused():
    wrapped = tt.Module(mlp(), strategy=one())
    tt.tune(wrapped, [torch.randn(8)] * 2)
    with pytest.raises(TuningError, match="already tuned"):
        wrapped.tune()


def test_clear_cache_refuses_foreign_folder(tmp_path):
    foreign = tmp_path / "not_ours"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep")
    tt.config.cache_dir = foreign
    with pytest.raises(ConfigError, match="Refusing to delete"):
        tt.tune(tt.Module(mlp()), [torch.randn(8)], clear_cache=True)
    assert (foreign / "precious.txt").exists()


def test_clear_cache_removes_our_cache():
    wrapped = tt.Module(mlp(), name="m1", strategy=one())
    tt.tune(wrapped, [torch.randn(8)] * 2)
    assert (tt.config.cache_dir / "m1").is_dir()
    tt.tune(tt.Module(mlp(), name="m2", strategy=one()), [torch.randn(8)] * 2, clear_cache=True)
    assert not (tt.config.cache_dir / "m1").exists() and (tt.config.cache_dir / "m2").is_dir()
