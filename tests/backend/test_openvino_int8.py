"""OpenVINO INT8 candidates (NNCF): config, calibration data, IR reuse, fidelity verdicts and warm loading.

Tiny models only: each tune takes seconds. Skipped without openvino or nncf.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

pytest.importorskip("openvino")
nncf = pytest.importorskip("nncf")

from toy_models import cnn as toy_cnn  # noqa: E402

import torch_tweak.torch as tt  # noqa: E402
from torch_tweak.errors import BackendUnavailableError, ConfigError  # noqa: E402
from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig  # noqa: E402
from torch_tweak.torch.backend.openvino import converter, openvino_backend, quantize  # noqa: E402
from torch_tweak.torch.module.recording import record  # noqa: E402
from torch_tweak.torch.report.report import CandidateStatus  # noqa: E402

pytestmark = pytest.mark.openvino
CPU = torch.device("cpu")
TESTS = Path(__file__).resolve().parent.parent


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).eval()


def convs_only() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()


class Outliers(nn.Module):
    """One hidden channel is 10^4 times larger than the others, and the output ignores it: a per-tensor int8 scale
    set by the large channel rounds every other channel to zero, so only weight-only int8 can be faithful."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 8)
        with torch.no_grad():
            self.first.weight[0] *= 1e4
            self.first.bias[0] = 1e4
            self.second.weight[:, 0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


MODELS = {"mlp": (mlp, (32,)), "cnn": (cnn, (3, 12, 12)), "outliers": (Outliers, (16,)),
          "convs_only": (convs_only, (3, 12, 12))}


def tune(kind: str, quantization: str, **config) -> tuple[tt.Module, tt.TuningReport]:
    factory, shape = MODELS[kind]
    torch.manual_seed(1)
    backend = OpenVINOBackend(OpenVINOBackendConfig(quantization=quantization, **config))
    model = tt.Module(factory(), name=f"{kind}_{quantization}", strategy=tt.OneBackendStrategy(backend))
    report = tt.tune(model, [torch.randn(*shape) for _ in range(8)], batch_sizes=[1, 4, 8])
    return model, report


def openvino_of(model: tt.Module) -> OpenVINOBackend:
    (backend,) = model.backends.values()
    return next(b for b in backend.components() if isinstance(b, OpenVINOBackend))


def op_types(xml: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in converter.import_openvino().Core().read_model(str(xml)).get_ops():
        name = op.get_type_name()
        if name == "Constant" and op.get_element_type().to_string() in ("u8", "i8"):
            name = "Int8Constant"
        counts[name] = counts.get(name, 0) + 1
    return counts


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.reshape(-1).float(), b.reshape(-1).float(), dim=0).item()


# config -------------------------------------------------------------------------------------------------------


def test_config_field_defaults_and_validation() -> None:
    default = OpenVINOBackendConfig()
    assert (default.use_dynamo, default.performance_hint, default.quantization) == (True, "LATENCY", None)
    keys = {OpenVINOBackendConfig(quantization=q).key() for q in (None, "int8", "int8_weights")}
    assert len(keys) == 3
    config = OpenVINOBackendConfig(performance_hint="throughput", quantization="int8")
    assert config.describe() == "performance_hint=THROUGHPUT,quantization=int8"
    assert OpenVINOBackendConfig.from_dict(config.to_dict()) == config
    assert OpenVINOBackendConfig.from_dict({"use_dynamo": False}).quantization is None  # older checkpoints
    for bad in ("int4", "INT8", 8, True):
        with pytest.raises(ConfigError, match=r"OpenVINOBackendConfig\.quantization must be None or one of 'int8', "
                                              r"'int8_weights', got"):
            OpenVINOBackendConfig(quantization=bad)
    assert OpenVINOBackendConfig(performance_hint="THROUGHPUT", quantization="int8").quantization == "int8"
    for hint in ("THROUGHPUT", "CUMULATIVE_THROUGHPUT"):  # compressed weights run wrongly on several streams
        with pytest.raises(ConfigError, match=r"quantization='int8_weights' needs performance_hint='LATENCY', got "
                                              rf"'{hint}'.*several streams.*quantization='int8'"):
            OpenVINOBackendConfig(performance_hint=hint, quantization="int8_weights")


def test_precision_is_int8_and_no_float_retry() -> None:
    for mode in quantize.QUANTIZATION_MODES:
        backend = OpenVINOBackend(OpenVINOBackendConfig(quantization=mode))
        assert backend.executed_precision == "int8"
        assert backend.precision_fallback() is None
        assert backend.describe() == f"OpenVINOBackend(quantization={mode})"
    assert OpenVINOBackend().precision_fallback() is not None


def test_default_variants_add_int8_only_with_nncf_and_one_thread_only_with_more_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def variants() -> list[tuple[str, str | None, int | None]]:
        return [(b._config.performance_hint, b._config.quantization, b._config.num_threads)
                for b in OpenVINOBackend.default_variants()]

    monkeypatch.setattr(openvino_backend, "usable_cores", lambda: 2)
    assert variants() == [("LATENCY", None, None), ("THROUGHPUT", None, None), ("LATENCY", None, 1),
                          ("LATENCY", "int8", None), ("THROUGHPUT", "int8", None), ("LATENCY", "int8", 1)]
    monkeypatch.setattr(openvino_backend, "nncf_available", lambda: False)
    assert variants() == [("LATENCY", None, None), ("THROUGHPUT", None, None), ("LATENCY", None, 1)]
    monkeypatch.setattr(openvino_backend, "usable_cores", lambda: 1)  # one thread is what the plugin uses anyway
    assert variants() == [("LATENCY", None, None), ("THROUGHPUT", None, None)]


def test_missing_nncf_fails_the_build_with_an_install_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "nncf", None)  # any `import nncf` now raises ImportError
    ((spec, samples),) = record(mlp(), [(b, ((torch.randn(b, 32),), {})) for b in (1, 2)])
    backend = OpenVINOBackend(OpenVINOBackendConfig(quantization="int8"))
    with pytest.raises(BackendUnavailableError, match=r"pip install torch-tweak\[nncf\]"):
        backend.build(mlp(), spec, [s.sample for s in samples], CPU, tmp_path)
    assert not (tmp_path / "openvino").exists()  # failed before converting


