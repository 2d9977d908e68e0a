"""The background worker's priority (``utils/priority.py``) and the wait for paused processes to leave the CPU
(``utils/pause.py``): builds run at nice 19 only where measurements can return to the normal priority."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_tweak.utils import pause, priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities, /proc")

#: Run in a fresh process (a lowered priority may not come back in this one): lower, start a thread, then report
#: every thread's nice value while lowered, inside normal() and after it.
LOWER_AND_REPORT = """
import json, os, threading
from torch_tweak.utils import priority

def nices():
    return sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})

lowered = priority.lower()
stop = threading.Event()
thread = threading.Thread(target=stop.wait)  # started after lower(): inherits the low priority
thread.start()
report = {"lowered": lowered, "low": nices()}
with priority.normal():
    report["normal"] = nices()
report["after"] = nices()
stop.set()
thread.join()
print(json.dumps(report))
"""


def _run(code: str) -> dict:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_lowered_process_measures_at_its_own_priority_on_every_thread_and_builds_at_the_lowest():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    report = _run(LOWER_AND_REPORT)
    if own >= priority.LOWEST or not priority._can_restore(own):  # unprivileged: never lowered, nothing changes
        assert report == {"lowered": False, "low": [own], "normal": [own], "after": [own]}
        return
    assert report == {"lowered": True, "low": [priority.LOWEST], "normal": [own], "after": [priority.LOWEST]}


def test_a_process_that_could_not_restore_its_priority_keeps_it(monkeypatch):
    monkeypatch.setattr(priority, "_can_restore", lambda nice: False)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert priority.lower() is False
    assert os.getpriority(os.PRIO_PROCESS, 0) == own
    with priority.normal():  # nothing to restore
        assert os.getpriority(os.PRIO_PROCESS, 0) == own


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def test_a_paused_block_starts_only_once_the_held_processes_are_off_the_cpu():
    spinner = _spinner()
    try:
        time.sleep(0.2)
        pause.hold_only([(spinner.pid, pause.start_time(spinner.pid))])
        for _ in range(5):
            with pause.paused():
                assert _state(spinner.pid) == "T"  # at once: no sleep needed for the stop to take effect
    finally:
        pause.hold_only([])
        spinner.kill()
        spinner.wait()


def test_the_wait_for_paused_processes_is_bounded(monkeypatch):
    spinner = _spinner()
    monkeypatch.setattr(pause, "_running", lambda pid: True)  # a process that never seems to stop
    monkeypatch.setattr(pause, "STOP_WAIT_S", 0.2)
    try:
        pause.hold_only([(spinner.pid, pause.start_time(spinner.pid))])
        start = time.monotonic()
        with pause.paused():
            waited = time.monotonic() - start
        assert 0.2 <= waited < 2.0
    finally:
        pause.hold_only([])
        spinner.kill()
        spinner.wait()


def test_a_held_leader_that_has_not_made_its_group_yet_is_paused_alone():
    starting = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # still in this process's group
    try:
        time.sleep(0.2)
        pause.hold_only([(starting.pid, pause.start_time(starting.pid))])
        with pause.paused():
            assert _state(starting.pid) == "T"
            assert _state(os.getpid()) == "R"  # its group (this process's) was left alone
        time.sleep(0.05)
        assert _state(starting.pid) in "RSD"  # not stopped
    finally:
        pause.hold_only([])
        starting.kill()
        starting.wait()
