"""Builds ahead of their turn: slow-to-compile candidates are built in a background worker (its own process
group, lowest priority) that every timed call pauses, and then in their turn as usual."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_background_worker import FAST, LOWEST, OWN
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.executor import ProcessExecutor
from torch_tweak.torch.executor.base import Shared
from torch_tweak.utils import pause

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups are read from /proc")

DATA = [torch.randn(8) for _ in range(6)]


class BuildsLoggedBackend(TorchEagerBackend):
    """Eager that compiles ahead (so a process executor builds it in the background first) and appends, at each
    build, the building process's id, process group and priority to a file; a build takes ``seconds``."""

    def __init__(self, log: str = "", seconds: float = 0.0, name: str = "") -> None:
        super().__init__()
        self.log, self.seconds, self.label = log, seconds, name

    def compiles_ahead(self) -> bool:
        return True

    def describe(self) -> str:
        return f"BuildsLoggedBackend({self.label})"

    def key(self) -> str:
        return f"{super().key()}-{self.label}"

    def _build(self, module, graph_spec, data, cache_dir):
        with open(self.log, "a", encoding="utf-8") as out:
            out.write(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "nice": os.nice(0),
                                  "name": self.label}) + "\n")
        time.sleep(self.seconds)
        return super()._build(module, graph_spec, data, cache_dir)

    def _infer(self, *args, **kwargs):  # logs the calling thread's priority whenever it changes
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        if getattr(self, "call_nice", None) != nice:
            self.call_nice = nice
            with open(self.log, "a", encoding="utf-8") as out:
                out.write(json.dumps({"pid": os.getpid(), "name": self.label, "call_nice": nice}) + "\n")
        return super()._infer(*args, **kwargs)


class WaitsForBuildBackend(TorchEagerBackend):
    """Eager whose build in its turn waits until ``BuildsLoggedBackend(name)`` was built (it does not compile
    ahead), so that the background worker has gone on to its next build by the turn after this one."""

    def __init__(self, log: str = "", name: str = "") -> None:
        super().__init__()
        self.log, self.awaited = log, name

    def describe(self) -> str:
        return "WaitsForBuildBackend()"

    def key(self) -> str:
        return f"{super().key()}-waits"

    def _build(self, module, graph_spec, data, cache_dir):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                os.path.exists(self.log) and f'"name": "{self.awaited}"' in Path(self.log).read_text()):
            time.sleep(0.05)
        time.sleep(0.5)
        return super()._build(module, graph_spec, data, cache_dir)


def _tune(tmp_path, executor, name, reuse_results=False):
    log = tmp_path / f"{name}.jsonl"
    strategy = tt.HighestThroughputStrategy([TorchEagerBackend(), BuildsLoggedBackend(str(log))], profiling=FAST,
                                            eager_margin=0.0, screening=False, reuse_results=reuse_results,
                                            batch_routing=False)  # a route would be timed in turns by the main worker
    wrapped = tt.Module(mlp(), name=name, strategy=strategy)
    report = tt.tune(wrapped, DATA, batch_sizes=[1, 2], executor=executor)
    return [json.loads(line) for line in log.read_text().splitlines()], report.module(name).graphs[0]


def _builds(log: Path) -> list[dict]:
    """The builds a :class:`BuildsLoggedBackend` logged (not its calls)."""
    return [entry for line in log.read_text().splitlines() if "nice" in (entry := json.loads(line))]


def test_a_candidate_built_ahead_is_checked_and_measured_by_the_background_worker_in_its_turn(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="torch_tweak"):
        builds, graph = _tune(tmp_path, "process", "ahead")
    background = builds[0]
    assert background["pgid"] == background["pid"] and background["nice"] == LOWEST
    calls = [b for b in builds if "call_nice" in b]
    assert calls and all(c["call_nice"] == OWN for c in calls)  # checked and measured at the normal priority
    builds = [b for b in builds if "nice" in b]
    assert all(b["pid"] in (background["pid"], os.getpid()) for b in builds)  # no build again in the main worker
    assert any("checked and measured there in its turn" in r.getMessage() for r in caplog.records)
    row = next(r for r in graph.candidates if r.backend.startswith("BuildsLoggedBackend"))
    assert row.status in ("chosen", "passed") and row.worker.startswith(f"pid {background['pid']} ")
    assert row.measurements["batch_sizes"] == [1, 2]
    assert row.fidelity["passed"]
    assert not pause.held()  # the tuning process let go of the finished background group
    with pytest.raises(ProcessLookupError):  # the background worker's group is gone with the graph's tuning
        os.killpg(background["pgid"], 0)
    deadline = time.monotonic() + 5
    while _senders() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _senders()  # and the thread that sent it work


