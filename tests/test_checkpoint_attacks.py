"""Checkpoints crafted by a stranger: each test edits a real checkpoint as an attacker would (manifest, members
and the sums file rewritten to match) and checks that tt.load refuses it before anything runs or is read.

The attack classes: commands through backend options, artifact paths outside the archive, constructors
named by output structures, native code, decompression bombs and unused members, plus what a killed save
or load leaves behind, I/O failures and signatures.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import members, resign, rewrite, save_mlp, write_zip
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import CheckpointError, ConfigError
from torch_tweak.torch.backend.torch_inductor import TorchInductorBackendConfig
from torch_tweak.torch.checkpoint import archive, verify, writer

CALLS: list[str] = []


class Evil(dict):
    """A Mapping whose constructor has a side effect: a checkpoint must never be able to call it."""

    def __init__(self, *args, **kwargs) -> None:
        CALLS.append("Evil")
        super().__init__(*args, **kwargs)


@pytest.fixture
def saved(tmp_path):
    return save_mlp(tmp_path / "m.tt")


def graph(data: dict) -> dict:
    return data["modules"][0]["graphs"][0]


def as_backend(data: dict, type_name: str, module: str, **state) -> None:
    """Make the stored eager backend claim to be ``type_name`` with extra ``state``."""
    backend = graph(data)["backend"]
    backend["type"], backend["class"] = type_name, f"{module}:{type_name}"
    backend["state"]["type"] = type_name
    backend["state"].update(state)


def refused(path: Path, match: str, **kwargs) -> None:
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        tt.load(model, path, **kwargs)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# 1. commands through backend options ------------------------------------------------------------------


@pytest.mark.parametrize("option, value", [("cpp.cxx", "SCRIPT"), ("global_cache_dir", "/tmp"), ("trace.enabled", True),
                                           ("trace.debug_dir", "/tmp"), ("aot_inductor.output_path", "/tmp/x"),
                                           ("cpp.simdlen", -5)])
def test_inductor_options_that_run_programs_or_touch_files_are_refused(saved, tmp_path, option, value):
    path = saved[0]
    marker = tmp_path / "ran"
    script = tmp_path / "cxx.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\nexec g++ \"$@\"\n")
    script.chmod(0o700)
    config = {"fullgraph": False, "dynamic": None, "mode": None, "autocast_enabled": False, "autocast_dtype": None,
              "options": {option: str(script) if value == "SCRIPT" else value}}
    rewrite(path, lambda d: as_backend(d, "TorchInductorBackend", "torch_tweak.torch.backend.torch_inductor",
                                       config=config))
    refused(path, rf"settings a checkpoint may not carry: Inductor option '{option}'")
    with pytest.raises(CheckpointError, match="may not carry"):
        verify(path)
    assert not marker.exists()


def test_inert_inductor_options_are_allowed_and_unsafe_ones_listed():
    assert TorchInductorBackendConfig(options={"freezing": True, "cpp.threads": 2}).unsafe_settings() == []
    listed = TorchInductorBackendConfig(options={"cpp.cxx": "x", "freezing": True}).unsafe_settings()
    assert len(listed) == 1 and "'cpp.cxx' is not on the list of inert options" in listed[0]


# 2. paths that escape the archive ----------------------------------------------------------------------


def _outside_ir(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    for name in ("openvino_model.xml", "openvino_model.bin"):
        (folder / name).write_text("not an IR")
    return folder


@pytest.mark.openvino
def test_openvino_ir_path_outside_the_archive_is_refused(saved, tmp_path):
    pytest.importorskip("openvino")
    path = saved[0]
    outside = _outside_ir(tmp_path)
    rewrite(path, lambda d: as_backend(d, "OpenVINOBackend", "torch_tweak.torch.backend.openvino.openvino_backend",
                                       config={"use_dynamo": True, "performance_hint": "LATENCY",
                                               "inference_precision": None},
                                       ov_model_dir=str(outside), output_object=["T"]))
    refused(path, r"'ov_model_dir' is '.*outside', not a file inside the checkpoint")
    with pytest.raises(CheckpointError, match="not a file inside the checkpoint"):
        verify(path)


def test_aot_package_path_outside_the_archive_is_refused(saved, tmp_path):
    path = saved[0]
    package = tmp_path / "model.pt2"
    package.write_bytes(b"PK")
    rewrite(path, lambda d: as_backend(d, "TorchInductorAOTBackend", "torch_tweak.torch.backend.torch_inductor_aot",
                                       config={"options": None, "strict": False}, package=str(package)))
    refused(path, r"'package' is '.*model.pt2', not a file inside the checkpoint", trust_native_code=True)


# 3. constructors named by the manifest -------------------------------------------------------------------


def _output_structure(data: dict, structure: list) -> None:
    graph(data)["graph_spec"]["output_structure"] = structure
    graph(data)["backend"]["state"]["graph_spec"]["output_structure"] = structure


def test_unregistered_mapping_class_is_never_constructed(saved):
    path = saved[0]
    CALLS.clear()
    name = f"{Evil.__module__}:{Evil.__qualname__}"
    rewrite(path, lambda d: _output_structure(d, ["map", name, ["fid"], [["T"]]]))
    refused(path, r"Evil.*register_type")
    assert CALLS == []


def test_numpy_npzfile_cannot_be_named_as_an_output_container(saved):
    import numpy.lib.npyio  # noqa: F401 - imported, so the attack can name it

    path = saved[0]
    structure = ["map", "numpy.lib.npyio:NpzFile", ["fid", "allow_pickle"], [["T"], ["c", True]]]
    rewrite(path, lambda d: _output_structure(d, structure))
    refused(path, r"NpzFile.*register_type")
    rewrite(path, extra={"payload.npy": b"\x93NUMPY"})  # the pickle the attack would make NpzFile read
    refused(path, r"nothing in its manifest uses \(\['payload.npy'\]\)")


# 4. native code ------------------------------------------------------------------------------------------


def _claim_native(path: Path, flag: bool) -> None:
    rewrite(path, lambda d: (as_backend(d, "TorchInductorAOTBackend", "torch_tweak.torch.backend.torch_inductor_aot",
                                        config={"options": None, "strict": False},
                                        package={"$tt": "artifact", "kind": "file", "member": "artifacts/m0/g0/a0/model.pt2"}),
                             graph(d)["backend"].update(native_code=flag)),
            extra={"artifacts/m0/g0/a0/model.pt2": b"not really a package"})


@pytest.mark.parametrize("flag", [True, False])
def test_native_code_is_refused_unless_trusted_whatever_the_manifest_says(saved, flag):
    path = saved[0]
    _claim_native(path, flag)
    refused(path, r"carries native code .*\['mlp'\].*trust_native_code=True.*verify_key")
    assert verify(path)["native_code"] == ["mlp"]
    refused(path, "AOTInductor package|deploying its backends failed", trust_native_code=True)


def test_trust_native_code_must_be_a_bool(saved):
    with pytest.raises(ConfigError, match="trust_native_code must be True or False"):
        tt.load(mlp(), saved[0], trust_native_code="yes")


# signatures ----------------------------------------------------------------------------------------------


def test_hmac_signed_checkpoint_loads_with_its_key_and_not_with_another(tmp_path):
    wrapped = tt.Module(mlp(), name="mlp", strategy=tt.OneBackendStrategy(tt.backend.TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(2)])
    x = torch.randn(2, 8)
    expected = wrapped(x)
    key = os.urandom(32)
    path = tt.save(wrapped, tmp_path / "s.tt", signing_key=key)
    del wrapped
    gc.collect()
    assert "signature.json" in members(path) and verify(path, verify_key=key)["signed"]
    loaded = tt.load(mlp(seed=5), path, verify_key=key)
    assert torch.allclose(loaded(x), expected)
    del loaded
    gc.collect()
    refused(path, "does not match the verify_key", verify_key=os.urandom(32))
    rewrite(path, lambda d: d.update(created="2000-01-01T00:00:00Z"))  # tampered after signing, sums rewritten
    refused(path, "does not match the verify_key", verify_key=key)
    with pytest.raises(ConfigError, match="at least 16"):
        tt.save(tt.Module(mlp(), name="other"), tmp_path / "k.tt", signing_key=b"short")


def test_unsigned_checkpoint_is_refused_when_a_key_is_required(saved):
    refused(saved[0], "is not signed, but a verify_key was given", verify_key=os.urandom(32))


def test_ed25519_signed_native_checkpoint_loads_with_the_public_key(saved, tmp_path):
    ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
    path, x, expected = saved
    private = ed25519.Ed25519PrivateKey.generate()
    wrapped = tt.load(mlp(seed=5), path)
    tt.save(wrapped, tmp_path / "e.tt", signing_key=private)
    del wrapped
    gc.collect()
    assert torch.allclose(tt.load(mlp(seed=6), tmp_path / "e.tt", verify_key=private.public_key())(x), expected)
    gc.collect()
    refused(tmp_path / "e.tt", "does not match", verify_key=ed25519.Ed25519PrivateKey.generate().public_key())
    refused(tmp_path / "e.tt", "signed with ed25519, but the verify_key is an HMAC secret", verify_key=os.urandom(32))


# 5. bounded extraction, leftovers, I/O failures ------------------------------------------------------------


def test_decompression_bomb_is_refused_before_extraction(saved, tmp_path):
    path = saved[0]
    content = members(path)
    bomb = b"\0" * (4 << 20)
    info = zipfile.ZipInfo("artifacts/m0/g0/a0/big.bin")
    info.compress_type = zipfile.ZIP_DEFLATED
    entries = [*resign({**content, info.filename: bomb}, json.loads(content["manifest.json"])).items()]
    write_zip(path, [(info, bomb) if name == info.filename else (name, data) for name, data in entries])
    refused(path, "decompression bomb")


def test_members_nothing_uses_are_refused(saved):
    path = saved[0]
    rewrite(path, extra={"artifacts/m0/g0/openvino_model_cache/blob": b"crafted"})
    refused(path, r"nothing in its manifest uses \(\['artifacts/m0/g0/openvino_model_cache/blob'\]\)")
    with pytest.raises(CheckpointError, match="nothing in its manifest uses"):
        verify(path)


def _dead_tag() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return f"{proc.pid}x1"


_STALLED_SAVE = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    import torch_tweak.torch as tt
    from torch_tweak.torch.checkpoint import writer
    from checkpoint_helpers import tuned_mlp
    real = writer._write_chunk
    def stall(stream, data):
        real(stream, data)
        print("stalled", flush=True)
        time.sleep(600)
    writer._write_chunk = stall
    tt.save(tuned_mlp(), {path!r})
""")


