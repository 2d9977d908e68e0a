"""The recording session of one ``tt.tune`` call: which modules ran, and at which batch size."""

from __future__ import annotations

import contextvars
import functools
import itertools
from collections.abc import Callable, Iterator
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
        #: ``stores(module, index, name)``: the on-disk store of a module's new graph, or None (set by ``tt.tune``)
        self.stores: Callable[[Any, int, str], Any] | None = None
        #: the ``tt.Module`` that ``tt.tune`` calls directly (nobody reads its outputs), and the output shapes an
        #: earlier run recorded for it (``module/known_shapes.py``); None, None when calls always run
        self.top: Any = None
        self.known: Any = None

    def stores_for(self, module: Any) -> Callable[[int, str], Any] | None:
        """The store factory of ``module``'s recorder (None when this session keeps no calls on disk)."""
        return None if self.stores is None else functools.partial(self.stores, module)

    def known_for(self, module: Any) -> Any:
        """The known output shapes for ``module``'s recorder (only the directly called module has any)."""
        return self.known if module is self.top else None

    def lazy_for(self, module: Any) -> bool:
        """Whether a call of ``module`` may go unrun when its output shapes are known: it is the directly called
        module and no other ``tt.Module`` ran inside it (their calls would go unrecorded)."""
        return self.known is not None and module is self.top and len(self.modules) == 1

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
