"""Timed calls with the cores to themselves: background compiles are paused while a measurement runs.

Why: tuning compiles the slow-to-build candidates (Inductor, TorchAO: 40-100 s on 2 cores) in a background
process while the other candidates are built and measured (``executor/background.py``). Builds share the cores
well, but a measurement must not: a compile on the other core slows a 2-thread call by far more than the noise
the strategies allow for. So every timed loop (:func:`~torch_tweak.torch.profiling.measure.measure`, the kernel
bound of ``tune_strategy/stand_ins.py``, the mixed-call check) runs inside :func:`paused`, which stops the held
process groups with ``SIGSTOP`` and continues them with ``SIGCONT`` afterwards (a few microseconds each).

A group is held as ``(pgid, start)``: the group leader's process id and its start time (``/proc/<pid>/stat``,
field 22). A signal goes to the group only while a process with that id and that start time exists, so a
finished background process whose id the system gave to another process is never stopped by mistake.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator

#: The process groups this process pauses while it measures, as ``(pgid, leader start time)``.
_held: set[tuple[int, int]] = set()


def _stat(pid: int | str) -> tuple[int, int] | None:
    """``(process group, start time)`` of process ``pid`` (``/proc/<pid>/stat`` fields 5 and 22, the start time in
    clock ticks since boot), or None if there is no such process or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            text = stat.read()
    except OSError:
        return None
    try:  # the command name (field 2) is in parentheses and may hold spaces: count fields after its ")"
        fields = text[text.rindex(")") + 2:].split()
        return int(fields[2]), int(fields[19])
    except (ValueError, IndexError):
        return None


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
    """Send ``signum`` to the process group if its leader is still the process it was (False: not sent)."""
    pgid, start = group
    if start_time(pgid) != start:  # gone (or another process has its id now): leave that group alone
        return False
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # the leader has not made its group yet, or it is gone
        return False
    return True


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Pause the held process groups for the duration of the block (nothing to do when none is held)."""
    if not _held:
        yield
        return
    stopped = [group for group in list(_held) if signal_group(group, signal.SIGSTOP)]
    try:
        yield
    finally:
        for group in stopped:
            signal_group(group, signal.SIGCONT)
