"""Temporary files and folders that name the process that made them, so a later run can remove them.

A save or load killed mid-way (``kill -9``, a crash, a full disk in another process) leaves its temporary
files behind; nothing in that process can clean them up. Each temporary name therefore carries an owner
tag, ``<pid>x<start time>``: a later save or load removes the leftovers whose process is gone. The start
time (from ``/proc``) tells a dead process from a new one that reused its pid; where it cannot be read,
the tag holds ``0`` and only the pid is checked.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

_TAG = re.compile(r"(\d+)x(\d+)")


def _start_time(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot, or 0 where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
        return int(stat.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


@functools.cache
def _own_tag(pid: int) -> str:
    return f"{pid}x{_start_time(pid)}"


def owner_tag() -> str:
    """The tag of this process, to put in temporary names (``<pid>x<start time>``)."""
    return _own_tag(os.getpid())


def _alive(tag: str) -> bool:
    match = _TAG.fullmatch(tag)
    if match is None:
        return True  # not ours to judge
    pid, started = int(match.group(1)), int(match.group(2))
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return started == 0 or _start_time(pid) in (0, started)


def remove_leftovers(folder: Path, pattern: re.Pattern[str]) -> int:
    """Remove entries of ``folder`` whose name matches ``pattern`` and whose owner (the pattern's ``tag``
    group) is a process that no longer runs; return how many were removed. Never follows symlinks."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or _alive(match.group("tag")):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed += 1
        except OSError as exc:
            logger.debug("Could not remove the leftover %s: %s", entry.path, exc)
    if removed:
        logger.info("Removed %d leftover(s) of interrupted saves or loads in %s", removed, folder)
    return removed
