"""Timed calls with the cores to themselves: background compiles are paused while a measurement runs.

Why: tuning compiles the slow-to-build candidates (Inductor, TorchAO: 40-100 s on 2 cores) in a background
process while the other candidates are built and measured (``executor/background.py``). Builds share the cores
well, but a measurement must not: a compile on the other core slows a 2-thread call by far more than the noise
the strategies allow for. So every timed loop (:func:`~torch_tweak.torch.profiling.measure.measure`, the kernel
bound of ``tune_strategy/stand_ins.py``, the mixed-call check) runs inside :func:`paused`, which stops the held
process groups with ``SIGSTOP``, starts timing once none of their processes is on a CPU any more (a scan of
``/proc``: 2 ms on a VM with 100 processes), and continues them with ``SIGCONT`` afterwards.

A group is held as ``(pgid, start)``: the group leader's process id and its start time (``/proc/<pid>/stat``,
field 22). A signal goes to the group only while a process with that id and that start time exists, so a
finished background process whose id the system gave to another process is never stopped by mistake.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator

logger = logging.getLogger(__name__)

#: How long :func:`paused` waits for the paused processes to leave the CPU before it times anyway.
STOP_WAIT_S = 0.5

#: The process groups this process pauses while it measures, as ``(pgid, leader start time)``.
_held: set[tuple[int, int]] = set()


def _fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the third on (state, parent, group, ...), or None if there is no such
    process or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            text = stat.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: count fields after its ")"
    return text[text.rindex(")") + 2:].split() if ")" in text else None


def _stat(pid: int | str) -> tuple[int, int] | None:
    """``(process group, start time)`` of process ``pid`` (``/proc/<pid>/stat`` fields 5 and 22, the start time in
    clock ticks since boot), or None if there is no such process or no ``/proc``."""
    fields = _fields(pid)
    try:
        return (int(fields[2]), int(fields[19])) if fields is not None else None
    except (ValueError, IndexError):
        return None


def _running(pid: int) -> bool:
    """Whether process ``pid`` is on a CPU or waiting for one (state ``R``)."""
    fields = _fields(pid)
    return fields is not None and fields[:1] == ["R"]


def _wait_until_stopped(groups: list[tuple[int, int]]) -> None:
    """Return once no process of ``groups`` is on a CPU any more, or after :data:`STOP_WAIT_S`.

    ``SIGSTOP`` takes effect when the process next returns from the kernel: measured during tuning, a background
    compiler (the Python worker, ``cc1plus``, ``ld``) went on running for up to 0.3 s after it was sent, long
    enough to spoil a 0.1 s measurement of a 2-thread call. Sleeping processes stop as soon as they wake."""
    pids = {pid for group in groups for pid in (group[0], *members(group))}  # the leader, in its group or not
    deadline = time.monotonic() + STOP_WAIT_S
    while pids := {pid for pid in pids if _running(pid)}:
        if time.monotonic() > deadline:
            logger.debug("Paused processes %s were still running %.1f s after SIGSTOP; measuring anyway.",
                         sorted(pids), STOP_WAIT_S)
            return
        time.sleep(0.001)


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None if there is no such process."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


def members(group: tuple[int, int]) -> list[int]:
    """The processes of ``group`` that started no earlier than its leader (its leader too, while it runs)."""
    pgid, start = group
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        stat = _stat(name) if name.isdigit() else None
        if stat is not None and stat[0] == pgid and stat[1] >= start:
            found.append(int(name))
    return found


def hold(groups: Iterable[tuple[int, int]]) -> None:
    """Pause these process groups during this process's measurements from now on (in addition to the held); never
    this process's own group (the background worker measures what it built ahead, with the graph's context)."""
    own = os.getpgrp()
    _held.update(group for group in groups if group[0] != own)


def hold_only(groups: Iterable[tuple[int, int]]) -> None:
    """Pause exactly these process groups from now on (a worker gets the groups of each graph's context)."""
    _held.clear()
    hold(groups)


def release(groups: Iterable[tuple[int, int]]) -> None:
    """Stop pausing these process groups (they are continued first, in case one is paused now)."""
    for group in groups:
        signal_group(group, signal.SIGCONT)
        _held.discard(group)


def held() -> frozenset[tuple[int, int]]:
    """The process groups :func:`paused` pauses."""
    return frozenset(_held)


def signal_group(group: tuple[int, int], signum: int) -> bool:
    """Send ``signum`` to the process group if its leader is still the process it was (False: not sent).

    A leader that has not made its group yet (a background worker still starting: importing torch takes seconds)
    gets the signal alone: it has started nothing yet. Measured before this, a worker's start-up ran through the
    first measurement of a tuning run and made eager's calls 1.7x slower."""
    pgid, start = group
    if start_time(pgid) != start:  # gone (or another process has its id now): leave that group alone
        return False
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # no such group yet
        try:
            os.kill(pgid, signum)
        except (ProcessLookupError, PermissionError):  # gone meanwhile
            return False
    except PermissionError:
        return False
    return True


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Pause the held process groups for the duration of the block (nothing to do when none is held)."""
    if not _held:
        yield
        return
    stopped = [group for group in list(_held) if signal_group(group, signal.SIGSTOP)]
    _wait_until_stopped(stopped)
    try:
        yield
    finally:
        for group in stopped:
            signal_group(group, signal.SIGCONT)
