"""Live progress of ``tt.tune``: module / graph / candidate / phase with elapsed time, on the terminal.

On by default when stderr is a terminal (``tt.config.progress`` None), off when it is not or when
``tt.config.progress`` is False; True forces it on (without a terminal it prints one plain line per
change instead of redrawing a status line).

The display writes to a duplicate of stderr's file descriptor taken when it starts, because builds run
under :func:`torch_tweak.utils.capture.capture_output`, which points descriptors 1 and 2 at a build log.
While the status line is shown, logging handlers and ``warnings`` that write to the terminal's stderr
first clear the line, so log records are never mixed with it.

Tuning code reports where it is with :func:`update` (a no-op when no display is active); it may be
called from the candidate worker thread as well.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

logger = logging.getLogger(__name__)

PHASES = ("record", "build", "check", "measure")
_FIELDS = ("module", "graph", "candidate", "phase")
_CLEAR = "\r\x1b[2K"
_REFRESH_S = 0.2


class ProgressDisplay:
    """A status line redrawn by a background thread (``live``), or plain lines on each change."""

    def __init__(self, stream: TextIO, live: bool) -> None:
        self.stream = stream
        self.live = live
        self.state = dict.fromkeys(_FIELDS, "")
        self.start = time.perf_counter()
        self.phase_start = self.start
        self.lock = threading.RLock()
        self._shown = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        """Start redrawing (live mode)."""
        if self.live:
            self._thread = threading.Thread(target=self._loop, name="torch_tweak-progress", daemon=True)
            self._thread.start()

    def update(self, **fields: str) -> None:
        """Change some of module / graph / candidate / phase; changing an outer field clears the inner ones."""
        with self.lock:
            for i, name in enumerate(_FIELDS):
                if name in fields:
                    self.state[name] = str(fields[name] or "")
                    if name != "phase":
                        for inner in _FIELDS[i + 1:]:
                            if inner not in fields:
                                self.state[inner] = ""
            self.phase_start = time.perf_counter()
            if self.live:
                self._draw()
            else:
                self._write(self.line() + "\n")

    def line(self) -> str:
        """The status text: ``tuning demo_cnn > graph 0 > OpenVINOBackend() > build 3.1s (total 12.0s)``."""
        now = time.perf_counter()
        s = self.state
        parts = [s["module"] or "", f"graph {s['graph']}" if s["graph"] else "", s["candidate"]]
        where = " > ".join(p for p in parts if p) or "starting"
        phase = f" > {s['phase']} {now - self.phase_start:.1f}s" if s["phase"] else ""
        return f"[torch_tweak] tuning {where}{phase} (total {now - self.start:.1f}s)"

    def clear(self) -> None:
        """Erase the status line (the next redraw shows it again)."""
        with self.lock:
            if self._shown:
                self._write(_CLEAR)
                self._shown = False

    def close(self) -> None:
        """Stop redrawing and erase the line."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        self.clear()

    def _loop(self) -> None:
        while not self._stop.wait(_REFRESH_S):
            with self.lock:
                self._draw()

    def _draw(self) -> None:
        width = _terminal_width(self.stream)
        self._write(_CLEAR + self.line()[: width - 1])
        self._shown = True

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: stop drawing, never fail the tune
            self._stop.set()
            self.live = False


_active: ProgressDisplay | None = None


def update(**fields: Any) -> None:
    """Report the current module / graph / candidate / phase to the active display, if any."""
    display = _active
    if display is not None:
        display.update(**fields)


def _terminal_width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 120


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def wanted(setting: bool | None) -> tuple[bool, bool]:
    """``(enabled, live)`` for a ``tt.config.progress`` value, judged on the current stderr."""
    fd = _stderr_fd()
    tty = fd is not None and os.isatty(fd)
    if setting is False or (setting is None and not tty):
        return False, False
    return True, tty


def _is_terminal_stderr(stream: Any) -> bool:
    try:
        return stream is sys.stderr or stream is sys.__stderr__ or stream.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


@contextlib.contextmanager
def _clearing_before_output(display: ProgressDisplay) -> Iterator[None]:
    """Make stderr logging handlers and ``warnings`` erase the status line before they write."""
    patched: list[logging.Handler] = []
    loggers = [logging.getLogger()] + [lg for lg in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(lg, logging.Logger)]
    handlers = list({id(h): h for lg in loggers for h in lg.handlers}.values())
    for handler in handlers:
        if isinstance(handler, logging.StreamHandler) and _is_terminal_stderr(handler.stream) \
                and "emit" not in vars(handler):
            original = handler.emit

            def emit(record: logging.LogRecord, _original: Any = original) -> None:
                with display.lock:
                    display.clear()
                    _original(record)

            handler.emit = emit  # type: ignore[method-assign]
            patched.append(handler)
    original_showwarning = warnings.showwarning

    def showwarning(*args: Any, **kwargs: Any) -> None:
        with display.lock:
            display.clear()
            original_showwarning(*args, **kwargs)

    warnings.showwarning = showwarning
    try:
        yield
    finally:
        if warnings.showwarning is showwarning:
            warnings.showwarning = original_showwarning
        for handler in patched:
            vars(handler).pop("emit", None)


@contextlib.contextmanager
def progress(setting: bool | None) -> Iterator[ProgressDisplay | None]:
    """Show progress for the duration of the block (nested blocks reuse the outer display)."""
    global _active
    enabled, live = wanted(setting)
    fd = _stderr_fd()
    if not enabled or _active is not None or fd is None:
        yield _active
        return
    try:
        stream = os.fdopen(os.dup(fd), "w", encoding="utf-8", errors="replace")
    except OSError as exc:
        logger.debug("No progress display: cannot duplicate stderr: %s", exc)
        yield None
        return
    display = ProgressDisplay(stream, live)
    _active = display
    try:
        with _clearing_before_output(display):
            display.begin()
            yield display
    finally:
        _active = None
        display.close()
        with contextlib.suppress(OSError):
            stream.close()
