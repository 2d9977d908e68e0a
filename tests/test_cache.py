"""The cache folder never deletes or re-permissions a user's files: adopt, refuse, record, clear."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.cli import main
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.cache import CACHE_MARKER, cache_folder, cache_root, clear_cache, read_marker
from torch_tweak.utils.permissions import secure_mkdir


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def tune_mlp(name: str = "mlp", **kwargs) -> tt.TuningReport:
    wrapped = tt.Module(mlp(), name=name, strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    return tt.tune(wrapped, [torch.randn(8) for _ in range(2)], batch_sizes=[1, 2], **kwargs)


def marker_of(root) -> dict:
    return json.loads((root / CACHE_MARKER).read_text())


def snapshot(root) -> dict:
    """Every path under ``root`` with its mode and content (files) or link target."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                found[path] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                found[path] = ("dir", mode(path))
            else:
                with open(path, "rb") as handle:
                    found[path] = ("file", mode(path), handle.read())
    return found


def cache_cli(capsys, *args) -> str:
    assert main(["cache", *map(str, args)]) == 0
    return capsys.readouterr().out


def test_tune_refuses_a_folder_holding_files_it_did_not_write(tmp_path):
    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    (home / "docs" / "thesis.tex").write_text("precious")
    (home / "todo.txt").write_text("mine")
    os.chmod(home, 0o755)
    before = snapshot(home)
    tt.config.cache_dir = home
    with pytest.raises(ConfigError, match="did not write") as caught:
        tune_mlp()
    message = str(caught.value)
    assert str(home) in message and "TORCH_TWEAK_CACHE_DIR" in message and "new or empty folder" in message
    assert snapshot(home) == before and mode(home) == 0o755
    assert not (home / CACHE_MARKER).exists()
    with pytest.raises(ConfigError, match="did not write"):
        cache_folder("reports")
    with pytest.raises(ConfigError, match="Refusing to delete"):
        clear_cache()
    assert snapshot(home) == before and mode(home) == 0o755


@pytest.mark.parametrize("shared_mode", [0o1777, 0o755])
def test_an_empty_existing_folder_is_adopted_without_chmod_and_keeps_the_users_files(tmp_path, capsys, shared_mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, shared_mode)
    tt.config.cache_dir = shared
    report = tune_mlp()
    assert report.modules[0].status == "tuned"
    assert mode(shared) == shared_mode
    assert marker_of(shared) == {"torch_tweak_cache": 1, "created_root": False,
                                 "entries": ["mlp", "recordings", "reports"]}
    assert mode(shared / CACHE_MARKER) == 0o600 and mode(shared / "mlp") == 0o700 and mode(shared / "reports") == 0o700

    (shared / "notes.txt").write_text("mine")
    (shared / "photos").mkdir()
    (shared / "photos" / "cat.jpg").write_bytes(b"meow")
    listing = cache_cli(capsys, "list", "--cache-dir", shared)
    assert "clearing keeps the folder itself" in listing and "mlp/  1 graphs, 1 candidate builds" in listing
    assert "notes.txt  not torch_tweak's" in listing and "photos/  not torch_tweak's" in listing
    out = cache_cli(capsys, "clear", "--cache-dir", shared)
    assert f"cleared torch_tweak's files from {shared}" in out and "notes.txt" in out and "photos" in out
    assert sorted(p.name for p in shared.iterdir()) == ["notes.txt", "photos"]
    assert (shared / "notes.txt").read_text() == "mine" and (shared / "photos" / "cat.jpg").read_bytes() == b"meow"
    assert mode(shared) == shared_mode
    assert "no valid" in cache_cli(capsys, "list", "--cache-dir", shared)


def test_a_folder_the_cache_creates_is_owner_only_and_clear_removes_it(tmp_path):
    os.chmod(tmp_path, 0o755)
    cache = tmp_path / "a" / "b" / "cache"
    tt.config.cache_dir = cache
    tune_mlp()
    assert mode(tmp_path) == 0o755
    assert mode(tmp_path / "a") == mode(tmp_path / "a" / "b") == mode(cache) == 0o700
    assert mode(cache / "mlp") == mode(cache / "mlp" / "0") == 0o700
    entries = ["mlp", "recordings", "reports"]
    assert marker_of(cache) == {"torch_tweak_cache": 1, "created_root": True, "entries": entries}
    assert read_marker(cache).entries == set(entries)
    tune_mlp("mlp2", clear_cache=True)  # clears what was there, then tunes into a fresh folder
    assert marker_of(cache)["entries"] == ["mlp2", "recordings", "reports"] and not (cache / "mlp").exists()
    clear_cache()
    assert not cache.exists() and (tmp_path / "a" / "b").is_dir()
    clear_cache()  # nothing left to clear is not an error


