"""Shared fixtures: an isolated cache folder per test, settings reset, compiler caches per session."""

from __future__ import annotations

import gc
import os
import sys
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


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Each test file starts with Dynamo's compiled code forgotten. Its cache is per code object, shared by every
    module of a class (``nn.Sequential.forward``): after 8 compiles of it in one worker process, Dynamo runs the
    forward of the next one eagerly, and a test of what a compiled candidate computes sees eager's result."""
    if "torch._dynamo" in sys.modules:  # never imported here only for this (it takes seconds)
        torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path):
    tt.config.reset()
    tt.config.cache_dir = tmp_path / "cache"
    yield
    tt.config.reset()
    gc.collect()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files with ``slow`` tests run first, the most slow tests first (the rest keep their order).

    ``scripts/dev.sh test`` runs the files on two workers (``--dist loadfile --no-loadscope-reorder``): the
    pipeline scenarios take about 13 of the suite's 37 CPU-minutes, and started last they left one worker
    idle for minutes at the end. Started first, the other worker runs the rest meanwhile."""
    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    slow: dict[str, int] = {}
    for item in items:
        slow[file_of(item)] = slow.get(file_of(item), 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[file_of(item)])  # stable: each file's tests keep their order