# calibration --------------------------------------------------------------------------------------------------


def test_calibration_inputs_follow_graph_spec_order() -> None:
    class TwoInputs(nn.Module):
        def forward(self, x: torch.Tensor, *, mask: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return x * mask + bias

    calls = [(b, ((torch.randn(b, 3),), {"mask": torch.ones(b, 3), "bias": torch.zeros(b, 3)})) for b in (1, 2)]
    ((spec, samples),) = record(TwoInputs(), calls)
    items = quantize.calibration_inputs(spec, [s.sample for s in samples])
    assert [len(item) for item in items] == [len(spec.inputs)] * 2
    for (args, kwargs), item in zip([c[1] for c in calls], items, strict=True):
        expected = [args[0], kwargs["bias"], kwargs["mask"]]  # positional first, then keywords sorted by name
        for array, tensor in zip(item, expected, strict=True):
            assert (torch.from_numpy(array) == tensor).all()


def test_int8_calibrates_on_the_calibrating_calls_and_is_judged_on_the_held_out_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[tuple]] = []
    original = nncf.quantize

    def spy(model, dataset, **options):
        seen.append([tuple(a.shape for a in item) for item in dataset.get_inference_data()])
        assert options["subset_size"] == len(seen[-1]) and options["fast_bias_correction"] is True
        return original(model, dataset, **options)

    monkeypatch.setattr(nncf, "quantize", spy)
    _, report = tune("mlp", "int8")
    # calls: 8 at batch 1, then one at batch 4 and one at batch 8 (tt.config.max_num_batches_after_first_size); the
    # first of each shape stays in memory, the 7 others go to disk, where calls 1 and 5 are held out: calibration
    # sees 5 calls at batch 1
    assert seen == [[((1, 32),)] * 5]
    row = report.modules[0].graphs[0].candidates[0]
    assert row.fidelity is not None and row.fidelity["passed"]
    assert (row.fidelity["samples"], row.fidelity["held_out_samples"]) == (5, 2)  # 3 in memory + 2 held out