def test_a_screened_candidate_evaluated_in_the_background_is_swept_there(tmp_path):
    log = tmp_path / "swept.jsonl"
    strategy = tt.HighestThroughputStrategy([TorchEagerBackend(), BuildsLoggedBackend(str(log))], profiling=FAST,
                                            eager_margin=0.0, screening=True, screening_margin=0.99,
                                            batch_routing=False)  # a route would be timed in turns by the main worker
    report = tt.tune(tt.Module(mlp(), name="swept", strategy=strategy), DATA, batch_sizes=[1, 2, 4],
                     executor="process")
    row = next(r for r in report.module("swept").graphs[0].candidates if r.backend.startswith("BuildsLoggedBackend"))
    assert row.measurements["batch_sizes"] == [1, 2, 4]  # screened at 1, 4; swept
    calls = [json.loads(line) for line in log.read_text().splitlines() if "call_nice" in line]
    assert calls and all(c["call_nice"] == OWN for c in calls)  # screened and swept at the normal priority
    builds = _builds(log)
    assert builds[0]["nice"] == LOWEST and all(b["pid"] in (builds[0]["pid"], os.getpid()) for b in builds)


class SlowEagerBackend(TorchEagerBackend):
    """Eager whose calls take 2 ms more, so that candidates like it measure alike (within a head-to-head's reach)."""

    def describe(self) -> str:
        return f"{type(self).__name__}()"

    def key(self) -> str:
        return f"{super().key()}-{type(self).__name__}"

    def _infer(self, *args, **kwargs):
        time.sleep(0.002)
        return super()._infer(*args, **kwargs)


class RivalBackend(SlowEagerBackend):
    """A candidate as fast as :class:`SlowBuildsLoggedBackend`, so the two meet in a head-to-head."""


class SlowBuildsLoggedBackend(BuildsLoggedBackend):
    def _infer(self, *args, **kwargs):
        time.sleep(0.002)
        return super()._infer(*args, **kwargs)


def test_a_head_to_head_serves_the_build_the_background_worker_swept_instead_of_compiling_it_again(tmp_path, caplog):
    log = tmp_path / "contest.jsonl"
    strategy = tt.HighestThroughputStrategy([RivalBackend(), SlowBuildsLoggedBackend(str(log))],
                                            baseline=SlowEagerBackend(), profiling=FAST, eager_margin=0.0,
                                            screening=True, screening_margin=0.1, batch_routing=False)
    with caplog.at_level(logging.DEBUG, logger="torch_tweak"):
        report = tt.tune(tt.Module(mlp(), name="contest", strategy=strategy), DATA, batch_sizes=[1, 2, 4],
                         executor="process")
    graph = report.module("contest").graphs[0]
    assert "timed in turns with" in graph.reason, graph.reason  # the two met
    builds = _builds(log)
    background = builds[0]["pid"]
    assert background != os.getpid() and builds[0]["nice"] == LOWEST
    # built once in the background worker (and once more here if it was chosen), never by the main worker
    assert [b["pid"] for b in builds if b["pid"] != os.getpid()] == [background]
    rival = [r.getMessage() for r in caplog.records if "RivalBackend() built again to be served in turns" in
             r.getMessage()]
    assert rival and all(f"[worker pid {background} " in message for message in rival)  # timed there, with it
    assert not pause.held()


