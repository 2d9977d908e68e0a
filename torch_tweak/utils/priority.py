"""The background worker's priority: the lowest while it builds, its normal one while it measures.

Why: the background worker (``executor/background.py``) builds slow-to-compile candidates at nice 19, so that it
takes only the cores the rest of tuning leaves idle. In a candidate's turn it also checks and measures the build
it made (``tune_strategy/ahead.py``), and a call on two threads at nice 19 waits whenever any other thread wants
either core: on an idle 2-vCPU EPYC, a small CNN's calls took 10-50 % longer at nice 19 than at nice 0 (kernel
threads and the tuning process's polling were enough), so its Inductor candidate was measured up to 1.6x slower
from one run to the next.

Linux keeps a nice value per thread; an unprivileged thread may raise its own (lower its priority) but not lower
it again unless ``RLIMIT_NICE`` or ``CAP_SYS_NICE`` allow it. So :func:`lower` lowers the process's priority
only after checking that it can restore it; where it cannot, the worker builds at its normal priority (every
measurement elsewhere pauses it anyway: ``pause.py``) and :func:`normal` has nothing to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

#: The nice value of a lowered process.
LOWEST = 19

#: The nice value :func:`normal` restores, once :func:`lower` has lowered this process (None: not lowered).
_normal: int | None = None


def _threads() -> list[int]:
    """This process's thread ids (just the calling thread's where there is no ``/proc``)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]


def _set_all(nice: int) -> None:
    """Give every thread of this process the nice value ``nice`` (threads started later inherit their starter's)."""
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def _can_restore(nice: int) -> bool:
    """Whether a thread of this process that raised its nice value above ``nice`` may bring it back (tried on a
    short-lived thread of its own, so no other thread changes)."""
    allowed: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice + 1)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            allowed.append(False)
        else:
            allowed.append(True)

    thread = threading.Thread(target=probe, name="torch-tweak-priority-probe")
    thread.start()
    thread.join()
    return allowed == [True]


def lower() -> bool:
    """Lower this process's priority to nice :data:`LOWEST` if it can be restored for :func:`normal` (True), else
    leave it as it is (False)."""
    global _normal
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current >= LOWEST or not _can_restore(current):
        logger.debug("Keeping nice %d: a lowered priority could not be restored for measurements.", current)
        return False
    _set_all(LOWEST)
    _normal = current
    return True


@contextlib.contextmanager
def normal() -> Iterator[None]:
    """Run the block at the priority this process had before :func:`lower` (nothing to do if it was not lowered)."""
    if _normal is None:
        yield
        return
    _set_all(_normal)
    try:
        yield
    finally:
        _set_all(LOWEST)
