"""Executors: candidates built, checked and measured in a worker process; crashes, runaway memory and native
hangs become report rows and tuning finishes with the other candidates."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.executor import InlineExecutor, ProcessExecutor, resolve_executor
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.report.status import CandidateStatus
from torch_tweak.torch.testing import (
    AbortingBackend,
    NativeSleepBackend,
    OwnCopyBackend,
    RunawayMemoryBackend,
    WrongOutputBackend,
)

FAST = ProfilingConfig(warmup_calls=1, min_calls=5, window_size=5, min_time_s=0.0, max_time_s=0.02, max_calls=50,
                       pause_s=0.0)
DATA = [torch.randn(8) for _ in range(6)]


def _tune(backends, executor, name="mlp", **strategy_args):
    model = mlp()
    strategy = tt.HighestThroughputStrategy(backends, profiling=FAST, eager_margin=0.0, screening=False,
                                            reuse_results=False, **strategy_args)
    wrapped = tt.Module(model, name=name, strategy=strategy)
    expected = model(torch.stack(DATA[:3])).detach()
    report = tt.tune(wrapped, DATA, batch_sizes=[1, 2], executor=executor)
    return wrapped, report.module(name).graphs[0], expected, report


def test_process_executor_evaluates_in_a_worker_and_serves_the_winner_here():
    wrapped, graph, expected, report = _tune([TorchEagerBackend(), WrongOutputBackend(), OwnCopyBackend()], "process")
    statuses = {row.backend: row.status for row in graph.candidates}
    assert statuses["WrongOutputBackend()"] == CandidateStatus.REJECTED
    assert CandidateStatus.CHOSEN in statuses.values()
    assert all(row.worker and row.worker.startswith("pid ") for row in graph.candidates)
    assert all(not row.reused for row in graph.candidates)
    assert graph.executor.startswith("process")
    assert report.environment["executor"]["name"].startswith("process")
    assert report.environment["executor"]["nodes"][0]["cpu"] == report.environment["cpu"]["model"]
    # the winner was built again in this process and serves
    torch.testing.assert_close(wrapped(torch.stack(DATA[:3])), expected)


def test_same_statuses_and_choice_as_inline_when_the_winner_is_clear():
    backends = [TorchEagerBackend(), WrongOutputBackend()]
    _, inline, _, _ = _tune(backends, "inline", name="in_process")
    _, process, _, _ = _tune(backends, "process", name="in_worker")
    assert [(r.backend, r.status) for r in inline.candidates] == [(r.backend, r.status) for r in process.candidates]
    assert inline.chosen == process.chosen == "TorchEagerBackend()"
    assert inline.executor == "inline"



def test_close_stops_the_worker_cleanly():
    executor = ProcessExecutor()
    try:
        _tune([TorchEagerBackend()], executor, name="closing")
        process = executor._worker.process
        assert process.is_alive()
    finally:
        executor.close()
    assert process.exitcode == 0  # left on "stop" (not killed after the join timed out)
    assert executor._worker is None

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory is watched through /proc")
def test_crash_runaway_memory_and_native_hang_become_rows_and_tuning_finishes(caplog):
    executor = ProcessExecutor(memory_limit_gb=2.0)
    caplog.set_level(logging.WARNING, logger="torch_tweak")
    try:
        wrapped, graph, expected, _ = _tune(
            [TorchEagerBackend(), AbortingBackend(), RunawayMemoryBackend(max_gb=6.0), NativeSleepBackend(),
             OwnCopyBackend()], executor, candidate_time_limit_s=10.0)
    finally:
        executor.close()
    rows = {row.backend: row for row in graph.candidates}
    aborted, runaway, asleep = rows["AbortingBackend()"], rows["RunawayMemoryBackend()"], rows["NativeSleepBackend()"]
    assert aborted.status == CandidateStatus.CRASHED and "SIGABRT" in aborted.error
    assert aborted.log_path and "about to abort" in open(aborted.log_path).read()
    assert runaway.status == CandidateStatus.CRASHED and runaway.error.startswith("OutOfMemory:")
    assert "memory_limit_gb" in runaway.error
    assert asleep.status == CandidateStatus.TIMEOUT and "was killed" in asleep.error
    assert rows["OwnCopyBackend()"].status in (CandidateStatus.CHOSEN, CandidateStatus.PASSED)
    assert len({rows[name].worker for name in ("AbortingBackend()", "RunawayMemoryBackend()",
                                               "NativeSleepBackend()", "OwnCopyBackend()")}) == 4  # replaced
    torch.testing.assert_close(wrapped(torch.stack(DATA[:3])), expected)
    assert any("SIGABRT" in r.getMessage() for r in caplog.records)


class _Unpicklable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = mlp()
        self.hook = lambda x: x  # a lambda does not pickle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook(self.inner(x))


def test_a_module_that_does_not_pickle_is_tuned_in_process_and_the_report_says_why(caplog):
    strategy = tt.HighestThroughputStrategy([TorchEagerBackend()], profiling=FAST, reuse_results=False)
    wrapped = tt.Module(_Unpicklable(), name="odd", strategy=strategy)
    with caplog.at_level(logging.WARNING, logger="torch_tweak"):
        report = tt.tune(wrapped, DATA, batch_sizes=[1, 2], executor="process")
    graph = report.module("odd").graphs[0]
    assert graph.executor.startswith("inline: The module cannot be sent to a worker process")
    assert graph.chosen == "TorchEagerBackend()" and graph.candidates[0].worker is None
    assert any("is tuned in this process" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("metric", ["topk", "cosine", "rel_l2"])
def test_a_strategy_with_a_built_in_task_metric_is_sent_to_the_worker(metric):
    fidelity = tt.FidelityConfig(metric=metric, k=2) if metric == "topk" else tt.FidelityConfig(metric=metric)
    strategy = tt.HighestThroughputStrategy([TorchEagerBackend()], profiling=FAST, reuse_results=False,
                                            fidelity=fidelity)
    wrapped = tt.Module(mlp(), name=f"metric_{metric}", strategy=strategy)
    report = tt.tune(wrapped, DATA, batch_sizes=[1, 2], executor="process")
    graph = report.module(f"metric_{metric}").graphs[0]
    assert graph.executor.startswith("process"), graph.executor  # not tuned in process for want of pickling
    assert graph.candidates[0].worker is not None


def test_executor_arguments_are_validated():
    with pytest.raises(ConfigError, match="executor must be one of"):
        tt.tune(tt.Module(mlp()), DATA, executor="threads")
    with pytest.raises(ConfigError, match="tt.config.executor must be one of"):
        tt.config.executor = "ray"
    with pytest.raises(ConfigError, match="memory_limit_gb"):
        ProcessExecutor(memory_limit_gb=0)
    with pytest.raises(ConfigError, match="num_threads"):
        ProcessExecutor(num_threads=0)
    executor, owned = resolve_executor("inline")
    assert isinstance(executor, InlineExecutor) and owned
    mine = ProcessExecutor()
    assert resolve_executor(mine) == (mine, False)


def test_config_default_is_the_process_executor(monkeypatch):
    monkeypatch.delenv("TORCH_TWEAK_EXECUTOR", raising=False)
    from torch_tweak.torch.config import TorchTweakConfig

    assert TorchTweakConfig().executor == "process"


def run_script(tmp_path, name: str, text: str) -> dict[str, str]:
    """Run ``text`` as the script ``name`` (its own main module, as a user's would be); its output lines that start
    with an upper-case word, by that word."""
    script = tmp_path / name
    script.write_text(text)
    env = {**os.environ, "TORCH_TWEAK_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split(" ", 1) for line in done.stdout.splitlines()]
    return {parts[0]: parts[1] for parts in lines if len(parts) == 2 and parts[0].isupper()}


def test_a_script_without_a_main_guard_gets_an_error_that_says_how_to_fix_it(tmp_path):
    found = run_script(
        tmp_path, "unguarded.py",
        "import torch\n"
        "import torch_tweak.torch as tt\n"
        "from torch_tweak.torch.backend import TorchEagerBackend\n"
        "strategy = tt.HighestThroughputStrategy([TorchEagerBackend()])\n"
        "m = tt.Module(torch.nn.Linear(4, 4), name='unguarded', strategy=strategy)\n"
        "report = tt.tune(m, [torch.randn(4) for _ in range(3)], executor='process')\n"
        "print('MODULE', report.modules[0].status, report.modules[0].error)\n"
    )
    line = found["MODULE"]
    assert "passthrough" in line and "WorkerError" in line and "if __name__ == '__main__'" in line


def test_a_worker_pickles_torch_objects_without_a_module_as_the_caller_does(tmp_path):
    # Inductor's cache keys pickle tensor metadata; a memory format has no __module__, so pickle names it after the
    # first module that reaches it. The worker imports the caller's script (which imports torch) as __mp_main__:
    # unless it is passed over, the worker's keys differ and nothing it compiles is found by the caller's rebuild.
    found = run_script(
        tmp_path, "formats.py",
        "import pickle\n"
        "import torch\n"
        "from torch_tweak.torch.executor import ProcessExecutor\n"
        "def pickled(context):\n"
        "    return pickle.dumps((torch.contiguous_format, torch.channels_last))\n"
        "if __name__ == '__main__':\n"
        "    executor = ProcessExecutor()\n"
        "    outcome = executor.submit(executor.share(None), pickled, (), time_limit_s=120, label='pickle').result()\n"
        "    executor.close()\n"
        "    print('WORKER', getattr(outcome, 'value', outcome))\n"
        "    print('CALLER', pickled(None))\n"
    )
    assert "__mp_main__" not in found["WORKER"] and found["WORKER"] == found["CALLER"]


def test_classes_from_an_interactive_session_are_tuned_in_process(tmp_path):
    code = (
        "import torch\n"
        "import torch_tweak.torch as tt\n"
        "from torch_tweak.torch.backend import TorchEagerBackend\n"
        "class Mine(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x)\n"
        "m = tt.Module(Mine(), name='mine', strategy=tt.HighestThroughputStrategy([TorchEagerBackend()]))\n"
        "report = tt.tune(m, [torch.randn(4) for _ in range(3)], executor='process')\n"
        "print('GRAPH', report.modules[0].status, report.modules[0].graphs[0].executor)\n"
    )
    env = {**os.environ, "TORCH_TWEAK_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("GRAPH"))
    assert "tuned" in line and "inline: " in line and "interactive session" in line and "['Mine']" in line


class BuildLogged(TorchEagerBackend):
    """Eager; appends ``<pid>`` to the file named by $BUILD_LOG at every build (importable by the worker)."""

    def _build(self, module, graph_spec, data, cache_dir):
        with open(os.environ["BUILD_LOG"], "a") as log:
            log.write(f"{os.getpid()}\n")
        return super()._build(module, graph_spec, data, cache_dir)


class QuickToReload(BuildLogged):
    """:class:`BuildLogged` that claims to load again from files quickly; logs its (de)activations as ``<event> <pid>``
    lines."""

    def reactivates_quickly(self):
        return True

    def _log(self, event):
        with open(os.environ["BUILD_LOG"], "a") as log:
            log.write(f"{event} {os.getpid()}\n")

    def _activate(self):
        self._log("activate")

    def _deactivate(self):
        self._log("deactivate")


class SlowToReload(QuickToReload):
    def reactivates_quickly(self):
        return False


@pytest.mark.parametrize("quick", [True, False])
def test_a_screened_candidate_waits_for_its_sweep_deactivated_when_it_reloads_quickly(tmp_path, monkeypatch, quick):
    log = tmp_path / "events.txt"
    monkeypatch.setenv("BUILD_LOG", str(log))
    candidate = QuickToReload() if quick else SlowToReload()
    strategy = tt.HighestThroughputStrategy([TorchEagerBackend(), candidate], profiling=FAST, eager_margin=10.0,
                                            screening=True, screening_margin=0.99, reuse_results=False)
    wrapped = tt.Module(mlp(), name="set_aside", strategy=strategy)
    report = tt.tune(wrapped, DATA, batch_sizes=[1, 2, 4], executor="process")
    row = next(r for r in report.module("set_aside").graphs[0].candidates if r.backend == candidate.describe())
    assert row.measurements["batch_sizes"] == [1, 2, 4]  # screened at 1 and 4, then swept on the same build
    events = [line.split()[0] for line in log.read_text().splitlines()]
    worker = {line.split()[-1] for line in log.read_text().splitlines()}
    assert len(worker) == 1 and str(os.getpid()) not in worker
    if quick:  # set aside after screening, active again for the sweep, released after it
        assert events == [str(next(iter(worker))), "deactivate", "activate", "deactivate"]
    else:  # held as built (only its scratch freed) until released after its sweep
        assert events == [str(next(iter(worker))), "deactivate"]


@pytest.mark.parametrize("quick", [True, False])
def test_a_candidate_set_aside_warms_up_again_before_its_next_measurement(quick):
    from torch_tweak.torch.tune_strategy import warm_calls
    from torch_tweak.torch.tune_strategy.isolated import set_aside

    backend = QuickToReload() if quick else SlowToReload()
    x = torch.randn(2, 8)
    warm_calls.note(backend, (x,), {}, seconds=10.0)
    assert warm_calls.warm(backend, (x,), {}, at_least_s=1.0)
    set_aside(backend)  # deactivated (quick) or its buffers freed: either way the next call at this shape is cold
    assert not warm_calls.warm(backend, (x,), {}, at_least_s=1.0)


def test_a_screened_candidate_is_swept_without_building_it_again(tmp_path, monkeypatch):
    log = tmp_path / "builds.txt"
    monkeypatch.setenv("BUILD_LOG", str(log))
    strategy = tt.HighestThroughputStrategy([TorchEagerBackend(), BuildLogged()], profiling=FAST, eager_margin=10.0,
                                            screening=True, screening_margin=0.99, reuse_results=False)
    wrapped = tt.Module(mlp(), name="screened", strategy=strategy)
    report = tt.tune(wrapped, DATA, batch_sizes=[1, 2, 4], executor="process")  # screens at 1 and 4, sweeps 1, 2, 4
    row = next(r for r in report.module("screened").graphs[0].candidates if r.backend == "BuildLogged()")
    assert row.status == CandidateStatus.PASSED
    assert row.measurements["batch_sizes"] == [1, 2, 4]
    builds = log.read_text().split()
    assert len(builds) == 1 and builds[0] != str(os.getpid())  # once, in the worker (eager stays: no rebuild here)