def test_leftovers_of_a_killed_save_are_removed_by_the_next_save(tmp_path):
    path = tmp_path / "k.tt"
    code = _STALLED_SAVE.format(tests=str(Path(__file__).parent), path=str(path))
    env = {**os.environ, "TORCH_TWEAK_CACHE_DIR": str(tmp_path / "child_cache")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "stalled"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".k.tt.")]
    assert left, "the stalled save should have left its temporary files"
    live = tmp_path / f".k.tt.{os.getpid()}x0.keep.partial"  # a save still running in this process
    live.write_bytes(b"")
    save_mlp(path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".k.tt.")) == [live.name]
    assert tt.load(mlp(), path).state is tt.ModuleState.TUNED


def test_load_folders_of_killed_loads_are_removed(saved):
    path = saved[0]
    gc.collect()
    folder = tt.config.cache_dir / "checkpoints"
    tt.load(mlp(), path)
    gc.collect()
    stale = folder / f"load_{_dead_tag()}_abc"
    (stale / "artifacts").mkdir(parents=True)
    tt.load(mlp(), path)
    assert not stale.exists()


def test_save_creates_missing_folders_owner_only(tmp_path):
    wrapped = tt.Module(mlp(), name="mlp", strategy=tt.OneBackendStrategy(tt.backend.TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(2)])
    target = tmp_path / "new" / "deeper" / "m.tt"
    tt.save(wrapped, target)
    for folder in (tmp_path / "new", tmp_path / "new" / "deeper"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_full_disk_while_writing_tensors_is_a_checkpoint_error(tmp_path, monkeypatch):
    from safetensors import SafetensorError
    from safetensors import torch as st

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(st, "save_file", full)
    wrapped = tt.Module(mlp(), name="mlp", strategy=tt.OneBackendStrategy(tt.backend.TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(2)])
    with pytest.raises(CheckpointError, match=r"Could not write the checkpoint .*m.tt.*The disk is full"):
        tt.save(wrapped, tmp_path / "m.tt")
    assert not list(tmp_path.glob(".m.tt.*")) and not (tmp_path / "m.tt").exists()


def test_unwritable_folder_is_a_checkpoint_error_naming_it(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    wrapped = tt.Module(mlp(), name="mlp", strategy=tt.OneBackendStrategy(tt.backend.TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(2)])
    monkeypatch.setattr(writer.tempfile, "mkstemp", denied)
    with pytest.raises(CheckpointError, match=rf"Permission denied \(in {tmp_path}\).*writable"):
        tt.save(wrapped, tmp_path / "m.tt")


def test_extraction_needs_room_on_the_disk(saved, monkeypatch):
    monkeypatch.setattr(archive.shutil, "disk_usage", lambda p: type("U", (), {"free": 10})())
    refused(saved[0], r"needs \d+ bytes to extract, but .* has 10 bytes free")
