"""The cache's size limit: least recently used build folders and stored results go first, only torch_tweak's."""

from __future__ import annotations

import os
import time

import pytest
import torch
from checkpoint_helpers import save_mlp
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.cache import cache_folder
from torch_tweak.torch.cache_limit import cache_items, enforce_size_limit


def item(*parts: str, size: int, age_s: float) -> os.PathLike[str]:
    folder = cache_folder(*parts)
    (folder / "blob").write_bytes(b"x" * size)
    stamp = time.time() - age_s
    os.utime(folder, (stamp, stamp))
    return folder


def test_least_recently_used_items_go_first_until_under_the_limit():
    old = item("m", "0", "old", size=600_000, age_s=300)
    middle = item("m", "0", "middle", size=600_000, age_s=200)
    new = item("m", "1", "new", size=600_000, age_s=100)
    foreign = tt.config.cache_dir / "mine"
    foreign.mkdir()
    (foreign / "keep.bin").write_bytes(b"x" * 2_000_000)  # not torch_tweak's: never counted or deleted
    deleted = enforce_size_limit(limit_gb=1.3e6 / 2**30)
    assert deleted == [old] and not old.exists() and middle.exists() and new.exists()
    assert (foreign / "keep.bin").exists()
    assert [p for _, _, p in cache_items(tt.config.cache_dir)] == [middle, new]


def test_openvino_models_compiled_at_load_count_and_the_oldest_go_first():
    blobs = cache_folder("openvino_model_cache")
    for name, age_s in (("old", 300), ("new", 100)):
        (blobs / f"{name}.blob").write_bytes(b"x" * 600_000)
        stamp = time.time() - age_s
        os.utime(blobs / f"{name}.blob", (stamp, stamp))
    (blobs / "notes.txt").write_bytes(b"x" * 2_000_000)  # OpenVINO writes only .blob files there: not an item
    assert enforce_size_limit(limit_gb=1e6 / 2**30) == [blobs / "old.blob"]
    assert [p for _, _, p in cache_items(tt.config.cache_dir)] == [blobs / "new.blob"]


def test_items_used_by_the_running_tuning_stay():
    item("m", "0", "a", size=1_000_000, age_s=0)
    assert enforce_size_limit(limit_gb=1e-6, keep_since=time.time() - 10) == []


def test_tune_keeps_the_cache_under_the_limit():
    stale = item("stale", "0", "build", size=3_000_000, age_s=1000)
    tt.config.cache_size_limit_gb = 1e-3  # about 1 MB
    wrapped = tt.Module(mlp(), strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8)] * 2)
    assert not stale.exists()
    assert any(p.parent.parent.name == wrapped.name for _, _, p in cache_items(tt.config.cache_dir))


def test_load_keeps_the_cache_under_the_limit_and_what_it_extracted(tmp_path):
    path, x, expected = save_mlp(tmp_path / "mlp.tt")
    stale = item("stale", "0", "build", size=3_000_000, age_s=1000)
    tt.config.cache_size_limit_gb = 1e-3  # about 1 MB
    loaded = tt.load(mlp(), path)
    assert not stale.exists()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), expected)


@pytest.mark.parametrize("value", [0, -1, float("inf"), "1", True])
def test_bad_limits_are_refused(value):
    with pytest.raises(ConfigError, match="cache_size_limit_gb must be a positive number"):
        tt.config.cache_size_limit_gb = value