def test_a_created_folder_with_a_users_file_is_kept_on_clear(tmp_path, capsys):
    cache = tmp_path / "cache"
    tt.config.cache_dir = cache
    tune_mlp()
    (cache / "keep.txt").write_text("mine")
    out = cache_cli(capsys, "clear")
    assert "kept the folder itself (it holds files torch_tweak did not write)" in out
    assert sorted(p.name for p in cache.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("content", [
    b"not json",
    b"[]",
    b"\xff\xfe",
    b"[" * 100_000,
    json.dumps({"torch_tweak_cache": 2, "created_root": True, "entries": ["mlp"]}).encode(),
    json.dumps({"torch_tweak_cache": True, "created_root": True, "entries": ["mlp"]}).encode(),
    json.dumps({"torch_tweak_cache": 1, "created_root": "yes", "entries": ["mlp"]}).encode(),
    json.dumps({"torch_tweak_cache": 1, "created_root": True, "entries": "mlp"}).encode(),
    json.dumps({"torch_tweak_cache": 1, "created_root": True, "entries": ["../victim"]}).encode(),
    json.dumps({"torch_tweak_cache": 1, "created_root": True, "entries": [".."]}).encode(),
])
def test_a_corrupt_marker_means_not_ours(tmp_path, content):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("keep")
    cache = tmp_path / "cache"
    tt.config.cache_dir = cache
    tune_mlp()
    (cache / CACHE_MARKER).write_bytes(content)
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match="Refusing to delete") as caught:
        clear_cache()
    assert CACHE_MARKER in str(caught.value) and "cannot be read" in str(caught.value)
    with pytest.raises(ConfigError, match="cannot read"):
        tune_mlp("other")
    assert snapshot(tmp_path) == before and read_marker(cache) is None


def test_a_marker_that_is_a_link_or_a_folder_is_not_trusted(tmp_path):
    cache = tmp_path / "cache"
    tt.config.cache_dir = cache
    tune_mlp()
    real = tmp_path / "elsewhere"
    real.mkdir()
    os.replace(cache / CACHE_MARKER, real / CACHE_MARKER)
    (cache / CACHE_MARKER).symlink_to(real / CACHE_MARKER)
    with pytest.raises(ConfigError, match="cannot be read"):
        clear_cache()
    (cache / CACHE_MARKER).unlink()
    (cache / CACHE_MARKER).mkdir()
    with pytest.raises(ConfigError, match="cannot be read"):
        clear_cache()
    assert (cache / "mlp").is_dir() and (real / CACHE_MARKER).is_file()


def test_a_symlinked_entry_is_unlinked_and_its_target_survives(tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data.txt").write_text("keep")
    cache = tmp_path / "cache"
    tt.config.cache_dir = cache
    tune_mlp()
    (cache / "reports" / "link").symlink_to(target)  # a link inside a recorded folder
    os.rename(cache / "mlp", tmp_path / "old_mlp")
    (cache / "mlp").symlink_to(target)  # a recorded entry that is now a link
    with pytest.raises(ConfigError, match="symbolic link"):
        cache_folder("mlp", "0")  # never written through
    clear_cache()
    assert not cache.exists()
    assert (target / "data.txt").read_text() == "keep" and (tmp_path / "old_mlp").is_dir()


def test_cache_folder_refuses_unsafe_names_and_entries_it_cannot_trust(tmp_path):
    cache = tmp_path / "cache"
    tt.config.cache_dir = cache
    for parts in [(), ("..",), (".",), ("a/b",), ("",), (CACHE_MARKER,), ("ok", "..")]:
        with pytest.raises(ConfigError):
            cache_folder(*parts)
    assert not cache.exists()  # names are checked before anything is created
    cache_root()
    (cache / "somefile").write_text("x")
    with pytest.raises(ConfigError, match="not a folder"):
        cache_folder("somefile")
    outside = tmp_path / "outside"
    outside.mkdir()
    (cache / "planted").symlink_to(outside)
    with pytest.raises(ConfigError, match="symbolic link"):
        cache_folder("planted", "x")
    assert list(outside.iterdir()) == []
    (cache / "mine").mkdir(mode=0o755)
    os.chmod(cache / "mine", 0o755)
    assert cache_folder("mine", "sub") == cache / "mine" / "sub"
    assert mode(cache / "mine") == 0o755 and mode(cache / "mine" / "sub") == 0o700
    assert read_marker().entries == frozenset()  # used, not recorded: clear leaves it
    clear_cache()
    assert (cache / "mine" / "sub").is_dir() and (cache / "somefile").is_file()


def test_a_cache_dir_that_is_a_file_or_a_symlink(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    tt.config.cache_dir = afile
    with pytest.raises(ConfigError, match="not a folder"):
        cache_root()
    with pytest.raises(ConfigError, match="not a folder"):
        clear_cache()
    real = tmp_path / "real"
    tt.config.cache_dir = real
    cache_folder("reports")
    link = tmp_path / "link"
    link.symlink_to(real)
    tt.config.cache_dir = link
    assert cache_folder("reports") == link / "reports"  # using the cache through a link is fine
    with pytest.raises(ConfigError, match="symbolic link"):
        clear_cache()
    assert (real / "reports").is_dir() and afile.read_text() == "x"


def test_a_marker_from_an_older_version_is_upgraded_and_its_old_files_kept(tmp_path, caplog):
    cache = tmp_path / "cache"
    tt.config.cache_dir = cache
    (cache / "old_module" / "0").mkdir(parents=True)
    (cache / CACHE_MARKER).touch()
    with pytest.raises(ConfigError, match="older torch_tweak"):
        clear_cache()
    tune_mlp()
    assert "older torch_tweak" in caplog.text
    assert marker_of(cache) == {"torch_tweak_cache": 1, "created_root": False,
                                 "entries": ["mlp", "recordings", "reports"]}
    clear_cache()
    assert sorted(p.name for p in cache.iterdir()) == ["old_module"]


def test_secure_mkdir_only_chmods_folders_it_creates(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    os.chmod(existing, 0o755)
    assert secure_mkdir(existing) == existing and mode(existing) == 0o755
    secure_mkdir(existing / "x" / "y")
    assert mode(existing) == 0o755 and mode(existing / "x") == mode(existing / "x" / "y") == 0o700
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        secure_mkdir(tmp_path / "f")
