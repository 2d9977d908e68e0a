"""Silencing other libraries' logging for the duration of a call (``disable_external_logging=True``).

Opt-in only: the library otherwise never touches logging configuration. While the block runs, existing
loggers outside ``torch_tweak`` are disabled and a filter on the root logger's handlers drops records from
loggers created meanwhile (a backend importing its runtime, say); everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

_OURS = "torch_tweak"


def _external(name: str) -> bool:
    return name != _OURS and not name.startswith(_OURS + ".")


class _OnlyOurs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _external(record.name)


@contextlib.contextmanager
def external_logging_disabled(enabled: bool = True) -> Iterator[None]:
    """Within the block, only ``torch_tweak`` loggers reach the handlers (a no-op when ``enabled`` is False)."""
    if not enabled:
        yield
        return
    silenced = [logger for name, logger in list(logging.root.manager.loggerDict.items())
                if isinstance(logger, logging.Logger) and _external(name) and not logger.disabled]
    handlers = list(logging.root.handlers)
    only_ours = _OnlyOurs()
    for logger in silenced:
        logger.disabled = True
    for handler in handlers:
        handler.addFilter(only_ours)
    try:
        yield
    finally:
        for logger in silenced:
            logger.disabled = False
        for handler in handlers:
            handler.removeFilter(only_ours)