def test_a_build_ahead_whose_turn_finds_the_background_busy_is_built_again_by_the_main_worker(tmp_path, caplog):
    log = tmp_path / "busy.jsonl"
    quick, slow = BuildsLoggedBackend(str(log), 0.0, "quick"), BuildsLoggedBackend(str(log), 6.0, "slow")
    waits = WaitsForBuildBackend(str(log), "quick")
    strategy = tt.HighestThroughputStrategy([TorchEagerBackend(), waits, quick, slow], profiling=FAST,
                                            eager_margin=0.0, screening=False)
    with caplog.at_level(logging.INFO, logger="torch_tweak"):
        report = tt.tune(tt.Module(mlp(), name="busy", strategy=strategy), DATA, batch_sizes=[1, 2],
                         executor="process")
    builds = _builds(log)
    first_quick = next(b for b in builds if b["name"] == "quick")
    assert first_quick["nice"] == LOWEST  # built ahead, then the background went on to build "slow"
    rows = {r.backend: r for r in report.module("busy").graphs[0].candidates}
    quick_row, slow_row = rows["BuildsLoggedBackend(quick)"], rows["BuildsLoggedBackend(slow)"]
    assert any("the main worker builds it again in its turn" in r.getMessage() for r in caplog.records)
    assert [b["nice"] for b in builds if b["name"] == "quick"][:2] == [LOWEST, OWN]
    assert not quick_row.worker.startswith(f"pid {first_quick['pid']} ")
    assert slow_row.worker.startswith(f"pid {first_quick['pid']} ")  # its turn waited for it: measured there
    assert [b["nice"] for b in builds if b["name"] == "slow"][:1] == [LOWEST]


class BackgroundSkips(tt.HighestThroughputStrategy):
    """A stand-in rule that the background worker decides for good for :class:`BuildsLoggedBackend` (as TorchAO's
    int8 probe is)."""

    def _skipped_whatever_measured(self, template, task):
        if isinstance(template, BuildsLoggedBackend):
            return True, "the background worker timed it out of the running"
        return super()._skipped_whatever_measured(template, task)


def test_a_final_stand_in_decision_of_the_background_worker_skips_the_candidate_in_its_turn(tmp_path):
    log = tmp_path / "skip.jsonl"
    strategy = BackgroundSkips([TorchEagerBackend(), BuildsLoggedBackend(str(log))], profiling=FAST,
                               eager_margin=0.0, screening=False)
    report = tt.tune(tt.Module(mlp(), name="skip", strategy=strategy), DATA, batch_sizes=[1, 2], executor="process")
    row = next(r for r in report.module("skip").graphs[0].candidates if r.backend.startswith("BuildsLoggedBackend"))
    assert row.status == "skipped" and row.error.startswith("skipped: the background worker timed it out")
    assert not log.exists()  # built neither ahead nor in its turn (the main worker did not probe it again)


def _senders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torch_tweak-background-sender"]


def test_nothing_is_built_ahead_when_the_other_candidates_results_are_reused(tmp_path):
    first, _ = _tune(tmp_path, "process", "reused", reuse_results=True)
    first = [b for b in first if "nice" in b]
    assert first[0]["nice"] == LOWEST
    gc.collect()  # the tuned module's name is free again
    again, graph = _tune(tmp_path, "process", "reused", reuse_results=True)
    again = [b for b in again if "nice" in b]
    assert all(row.reused for row in graph.candidates)
    assert all(build["nice"] == OWN for build in again[len(first):])  # no background worker: nothing to overlap


class ConvertingBackend(TorchEagerBackend):
    """Eager that counts as a converting runtime, with a one-thread twin (``threads=1``); its calls take 2 ms, so
    the twin is skipped on what the every-core one measured."""

    rebuilds_from_files = True

    def __init__(self, threads: int = 0) -> None:
        super().__init__()
        self.threads = threads

    def describe(self) -> str:
        return f"ConvertingBackend({self.threads})"

    def key(self) -> str:
        return f"{super().key()}-threads{self.threads}"

    def every_core_twin(self):
        return ConvertingBackend() if self.threads == 1 else None

    def _infer(self, *args, **kwargs):
        time.sleep(0.002)
        return super()._infer(*args, **kwargs)


class CompilingBackend(BuildsLoggedBackend):
    """Builds by compiling (nothing to convert again from files), like Inductor."""

    rebuilds_from_files = False


