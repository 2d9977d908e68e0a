"""Status values of a tuning report, in their own module so that the report and its renderers share them
without importing each other."""

from __future__ import annotations

import enum


class CandidateStatus(str, enum.Enum):
    """What happened to a candidate (a ``str``: it compares equal to, and serializes as, its value)."""

    __str__ = str.__str__  # prints and formats as its value, like the plain string it replaces
    __format__ = str.__format__

    PENDING = "pending"
    CHOSEN = "chosen"
    PASSED = "passed"
    BUILD_FAILED = "build_failed"
    INFER_FAILED = "infer_failed"
    REJECTED = "rejected"
    TIMEOUT = "timeout"
    CRASHED = "crashed"  # its worker process died (a signal, out of memory) while building, checking or measuring it
    SCREENED_OUT = "screened_out"  # built and checked, too slow at the screening batch sizes to be swept
    SKIPPED = "skipped"  # not built: the time budget would not cover it


class ModuleStatus(str, enum.Enum):
    """What tuning did with a module (a ``str``, like :class:`CandidateStatus`)."""

    __str__ = str.__str__
    __format__ = str.__format__

    PENDING = "pending"
    TUNED = "tuned"
    PASSTHROUGH = "passthrough"
    DRY_RUN = "dry_run"
