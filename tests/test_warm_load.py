"""Warm load (issue 18): Inductor and TorchAO checkpoints serve their first call without compiling.

Each backend tunes a tiny linear model once (module fixture) and saves it with its warm-load package; fresh
processes (``warm_load_child.py``) then load it trusted (nothing compiles), untrusted (the package is not
extracted, the module compiles, a warning says why) and with a simulated environment change (the package's
recorded torch version differs: it is not used, the module compiles, a warning says why). Outputs always
match the tuned module's, including at a batch size tuning never saw.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_child import LinearNet
from checkpoint_helpers import members, rewrite
from safetensors.torch import load_file, save_file

import torch_tweak.torch as tt
from torch_tweak.errors import CheckpointError
from torch_tweak.torch.backend import TorchAOBackend, TorchInductorBackend, _warm_package
from torch_tweak.torch.checkpoint import verify

CHILD = Path(__file__).parent / "warm_load_child.py"
pytestmark = pytest.mark.slow  # compiles Inductor and TorchAO packages, loads them in fresh processes
BACKENDS = {"inductor": TorchInductorBackend, "torchao": TorchAOBackend}
NO_COMPILES = {"torch.compile": 0, "torch.export.export": 0, "aoti_compile_and_package": 0, "to_ov_model": 0}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def saved(request, tmp_path_factory):
    """A tuned LinearNet saved with the backend, inputs (batch 3, 1 and 17: never seen) and the tuned outputs."""
    folder = tmp_path_factory.mktemp(f"warm_{request.param}")
    tt.config.cache_dir = folder / "cache"
    wrapped = tt.Module(LinearNet(), name="lin", strategy=tt.OneBackendStrategy(BACKENDS[request.param]()))
    tt.tune(wrapped, [torch.randn(64) for _ in range(4)], batch_sizes=[1, 2])
    inputs = [torch.randn(3, 64), torch.randn(1, 64), torch.randn(17, 64)]
    with torch.no_grad():
        expected = [wrapped(x) for x in inputs]
    path = tt.save(wrapped, folder / "lin.tt")
    del wrapped
    gc.collect()
    return request.param, path, inputs, expected


def run_fresh(checkpoint: Path, inputs: list[torch.Tensor], folder: Path, *extra: str):
    data, out = folder / "inputs.safetensors", folder / "outputs.safetensors"
    save_file({f"input.{i}": x.contiguous() for i, x in enumerate(inputs)}, data)
    proc = subprocess.run([sys.executable, str(CHILD), "linear", str(checkpoint), str(data), str(out), *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = load_file(out)
    return [outputs[f"output.{i}"] for i in range(len(inputs))], json.loads(proc.stdout.strip().splitlines()[-1])


def assert_same(outputs: list[torch.Tensor], expected: list[torch.Tensor], kind: str) -> None:
    for out, ref in zip(outputs, expected, strict=True):
        assert out.shape == ref.shape
        error = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
        assert error <= (1e-5 if kind == "inductor" else 2e-2), error


def nested_states(value):
    """Every dict in a stored backend state (a guard or router nests its inner backends' states)."""
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from nested_states(item)
    elif isinstance(value, list):
        for item in value:
            yield from nested_states(item)


def test_checkpoint_marks_the_package_native(saved):
    _, path, _, _ = saved
    manifest = json.loads(members(path)["manifest.json"])
    backend = manifest["modules"][0]["graphs"][0]["backend"]
    assert [m.rpartition("/")[2] for m in backend["native_artifacts"]] == [_warm_package.PACKAGE_NAME]
    assert backend["native_code"] is False  # optional: the checkpoint still loads without trust
    assert verify(path)["native_code"] == []


def test_trusted_load_compiles_nothing(saved, tmp_path):
    kind, path, inputs, expected = saved
    outputs, report = run_fresh(path, inputs, tmp_path, "--trust-native-code")
    assert report["state"] == "TUNED" and report["warm_packages"]
    assert report["compiles"] == NO_COMPILES and report["dynamo_frames"] == 0 and report["warnings"] == []
    assert_same(outputs, expected, kind)


def test_untrusted_load_does_not_use_the_package(saved, tmp_path):
    kind, path, inputs, expected = saved
    outputs, report = run_fresh(path, inputs, tmp_path)
    assert report["state"] == "TUNED" and report["warm_packages"] == []
    assert report["compiles"]["torch.compile"] >= 1
    assert any("CheckpointWarning" in w and "not trusted" in w for w in report["warnings"]), report["warnings"]
    assert_same(outputs, expected, kind)


def test_environment_mismatch_compiles_and_warns(saved, tmp_path):
    kind, path, inputs, expected = saved
    changed = tmp_path / "other_env.tt"
    changed.write_bytes(path.read_bytes())

    def other_torch(manifest):
        for state in nested_states(manifest["modules"][0]["graphs"][0]["backend"]["state"]):
            if isinstance(state.get(_warm_package.STATE_ENVIRONMENT), dict):
                state[_warm_package.STATE_ENVIRONMENT]["torch"] = "0.0.1"

    rewrite(changed, other_torch)
    outputs, report = run_fresh(changed, inputs, tmp_path, "--trust-native-code")
    assert report["state"] == "TUNED" and report["warm_packages"] == []
    assert report["compiles"]["torch.compile"] >= 1
    assert any("WarmLoadWarning" in w and "torch 0.0.1 →" in w for w in report["warnings"]), report["warnings"]
    assert_same(outputs, expected, kind)


def test_a_package_reference_outside_the_archive_is_refused(saved, tmp_path):
    _, path, _, _ = saved
    edited = tmp_path / "edited.tt"
    edited.write_bytes(path.read_bytes())

    def point_elsewhere(manifest):
        for state in nested_states(manifest["modules"][0]["graphs"][0]["backend"]["state"]):
            if _warm_package.STATE_PACKAGE in state:
                state[_warm_package.STATE_PACKAGE] = "/tmp/elsewhere.pt2"

    rewrite(edited, point_elsewhere)
    with pytest.raises(CheckpointError, match="not a file inside the checkpoint"):
        tt.load(LinearNet(), edited, trust_native_code=True)


def test_mismatch_reasons():
    here = _warm_package.fingerprint(("torch", "torchao"))
    assert _warm_package.mismatch(here, ("torch", "torchao")) is None
    assert "torchao" in _warm_package.mismatch({**here, "torchao": "0.1"}, ("torch", "torchao"))
    assert _warm_package.mismatch({**here, "torchao": "0.1"}, ("torch",)) is None  # Inductor does not use torchao
    assert "missing here" in _warm_package.mismatch({**here, "isa": [*(here["isa"] or []), "avx10_2"]}, ("torch",))
    assert "only here" in _warm_package.mismatch({**here, "isa": (here["isa"] or [])[1:]}, ("torch",))
    assert "does not record" in _warm_package.mismatch(None, ("torch",))


def test_warm_up_covers_every_batch_and_sequence_bucket():
    from toy_models import SeqModel

    from torch_tweak.torch.backend import TorchEagerBackend
    from torch_tweak.torch.backend._compile_helpers import warm_up_inputs
    from torch_tweak.torch.module.state import internals

    wrapped = tt.Module(SeqModel(), name="seq", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(lambda x: wrapped(x, attention_mask=torch.ones_like(x)),
            [torch.randint(0, 50, (n,)) for n in (1, 5, 9, 12)], batch_sizes=[1, 2])
    spec = internals(wrapped).graphs[0].spec
    (b_lo, b_hi), s_lo, s_hi = spec.batch_range(), spec.inputs[0].min_shape[1], spec.inputs[0].max_shape[1]
    assert b_lo == 1 and s_lo == 1 and b_hi >= 2 and s_hi >= 5
    calls = warm_up_inputs(spec, torch.device("cpu"))
    shapes = [tuple(args[0].shape) for args, _ in calls]
    assert shapes[0] == (2, 2)  # the call marked dynamic: sizes >= 2, one graph for all of them
    # sizes 1 specialise, so every combination with them gets its call; and the largest sizes seen
    assert set(shapes) == {(b, s) for b in (2, 1, b_hi) for s in (2, 1, s_hi)}
    assert all(kwargs["attention_mask"].shape == args[0].shape for args, kwargs in calls)


def test_warm_up_runs_each_guarded_call_once():
    from torch_tweak.torch.backend._compile_helpers import distinct_calls

    x = torch.randn(2, 3)
    synthesized = [((torch.randn(2, 3),), {"scale": 1.0})]
    recorded = [
        ((x,), {"scale": 1.0}),  # what the synthesized call compiled: nothing to warm up
        ((torch.randn(2, 4),), {"scale": 1.0}),  # another shape
        ((torch.randn(2, 4),), {"scale": 1.0}),  # that shape again
        ((x,), {"scale": 2.0}),  # another non-tensor value: Dynamo guards on it
        ((x.t().contiguous().t(),), {"scale": 1.0}),  # other strides
        ((x.double(),), {"scale": 1.0}),  # another dtype
    ]
    kept = distinct_calls(synthesized, recorded)
    assert [r for r in recorded if any(r is k for k in kept)] == [recorded[1], recorded[3], recorded[4], recorded[5]]
    assert distinct_calls([], recorded[:1]) == recorded[:1]


def test_recompile_limit_fallback_is_logged(caplog):
    import logging

    from torch_tweak.torch.backend._compile_helpers import watch_recompile_limit

    watch_recompile_limit()
    watch_recompile_limit()  # installed once
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    assert sum(type(f).__name__ == "_RecompileLimitWatch" for f in dynamo_log.filters) == 1
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        dynamo_log.warning("torch._dynamo hit config.%s (%s)\n   function: 'forward'", "recompile_limit", 8)
    assert any(r.name.startswith("torch_tweak") and "recompile limit" in r.getMessage() and "eagerly" in r.getMessage()
               for r in caplog.records)