def test_int8_without_kept_calls_calibrates_on_all_in_memory_samples_but_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[tuple]] = []
    original = nncf.quantize
    monkeypatch.setattr(nncf, "quantize", lambda model, dataset, **options: seen.append(
        [tuple(a.shape for a in item) for item in dataset.get_inference_data()]) or original(model, dataset, **options))
    monkeypatch.setattr(tt.config, "max_num_calibration_samples", 0)
    _, report = tune("mlp", "int8")
    assert seen == [[((1, 32),), ((4, 32),)]]  # batch 8, recorded last, is held out for the fidelity check
    row = report.modules[0].graphs[0].candidates[0]
    assert row.fidelity["passed"] and (row.fidelity["samples"], row.fidelity["held_out_samples"]) == (3, 0)


# fidelity verdicts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
@pytest.mark.parametrize("mode", ["int8", "int8_weights"])
def test_int8_candidates_build_and_pass(kind: str, mode: str) -> None:
    model, report = tune(kind, mode)
    (row,) = report.modules[0].graphs[0].candidates
    assert row.status == CandidateStatus.CHOSEN, row.error
    assert row.precision == "int8" and row.fidelity["precision"] == "int8" and row.fidelity["passed"]
    ops = op_types(openvino_of(model)._ov_model_xml)
    if mode == "int8":
        assert ops.get("FakeQuantize", 0) >= 2
    else:  # the linear layers' weights; convolutions keep theirs in float
        assert ops.get("Int8Constant", 0) >= (2 if kind == "mlp" else 1) and "FakeQuantize" not in ops
        ir = converter.import_openvino().Core().read_model(str(openvino_of(model)._ov_model_xml))
        for op in ir.get_ops():
            if op.get_type_name() == "Convolution":
                assert op.input_value(1).get_node().get_element_type().to_string() == "f32"
    factory, shape = MODELS[kind]
    x = torch.randn(3, *shape)
    with torch.no_grad():  # an input neither calibration nor the check saw: close, not within the check's limits
        assert cosine(model(x), factory()(x)) > 0.95


