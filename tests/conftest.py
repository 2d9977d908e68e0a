"""Shared fixtures: an isolated cache folder per test, settings reset, compiler caches per session."""

from __future__ import annotations

import gc
import os
import tempfile

import pytest

_SESSION_TMP = tempfile.mkdtemp(prefix="torch_tweak_tests_")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_SESSION_TMP, "inductor"))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
# Child processes (fresh-process load tests) inherit a cache folder of the test session, never ~/.cache.
os.environ["TORCH_TWEAK_CACHE_DIR"] = os.path.join(_SESSION_TMP, "cache")
# Tests tune in process (a worker process costs seconds to start); tests/test_executor.py, the examples and the
# pipeline scenarios that name an executor cover the default process executor.
os.environ.setdefault("TORCH_TWEAK_EXECUTOR", "inline")

import torch  # noqa: E402

import torch_tweak.torch as tt  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path):
    tt.config.reset()
    tt.config.cache_dir = tmp_path / "cache"
    yield
    tt.config.reset()
    gc.collect()
