"""Every kind of bad checkpoint gives a CheckpointError that says what is wrong, and leaves the model untouched."""

from __future__ import annotations

import errno
import gc
import json
import re
import stat
import struct
import sys
import zipfile

import pytest
import torch
from checkpoint_helpers import (
    assert_untouched,
    eager,
    members,
    rewrite,
    save_mlp,
    snapshot,
    tuned_mlp,
    write_sums,
    write_zip,
)
from torch import nn
from toy_models import Pipeline, mlp

import torch_tweak.torch as tt
from torch_tweak.errors import CheckpointError
from torch_tweak.torch import environment
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.checkpoint import CheckpointWarning, archive, manifest, writer


class FailingDeployBackend(TorchEagerBackend):
    """Eager, but deploying from a checkpoint fails."""

    def _deploy(self) -> None:
        raise RuntimeError("deliberate deploy failure")


class NativeEagerBackend(TorchEagerBackend):
    """Eager that claims its artifacts are machine code for the saving CPU."""

    native_code = True


class OpaqueStateBackend(TorchEagerBackend):
    """Eager whose to_dict holds an object a checkpoint cannot store."""

    def to_dict(self):
        return {**super().to_dict(), "extra": object()}


@pytest.fixture
def saved(tmp_path):
    return save_mlp(tmp_path / "mlp.tt")


def expect_error(path, match, model=None, **kwargs):
    """Loading ``path`` raises CheckpointError matching ``match`` and changes nothing."""
    model = model if model is not None else mlp()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=match):
        tt.load(model, path, **kwargs)
    assert_untouched(model, before)