def test_int8_is_rejected_on_outliers_while_int8_weights_passes() -> None:
    model, report = tune("outliers", "int8")
    (row,) = report.modules[0].graphs[0].candidates
    assert row.status == CandidateStatus.REJECTED and row.precision == "int8"
    assert row.error.startswith("FidelityError:") and "tolerance for int8" in row.error
    assert report.modules[0].status == "passthrough"  # the module runs its original code, the row says why
    model, report = tune("outliers", "int8_weights")
    assert report.modules[0].graphs[0].candidates[0].status == CandidateStatus.CHOSEN
    # on CPUs with VNNI/AMX OpenVINO would quantize the activations at run time unless told not to
    assert int(openvino_of(model)._compiled_model.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 0


def test_int8_weights_without_linear_layers_is_a_build_failure_row() -> None:
    _, report = tune("convs_only", "int8_weights")
    (row,) = report.modules[0].graphs[0].candidates
    assert row.status == CandidateStatus.BUILD_FAILED
    assert "BuildError: NNCF quantized no weights" in row.error and "quantization='int8'" in row.error


# IR reuse --------------------------------------------------------------------------------------------------------


def test_ir_is_reused_only_for_the_same_quantization_and_calibration(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model, conversions = mlp(), []
    original = converter.to_ov_model
    monkeypatch.setattr(converter, "to_ov_model", lambda *a, **k: conversions.append(1) or original(*a, **k))

    def build(mode: str | None, seed: int) -> tuple[dict[str, int], bool]:
        """Build in one folder for every config; returns the IR's operations and whether it was reused."""
        torch.manual_seed(seed)
        ((spec, samples),) = record(model, [(b, ((torch.randn(b, 32),), {})) for b in (1, 2, 4)])
        backend = OpenVINOBackend(OpenVINOBackendConfig(quantization=mode))
        before = len(conversions)
        backend.build(model, spec, [s.sample for s in samples], CPU, tmp_path)
        return op_types(backend._ov_model_xml), len(conversions) == before

    ops, reused = build(None, 0)
    assert "FakeQuantize" not in ops and "Int8Constant" not in ops and not reused
    ops, reused = build("int8", 0)
    assert ops.get("FakeQuantize", 0) > 0 and not reused  # not the fp32 IR in the folder
    ops, reused = build("int8", 0)
    assert ops.get("FakeQuantize", 0) > 0 and reused  # same module, config and calibration samples
    ops, reused = build("int8", 1)
    assert ops.get("FakeQuantize", 0) > 0 and not reused  # other calibration samples: calibrated again
    ops, reused = build("int8_weights", 1)
    assert "Int8Constant" in ops and "FakeQuantize" not in ops and not reused
    ops, reused = build(None, 1)
    assert "FakeQuantize" not in ops and "Int8Constant" not in ops and not reused


def test_candidates_share_one_conversion_and_one_calibration(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls, conversions = [], []
    original, convert = nncf.quantize, converter.to_ov_model
    monkeypatch.setattr(nncf, "quantize", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    monkeypatch.setattr(converter, "to_ov_model", lambda *a, **k: conversions.append(1) or convert(*a, **k))
    model = mlp()
    ((spec, samples),) = record(model, [(b, ((torch.randn(b, 32),), {})) for b in (1, 2, 4)])
    built = {}
    for hint, mode in (("LATENCY", None), ("LATENCY", "int8"), ("THROUGHPUT", "int8")):
        backend = OpenVINOBackend(OpenVINOBackendConfig(performance_hint=hint, quantization=mode))
        backend.build(model, spec, [s.sample for s in samples], CPU, tmp_path / backend.key())  # as strategies do
        built[hint, mode] = backend
    assert len(conversions) == 1  # the int8 candidate quantized the float candidate's IR
    assert len(calls) == 1  # the THROUGHPUT candidate copied the IR calibrated for the LATENCY one
    latency, throughput = (built[hint, "int8"]._ov_model_xml for hint in ("LATENCY", "THROUGHPUT"))
    assert latency.parent != throughput.parent and latency.read_bytes() == throughput.read_bytes()
    assert "FakeQuantize" not in op_types(built["LATENCY", None]._ov_model_xml)
    sample = samples[-1]
    torch.testing.assert_close(built["THROUGHPUT", "int8"].infer(*sample.args),
                               built["LATENCY", "int8"].infer(*sample.args))


# checkpoint --------------------------------------------------------------------------------------------------------

BLOCK_NNCF = (
    "import runpy, sys; sys.modules['nncf'] = None;"  # any import of nncf now fails: loading must not need it
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_int8_checkpoint_loads_warm_in_a_fresh_process_without_nncf(tmp_path: Path) -> None:
    torch.manual_seed(1)
    backend = OpenVINOBackend(OpenVINOBackendConfig(quantization="int8"))
    model = tt.Module(toy_cnn(), name="cnn", strategy=tt.OneBackendStrategy(backend))
    tt.tune(model, [torch.randn(3, 12, 12) for _ in range(4)], batch_sizes=[1, 2, 4])
    x = torch.randn(5, 3, 12, 12)
    with torch.no_grad():
        expected = model(x)
    path = tt.save(model, tmp_path / "int8.tt")
    data, out = tmp_path / "x.safetensors", tmp_path / "y.safetensors"
    save_file({"input.0": x}, data)
    # checkpoint_child builds toy_models.cnn with other weights (seed 99): the IR must bring its own
    proc = subprocess.run([sys.executable, "-c", BLOCK_NNCF, str(TESTS / "checkpoint_child.py"), "cnn", str(path),
                           str(data), str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backends"] == {"cnn": sorted({type(b).__name__ for b in model.backends.values()})}
    assert not any(result["compiles"].values()), result["compiles"]
    torch.testing.assert_close(load_file(out)["output.0"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("saturates", [True, False])
def test_every_layer_gets_the_overflow_fix_where_int8_kernels_saturate(monkeypatch: pytest.MonkeyPatch,
                                                                       saturates: bool) -> None:
    import nncf

    from torch_tweak.torch import environment

    seen: list[dict] = []
    real = nncf.quantize

    def spy(model, dataset, **options):
        seen.append(options)
        return real(model, dataset, **options)

    monkeypatch.setattr(nncf, "quantize", spy)
    monkeypatch.setattr(environment, "int8_dot_saturates", lambda: saturates)
    _, report = tune("mlp", "int8")
    if saturates:  # 7-bit weights are faithful on any CPU (8-bit ones only where the kernels do not saturate)
        assert report.modules[0].graphs[0].candidates[0].status == CandidateStatus.CHOSEN
    (options,) = seen
    fix = getattr(options.get("advanced_parameters"), "overflow_fix", None)
    assert (fix == nncf.OverflowFix.ENABLE) if saturates else fix is None
