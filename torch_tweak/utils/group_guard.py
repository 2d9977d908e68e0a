"""A watcher that kills a background process group once the process that started it is gone.

Why: the background worker (``torch_tweak/torch/executor/background.py``) leads a process group that holds the
compiler's helper processes too (``g++``, ``cc1plus``). The worker dies with the tuning process
(``PR_SET_PDEATHSIG``), its helpers do not; and a group that a measurement had just paused (``SIGSTOP``,
``pause.py``) stays stopped for ever when the process that would continue it is killed first: after a
``kill -9`` of a tuning run, stopped ``g++`` processes were left behind holding 200 MB each.

The watcher is a small interpreter in a session of its own (a Ctrl-C at the terminal does not reach it). It reads
a pipe whose only writer is the process that started it; when the pipe closes (that process closed it, exited or
was killed), it kills every process of the group that started no earlier than the group's leader, then exits.
Nothing else is signalled: a process id the system gave to an unrelated process later is not in the group, or
started before the leader did.

    python -m torch_tweak.utils.group_guard PGID LEADER_START
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from torch_tweak.utils.pause import members

#: Sweeps over the group once the pipe closes, and the seconds between them.
PASSES = 3
PAUSE_S = 0.2


class GroupGuard:
    """The watcher of one process group; :meth:`close` (or the death of this process) sets it off."""

    def __init__(self, group: tuple[int, int]) -> None:
        read, self._write = os.pipe()  # the write end is not inherited by processes started later
        root = str(Path(__file__).resolve().parents[2])  # this package's folder, importable in the watcher
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "torch_tweak.utils.group_guard", str(group[0]), str(group[1])],
                stdin=read, env=env, start_new_session=True, close_fds=True)
        finally:
            os.close(read)

    def close(self) -> None:
        """Kill the group's processes now (through the watcher) and let the watcher end."""
        if self._write >= 0:
            os.close(self._write)
            self._write = -1
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()


def main(argv: list[str]) -> None:
    group = (int(argv[0]), int(argv[1]))
    while os.read(0, 4096):  # until the starting process closes the pipe or dies
        pass
    for _ in range(PASSES):  # again after a moment: a dying worker may have been starting a helper just then
        for pid in members(group):
            try:
                os.kill(pid, signal.SIGKILL)  # a stopped process dies of it too
            except OSError:
                pass
        time.sleep(PAUSE_S)


if __name__ == "__main__":
    main(sys.argv[1:])