def data_offset(path, name):
    """Where member ``name``'s bytes start in the zip file."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


@pytest.mark.parametrize("member", ["manifest.json", "tensors/m0.safetensors"])
def test_flipped_byte_in_any_member(saved, member):
    path = saved[0]
    start, size = data_offset(path, member)
    raw = bytearray(path.read_bytes())
    raw[start + size // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    expect_error(path, "cannot be read|does not match|CRC")


@pytest.mark.parametrize("keep", [0.5, 0.95])
def test_truncated_zip(saved, keep):
    path = saved[0]
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])
    expect_error(path, "cannot be read")


@pytest.mark.parametrize(("name", "problem"), [
    ("../evil.txt", "'..' component"), ("tensors/../../evil", "'..' component"), ("/etc/evil", "absolute path"),
    ("C:/evil", "absolute path"), ("a\\..\\evil", "backslash"),
])
def test_path_escaping_and_absolute_entries(saved, name, problem):
    path = saved[0]
    content = members(path)
    write_zip(path, [*content.items(), (name, b"x")])
    expect_error(path, f"member named {re.escape(repr(name))}, which is refused because .*{problem}")


def test_symlink_entry(saved):
    path = saved[0]
    link = zipfile.ZipInfo("tensors/link")
    link.create_system = 3
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    write_zip(path, [*members(path).items(), (link, b"/etc/passwd")])
    expect_error(path, "symbolic link entry 'tensors/link'")


def test_duplicate_member(saved):
    path = saved[0]
    content = members(path)
    with pytest.warns(UserWarning):  # zipfile warns when writing a duplicate name
        write_zip(path, [*content.items(), ("tensors/m0.safetensors", b"other")], sums=content)
    expect_error(path, "duplicate member 'tensors/m0.safetensors'")


def test_unlisted_member(saved):
    path = saved[0]
    content = members(path)
    write_zip(path, [*content.items(), ("extra.bin", b"payload")], sums=content)
    expect_error(path, r"member\(s\) \['extra.bin'\] that its sums file does not list")
    write_zip(path, [*content.items(), ("extra.bin", b"payload")])  # listed in the sums, not in the manifest
    expect_error(path, "file table disagrees")


def test_oversized_member(saved, monkeypatch):
    monkeypatch.setattr(archive.LIMITS, "max_member_bytes", 256)
    expect_error(saved[0], "'tensors/m0.safetensors' of [0-9]+ bytes, over the limit of 256 bytes")


def test_missing_sums_file(saved):
    archive.sums_path(saved[0]).unlink()
    expect_error(saved[0], "mlp_sha256_sums.txt is missing beside it")


def test_sums_file_that_disagrees(saved):
    path = saved[0]
    content = members(path)
    write_sums(path, {**content, "tensors/m0.safetensors": b"something else"})
    expect_error(path, "'tensors/m0.safetensors' whose SHA-256 does not match|disagrees with the manifest")
    archive.sums_path(path).write_text("not a sums file\n")
    expect_error(path, "malformed sums file")


def test_future_format_version(saved):
    rewrite(saved[0], lambda m: m.update(format_version=manifest.FORMAT_VERSION + 1))
    expect_error(saved[0], "newer torch_tweak; this version .* reads format 1 and older")


def test_path_that_does_not_exist(tmp_path):
    expect_error(tmp_path / "nothing.tt", "There is no checkpoint at")
    expect_error(tmp_path, "is not a file")


def test_checkpoint_of_a_different_model(saved, tmp_path):
    path = saved[0]
    expect_error(path, "is a .*Pipeline, but the checkpoint stores a torch.nn.modules.container:Sequential",
                 model=Pipeline())
    wide = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    expect_error(path, r"tensor '0.weight' is float32\[32, 8\] here and float32\[16, 8\]", model=wide)
    pipe = Pipeline()
    pipe.encoder = tt.Module(pipe.encoder, name="encoder", strategy=eager())
    tt.tune(pipe, [torch.randn(8) for _ in range(2)])
    tt.save(pipe, tmp_path / "pipe.tt")
    del pipe
    gc.collect()
    expect_error(tmp_path / "pipe.tt", "has no child module 'encoder'", model=mlp())
    other = Pipeline()
    other.encoder = tt.Module(other.encoder, name="enc2")
    expect_error(tmp_path / "pipe.tt", "wrapped as 'enc2', but the checkpoint stores it as 'encoder'", model=other)


def test_unknown_backend_is_not_imported(saved):
    def edit(m):
        backend = m["modules"][0]["graphs"][0]["backend"]
        backend.update({"type": "EvilBackend", "class": "evil_pkg_xyz:EvilBackend"})
        backend["state"]["type"] = "EvilBackend"
    rewrite(saved[0], edit)
    expect_error(saved[0], "backend 'EvilBackend' .* not available. torch_tweak never imports")
    assert "evil_pkg_xyz" not in sys.modules


@pytest.mark.parametrize(("structure", "match"), [
    (["seq", "subprocess:Popen", [["c", "true"]]], "subprocess:Popen' (where a|cannot stand for a) list or tuple subclass"),
    (["ntuple", "not_imported_xyz:Thing", [["T"]]], "not_imported_xyz"),
])
def test_output_types_are_checked_and_never_imported(saved, structure, match):
    def edit(m):
        graph = m["modules"][0]["graphs"][0]
        graph["graph_spec"]["output_structure"] = structure
        graph["backend"]["state"]["graph_spec"] = graph["graph_spec"]
    rewrite(saved[0], edit)
    expect_error(saved[0], match)
    assert "not_imported_xyz" not in sys.modules


def test_backend_state_must_agree_with_the_manifest(saved):
    rewrite(saved[0], lambda m: m["modules"][0]["graphs"][0]["backend"]["state"]["graph_spec"].update(name="9"))
    expect_error(saved[0], "graph spec differs from the manifest's")


def test_full_disk_during_save_keeps_the_previous_checkpoint(saved, monkeypatch):
    path, x, expected = saved
    sums = archive.sums_path(path)
    before = (path.read_bytes(), sums.read_bytes())
    wrapped = tuned_mlp(seed=1)
    calls = []

    def full(stream, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        stream.write(data)

    monkeypatch.setattr(writer, "_write_chunk", full)
    with pytest.raises(CheckpointError, match="disk is full.*|No space left on device"):
        tt.save(wrapped, path)
    monkeypatch.undo()
    assert (path.read_bytes(), sums.read_bytes()) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["cache", "mlp.tt", "mlp_sha256_sums.txt"]
    del wrapped
    gc.collect()
    assert torch.allclose(tt.load(mlp(), path)(x), expected)


def test_failed_sums_rename_puts_the_previous_archive_back(saved, monkeypatch):
    path = saved[0]
    before = (path.read_bytes(), archive.sums_path(path).read_bytes())
    wrapped = tuned_mlp(seed=1)
    real_replace = writer.os.replace

    def replace(src, dst):
        if str(dst).endswith("_sums.txt"):
            raise OSError(errno.EIO, "I/O error")
        real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", replace)
    with pytest.raises(CheckpointError, match="I/O error"):
        tt.save(wrapped, path)
    monkeypatch.undo()
    assert (path.read_bytes(), archive.sums_path(path).read_bytes()) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["cache", "mlp.tt", "mlp_sha256_sums.txt"]
    monkeypatch.setattr(writer.os, "replace", replace)
    with pytest.raises(CheckpointError, match="I/O error"):
        tt.save(wrapped, path.with_name("new.tt"))  # no previous checkpoint: no half pair is left either
    assert sorted(p.name for p in path.parent.iterdir()) == ["cache", "mlp.tt", "mlp_sha256_sums.txt"]


def test_save_refuses_bad_requests_before_writing(tmp_path):
    with pytest.raises(CheckpointError, match="nothing to save"):
        tt.save(mlp(), tmp_path / "x.tt")
    wrapped = tuned_mlp()
    with pytest.raises(CheckpointError, match="end in .tt"):
        tt.save(wrapped, tmp_path / "x.pt")
    odd = tt.Module(mlp(), name="odd", strategy=tt.OneBackendStrategy(OpaqueStateBackend()))
    tt.tune(odd, [torch.randn(8) for _ in range(2)])
    with pytest.raises(CheckpointError, match=r"to_dict\(\)\['extra'\] is a object"):
        tt.save(odd, tmp_path / "odd.tt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_failed_deploy_rolls_back_every_module(tmp_path):
    pipe = Pipeline()
    pipe.encoder = tt.Module(pipe.encoder, name="encoder", strategy=eager())
    pipe.head = tt.Module(pipe.head, name="head", strategy=tt.OneBackendStrategy(FailingDeployBackend()))
    tt.tune(pipe, [torch.randn(8) for _ in range(2)])
    tt.save(pipe, tmp_path / "pipe.tt")
    del pipe
    gc.collect()
    expect_error(tmp_path / "pipe.tt", "Module 'head': deploying its backends failed .*deliberate deploy failure",
                 model=Pipeline())


def test_environment_changes_warn_and_native_code_falls_back(tmp_path, monkeypatch):
    wrapped = tt.Module(mlp(), name="native", strategy=tt.OneBackendStrategy(NativeEagerBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(2)])
    x = torch.randn(2, 8)
    expected = wrapped(x)
    tt.save(wrapped, tmp_path / "n.tt")
    del wrapped
    gc.collect()
    rewrite(tmp_path / "n.tt", lambda m: m["environment"].update(torch="1.0.0"))
    with pytest.raises(CheckpointError, match=r"carries native code .*\['native'\].*trust_native_code=True"):
        tt.load(mlp(seed=3), tmp_path / "n.tt")
    with pytest.warns(CheckpointWarning, match=r"torch 1.0.0 → "):
        loaded = tt.load(mlp(seed=3), tmp_path / "n.tt", trust_native_code=True)
    assert loaded.state is tt.ModuleState.TUNED and torch.allclose(loaded(x), expected)
    del loaded
    gc.collect()
    monkeypatch.setattr(environment, "cpu_info", lambda: environment.CpuInfo("old cpu", frozenset({"sse4_2"}), None))
    with pytest.warns(CheckpointWarning) as caught:
        loaded = tt.load(mlp(seed=3), tmp_path / "n.tt", trust_native_code=True)
    assert any("which this CPU lacks" in str(w.message) for w in caught)
    assert loaded.state is tt.ModuleState.PASSTHROUGH  # the original module, with the checkpoint's weights
    assert torch.allclose(loaded(x), expected)


def test_model_built_on_meta_gets_the_checkpoint_weights(saved):
    path, x, expected = saved
    with torch.device("meta"):
        model = mlp()
    assert torch.allclose(tt.load(model, path)(x), expected)


def test_manifest_json_is_strict():
    with pytest.raises(CheckpointError, match="duplicate key"):
        manifest.parse_json(b'{"a": 1, "a": 2}', "m")
    with pytest.raises(CheckpointError, match="NaN is not allowed"):
        manifest.parse_json(b'{"a": NaN}', "m")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        manifest.parse_json(b"[" * 100000, "m")
    assert json.loads(b"{}") == manifest.parse_json(b"{}", "m")
