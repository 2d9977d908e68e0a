"""RayExecutor on a local Ray cluster started in this process (loopback only): the same candidates, statuses and
choice as in process, Ray failures as report rows, the result cache on a re-run, and hardware classes."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from toy_models import Pipeline

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError, WorkerError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.report.status import CandidateStatus
from torch_tweak.torch.testing import AbortingBackend, FailingBuildBackend, NativeSleepBackend, WrongOutputBackend

ray = pytest.importorskip("ray")
from torch_tweak.torch.executor import RayExecutor  # noqa: E402
from torch_tweak.torch.executor._ray_cluster import choose_class  # noqa: E402

FAST = ProfilingConfig(warmup_calls=1, min_calls=5, window_size=5, min_time_s=0.0, max_time_s=0.02, max_calls=50,
                       pause_s=0.0)
DATA = [torch.randn(8) for _ in range(6)]
LABEL = "tt_test_class"


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the file: 2 CPUs and a custom resource naming its hardware class."""
    ray.init(num_cpus=2, resources={LABEL: 1}, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


def _tune(backends, executor, suffix, **strategy_args):
    """Tune a two-module pipeline (encoder, head); the reports of both graphs and the expected outputs."""
    pipe = Pipeline()
    expected = pipe(torch.stack(DATA[:3])).detach()
    for part in ("encoder", "head"):
        strategy = tt.HighestThroughputStrategy(backends, profiling=FAST, eager_margin=0.0, screening=False,
                                                **strategy_args)
        setattr(pipe, part, tt.Module(getattr(pipe, part), name=f"{part}_{suffix}", strategy=strategy))
    report = tt.tune(pipe, DATA, batch_sizes=[1, 2], executor=executor)
    graphs = [report.module(f"{part}_{suffix}").graphs[0] for part in ("encoder", "head")]
    return pipe, graphs, expected, report


def _rows(graph):
    return [(row.backend, row.status) for row in graph.candidates]


def test_import_does_not_load_ray():
    code = ("import sys, torch_tweak.torch, torch_tweak.torch.executor; "
            "from torch_tweak.torch.executor import ProcessExecutor; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_arguments_are_validated():
    for bad in ({"num_threads": 0}, {"hardware_class": " "}, {"address": ""}, {"shared_cache_dir": 3},
                {"init_kwargs": [1]}):
        with pytest.raises(ConfigError, match="RayExecutor"):
            RayExecutor(**bad)


def test_same_candidates_statuses_and_choice_as_in_process(cluster):
    backends = [TorchEagerBackend(), WrongOutputBackend(), FailingBuildBackend()]
    executor = RayExecutor()
    pipe, on_ray, expected, report = _tune(backends, executor, "ray", reuse_results=False)
    _, inline, _, _ = _tune(backends, "inline", "inline", reuse_results=False)
    for ray_graph, inline_graph in zip(on_ray, inline):
        assert _rows(ray_graph) == _rows(inline_graph)
        assert ray_graph.chosen == inline_graph.chosen == "TorchEagerBackend()"
        assert ray_graph.executor.startswith("ray (") and "1 node(s)" in ray_graph.executor
        assert all(" on " in row.worker and "class " in row.worker for row in ray_graph.candidates)
    nodes = report.environment["executor"]["nodes"]
    assert len(nodes) == 1 and nodes[0]["candidates"] == 6 and nodes[0]["cpu"] == report.environment["cpu"]["model"]
    torch.testing.assert_close(pipe(torch.stack(DATA[:3])), expected)  # the winners serve here


def test_killed_and_hung_tasks_become_rows_and_a_rerun_hits_the_cache(cluster, caplog):
    backends = [TorchEagerBackend(), AbortingBackend(), NativeSleepBackend(), WrongOutputBackend()]
    executor = RayExecutor(hardware_class=LABEL)
    caplog.set_level(logging.INFO, logger="torch_tweak")
    pipe, graphs, expected, _ = _tune(backends, executor, "first", candidate_time_limit_s=3.0)
    for graph in graphs:
        rows = {row.backend: row for row in graph.candidates}
        assert rows["AbortingBackend()"].status == CandidateStatus.CRASHED
        assert "died" in rows["AbortingBackend()"].error
        assert rows["NativeSleepBackend()"].status == CandidateStatus.TIMEOUT
        assert "was cancelled" in rows["NativeSleepBackend()"].error
        assert rows["WrongOutputBackend()"].status == CandidateStatus.REJECTED
        assert graph.chosen == "TorchEagerBackend()"
    # Progress says which node runs what. One candidate at a time fits this cluster: the first graph's ran before
    # the second graph's (Ray got them one by one, so a killed run has stored what it finished).
    started = [r.getMessage().split(": on Ray node")[0] for r in caplog.records if "on Ray node" in r.getMessage()]
    assert sorted(started[:4]) == sorted(f"module 'encoder_first' graph 0 candidate {row.backend}"
                                         for row in graphs[0].candidates)
    torch.testing.assert_close(pipe(torch.stack(DATA[:3])), expected)
    # Again (without the hanging one, to save time): finished candidates come from the result cache; the crashed
    # one, whose result was lost, runs again.
    _, again, _, _ = _tune(backends[:2] + backends[3:], executor, "again", candidate_time_limit_s=3.0)
    for graph in again:
        reused = {row.backend: row.reused for row in graph.candidates}
        assert reused == {"TorchEagerBackend()": True, "WrongOutputBackend()": True, "AbortingBackend()": False}
        assert graph.chosen == "TorchEagerBackend()"


def test_a_node_of_another_hardware_class_is_refused(cluster):
    executor = RayExecutor()
    executor.hardware()  # connects and learns the node
    node = next(iter(executor._nodes.values()))
    executor._nodes["elsewhere"] = {**node, "node_id": "elsewhere", "cpu": "Other CPU", "class": "0ther0ther"}
    executor._class = "0ther0ther"  # as if the run measured on another class
    _, graphs, _, _ = _tune([TorchEagerBackend()], executor, "refused", reuse_results=False)
    row = graphs[0].candidates[0]
    assert row.status == CandidateStatus.SKIPPED
    assert row.error.startswith("HardwareMismatch:") and "0ther0ther (Other CPU)" in row.error
    assert "hardware_class=" in row.error


def test_a_missing_label_tunes_in_process_and_says_how_to_label(cluster, caplog):
    executor = RayExecutor(hardware_class="no_such_class")
    with pytest.raises(WorkerError, match="ray start .*no_such_class"):
        executor.hardware()
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        _, graphs, _, _ = _tune([TorchEagerBackend()], executor, "nolabel", reuse_results=False)
    assert graphs[0].executor.startswith("inline: No live node")


def test_several_hardware_classes_pin_the_largest(caplog):
    nodes = {"a": {"node_id": "a", "class": "small", "cpu": "Old CPU", "cpus": 4},
             "b": {"node_id": "b", "class": "big", "cpu": "New CPU", "cpus": 8},
             "c": {"node_id": "c", "class": "big", "cpu": "New CPU", "cpus": 8}}
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        assert choose_class(nodes, None) == ("big", ["b", "c"])
    assert "hardware_class=" in caplog.text and "Old CPU" in caplog.text
    assert choose_class({"a": nodes["a"]}, None) == ("small", None)


def test_shared_cache_dir_maps_build_folders(tmp_path):
    executor = RayExecutor(shared_cache_dir="/mnt/shared/tt")
    from torch_tweak.torch.cache import cache_root

    assert executor.worker_path(cache_root() / "m" / "0") == Path("/mnt/shared/tt/m/0")
    assert executor.worker_path(tmp_path / "elsewhere") == tmp_path / "elsewhere"
