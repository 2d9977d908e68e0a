"""The recording session of one ``tt.tune`` call: which modules ran, and at which batch size."""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_CURRENT: contextvars.ContextVar[RecordingSession | None] = contextvars.ContextVar("torch_tweak_session", default=None)
_IDS = itertools.count(1)


class RecordingSession:
    """Collects the ``tt.Module`` objects called while ``tt.tune`` runs the user's function."""

    def __init__(self) -> None:
        self.id = next(_IDS)
        self.batch_size: int | None = None
        self.modules: dict[int, Any] = {}

    def note(self, module: Any) -> None:
        """Remember ``module`` (in first-call order)."""
        self.modules.setdefault(id(module), module)


def current_session() -> RecordingSession | None:
    """The active session, or None outside ``tt.tune``'s recording phase."""
    return _CURRENT.get()


@contextmanager
def recording(session: RecordingSession) -> Iterator[RecordingSession]:
    """Make ``session`` current for the block."""
    token = _CURRENT.set(session)
    try:
        yield session
    finally:
        _CURRENT.reset(token)
