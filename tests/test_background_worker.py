"""The background worker that builds ahead of their turn: a process group of its own at the lowest priority,
units run in order, dropped, crashed, timed out or unsendable, paused by every timed call, and gone with the tuning
process however it dies."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torch_tweak.torch.executor import Done, Failure
from torch_tweak.torch.executor.background import BackgroundBuilds
from torch_tweak.torch.executor.base import CRASHED, TIMED_OUT, Shared
from torch_tweak.torch.profiling import ProfilingConfig, measure
from torch_tweak.utils import pause, priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups are read from /proc")

FAST = ProfilingConfig(warmup_calls=1, min_calls=5, window_size=5, min_time_s=0.0, max_time_s=0.02, max_calls=50,
                       pause_s=0.0)
#: This process's nice value, which its workers inherit, and the background worker's while it builds: 19 where it
#: may return to its own to measure, else its own.
OWN = os.getpriority(os.PRIO_PROCESS, 0)
LOWEST = priority.LOWEST if OWN < priority.LOWEST and priority._can_restore(OWN) else OWN


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def test_a_held_group_is_stopped_while_a_measurement_runs_and_continued_after():
    spinner = _spinner()
    group = (spinner.pid, pause.start_time(spinner.pid))
    states: list[str] = []
    try:
        pause.hold([group])
        def call() -> None:
            time.sleep(0.01)  # a stop takes effect on the process's next scheduling point, not at once
            states.append(_state(spinner.pid))

        measure(call, 1, FAST)
        assert set(states) == {"T"}  # stopped during every timed call
        time.sleep(0.05)
        assert _state(spinner.pid) in "RSD"  # not stopped
    finally:
        pause.release([group])
        spinner.kill()
        spinner.wait()
    assert not pause.held()


def test_a_group_whose_leader_is_another_process_now_is_left_alone():
    spinner = _spinner()
    try:
        stale = (spinner.pid, pause.start_time(spinner.pid) - 1)  # same id, another start: not the process held
        pause.hold_only([stale])
        with pause.paused():
            assert _state(spinner.pid) in "RSD"  # not stopped
    finally:
        pause.hold_only([])
        spinner.kill()
        spinner.wait()


def _value(context, value):
    return value


def _sleep(context, seconds):
    time.sleep(seconds)
    return seconds


def _abort(context):
    os.abort()


def _group_and_nice(context):
    return os.getpgid(0), os.getpid(), os.nice(0)


@pytest.fixture
def background():
    builds = BackgroundBuilds(1, float("inf"))
    yield builds
    builds.close()


def test_background_units_run_in_order_in_a_low_priority_group_of_their_own(background):
    shared = Shared(1, {"weights": torch.zeros(4)})
    first = background.start(shared, _group_and_nice, (), "first")
    second = background.start(shared, _value, (7,), "second")
    assert not background.started(second)  # sent when the first is done
    outcome = background.wait(first, 120)
    assert isinstance(outcome, Done)
    pgid, pid, nice = outcome.value
    assert pgid == pid == background.group[0] and nice == LOWEST
    assert background.wait(second, 60).value == 7


def test_a_dropped_queued_unit_never_runs_and_a_dropped_running_one_stops_the_worker(background):
    shared = Shared(2, {})
    running = background.start(shared, _sleep, (60,), "sleeps")
    queued = background.start(shared, _value, (1,), "queued")
    last = background.start(shared, _value, (2,), "last")
    background.drop(queued)
    assert isinstance(background.wait(queued, 5), Failure)
    pid = background.group[0]
    deadline = time.monotonic() + 60
    while _state(pid) != "S" and time.monotonic() < deadline:  # imported, and sleeping in the unit
        time.sleep(0.05)
    background.drop(running)
    assert not os.path.exists(f"/proc/{pid}") or _state(pid) in "ZX"
    outcome = background.wait(last, 5)  # queued after a stopped worker: never started in another group
    assert isinstance(outcome, Failure) and "not started" in outcome.message


def test_a_background_crash_fails_its_unit_and_the_units_queued_after_it(background):
    shared = Shared(3, {})
    crash = background.start(shared, _abort, (), "aborts")
    after = background.start(shared, _value, (5,), "after")
    outcome = background.wait(crash, 120)
    assert isinstance(outcome, Failure) and outcome.kind == CRASHED and "SIGABRT" in outcome.message
    assert isinstance(background.wait(after, 5), Failure)


class _FailsToPickle:
    def __reduce__(self):
        raise RuntimeError("dictionary changed size during iteration")


def test_a_context_that_fails_to_send_fails_its_unit_at_once_instead_of_leaving_the_worker_waiting(background, caplog):
    caplog.set_level(logging.WARNING, logger="torch_tweak.torch.executor.background")
    shared = Shared(4, {"weights": torch.zeros(1 << 16), "then": _FailsToPickle()})  # some bytes go out first
    ticket = background.start(shared, _value, (1,), "unsendable")
    outcome = background.wait(ticket, 300)
    assert isinstance(outcome, Failure) and outcome.kind == CRASHED
    assert "sending it the module failed (RuntimeError: dictionary changed size" in outcome.message
    assert "its candidates are built in their turn" in caplog.text


def test_a_unit_past_its_time_limit_is_stopped(background):
    ticket = background.start(Shared(4, {}), _sleep, (60,), "sleeps")
    outcome = background.wait(ticket, 3)
    assert isinstance(outcome, Failure) and outcome.kind == TIMED_OUT


def _spawn_helper(context):
    """Start a helper in the worker's process group, as a compiler does (``g++``), and return its id."""
    return subprocess.Popen(["sleep", "600"]).pid


_TUNING_PROCESS = """
import sys, time
sys.path.insert(0, {tests!r})
from torch_tweak.torch.executor.background import BackgroundBuilds
from torch_tweak.torch.executor.base import Shared
from test_background_worker import _spawn_helper

if __name__ == "__main__":
    builds = BackgroundBuilds(1, float("inf"))
    helper = builds.wait(builds.start(Shared(9, {{}}), _spawn_helper, (), "helper"), 120).value
    print(helper, *builds.group, flush=True)
    time.sleep(600)
"""


def test_a_background_group_dies_with_the_tuning_process_killed_by_sigkill(tmp_path):
    script = tmp_path / "tuning.py"
    script.write_text(_TUNING_PROCESS.format(tests=str(Path(__file__).parent)))
    tuning = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    helper = None
    try:
        helper, pgid, start = (int(v) for v in tuning.stdout.readline().split())
        assert os.getpgid(helper) == pgid and _state(helper) in "RSD"  # running, sleeping or in disk I/O: not stopped
        tuning.kill()  # kill -9: nothing in it runs again, so nothing there continues or kills the group
        tuning.wait()
        deadline = time.monotonic() + 30
        while pause.start_time(pgid) == start and time.monotonic() < deadline:  # the worker dies with it
            time.sleep(0.05)
        try:  # a measurement's pause that came too late (the main worker dies with the tuning process too): the
            os.killpg(pgid, signal.SIGSTOP)  # system continues an orphaned group stopped before, never after
        except ProcessLookupError:
            pass  # the group is gone already
        while os.path.exists(f"/proc/{helper}") and _state(helper) not in "ZX" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{helper}") or _state(helper) in "ZX"  # killed, not left stopped
    finally:
        tuning.kill()
        if helper is not None and os.path.exists(f"/proc/{helper}") and _state(helper) not in "ZX":
            os.kill(helper, signal.SIGKILL)