def test_a_rerun_starts_no_background_worker_for_a_twin_its_stored_results_skip(tmp_path):
    def tune(*extra):
        strategy = tt.HighestThroughputStrategy([ConvertingBackend(), ConvertingBackend(1), *extra], profiling=FAST,
                                                eager_margin=0.0, screening=False, batch_routing=False)
        report = tt.tune(tt.Module(mlp(), strategy=strategy), DATA, batch_sizes=[1, 2], executor="process")
        return {row.backend: row for row in report.modules[0].graphs[0].candidates}

    first = tune()
    assert first["ConvertingBackend(1)"].status == "skipped" and not first["ConvertingBackend(1)"].reused
    log = tmp_path / "new.jsonl"
    again = tune(CompilingBackend(str(log), name="new"))  # a new candidate that compiles: no conversion to overlap
    assert again["ConvertingBackend(0)"].reused and again["ConvertingBackend(1)"].status == "skipped"
    assert not again["BuildsLoggedBackend(new)"].reused
    nices = [build["nice"] for build in _builds(log)]
    assert nices and all(nice == OWN for nice in nices)  # in its turn (and again to serve), never in the background


def test_build_ahead_false_builds_each_candidate_in_its_turn_only(tmp_path):
    builds, _ = _tune(tmp_path, ProcessExecutor(build_ahead=False), "no_ahead")
    builds = [b for b in builds if "nice" in b]
    assert all(b["pgid"] != b["pid"] for b in builds[:1]) and all(b["nice"] == OWN for b in builds)


def test_build_ahead_is_validated():
    with pytest.raises(ConfigError, match="build_ahead must be True or False"):
        ProcessExecutor(build_ahead="yes")


class _Background:
    """A Background that runs nothing: it records what BuildsAhead asks of it (tickets 1, 2, ... in queue order)."""

    group = None

    def __init__(self, running: int | None = None, done: tuple[int, ...] = ()) -> None:
        self.now, self.done, self.calls = running, set(done), []

    def start(self, shared, fn, args, label, first=False) -> int:
        self.calls.append((fn.__name__, args, first))
        return 100 + len(self.calls)

    def started(self, ticket: int) -> bool:
        return ticket in self.done or ticket == self.now

    def running(self, ticket: int) -> bool:
        return ticket == self.now

    def drop(self, ticket: int) -> None:
        self.calls.append(("drop", ticket))

    def resume(self) -> None:
        self.calls.append(("resume",))


def _ahead(background: _Background, *names: str):
    from torch_tweak.torch.tune_strategy.ahead import BuildsAhead

    templates = [BuildsLoggedBackend(name=name) for name in names]
    task = type("Task", (), {"module_name": "m", "graph_spec": type("Spec", (), {"name": "0"})()})()
    tickets = {t.key(): i for i, t in enumerate(templates, start=1)}
    return BuildsAhead(background, Shared(token=1, context=None), tickets, task, None), templates


@pytest.mark.parametrize(("names", "running", "done", "calls", "still_pending"), [
    (["a", "b"], None, (), [("drop", 1)], False),  # queued: dequeued
    (["a", "b"], 1, (), [], True),  # running with a build queued after it: stopping it would kill that one too
    (["a"], 1, (), [("drop", 1)], False),  # running, the only build left: the worker is stopped
    (["a", "b"], 2, (1,), [("drop", 1), ("forget_built", ([BuildsLoggedBackend(name="a").key()],), True)],
     False),  # built: released in the worker (only it), before its next unit
], ids=["queued", "running-with-more-queued", "running-alone", "built"])
def test_a_build_a_stand_in_rule_skips_is_dropped_before_its_turn_unless_that_loses_another(
        names, running, done, calls, still_pending):
    background = _Background(running, done)
    ahead, (a, *_) = _ahead(background, *names)
    assert ahead.stop(a) == (not still_pending)
    assert background.calls == calls and ahead.pending(a) == still_pending
    assert ("resume",) not in background.calls  # queued units stay held: the next build waits for a turn


def test_a_running_build_is_not_stopped_while_the_worker_keeps_a_candidate_for_its_sweep():
    background = _Background(running=1)
    ahead, (a,) = _ahead(background, "a")
    ahead._kept.add("swept")
    assert not ahead.stop(a)
    assert background.calls == [] and ahead.pending(a)


def test_forget_built_releases_only_the_given_builds():
    from torch_tweak.torch.tune_strategy.isolated import forget_built

    context = type("Context", (), {})()
    context.built = {"a": (TorchEagerBackend(), 1.0), "b": (TorchEagerBackend(), 2.0)}
    forget_built(context, ["a", "missing"])
    assert list(context.built) == ["b"]
    forget_built(context)
    assert context.built == {}
