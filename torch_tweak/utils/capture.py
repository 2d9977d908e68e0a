"""Send everything a backend build prints (Python and C++ alike) to a log file.

Compilers such as OpenVINO's converter and Inductor write to the process's file descriptors 1 and 2
directly, so ``capture_output`` redirects the descriptors as well as ``sys.stdout``/``sys.stderr``
and attaches a handler for the ``torch_tweak`` logger tree. It is meant for the single tuning thread;
it restores everything on exit, also when the build raises.

With ``console=True`` (``TORCH_TWEAK_CONSOLE_OUTPUT``) the descriptors are left alone, so native output reaches
the console only, while Python output and the library's log records go to both the console and the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from torch_tweak.utils.permissions import open_secure

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Tee:
    """A text stream writing to two streams."""

    def __init__(self, first: TextIO, second: TextIO) -> None:
        self.streams = (first, second)

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            with contextlib.suppress(Exception):
                stream.flush()


@contextlib.contextmanager
def capture_output(log_path: str | Path, console: bool = False) -> Iterator[Path]:
    """Redirect stdout, stderr and library logging into ``log_path`` for the duration of the block
    (``console``: also keep them on the console, see the module docstring)."""
    log_path = Path(log_path)
    if console:
        with _teed(log_path):
            yield log_path
        return
    with open_secure(log_path, "a") as log_file:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        saved_fds = []
        for fd in (1, 2):
            try:
                saved_fds.append((fd, os.dup(fd)))
            except OSError:
                continue
        log_file.flush()
        for fd, _ in saved_fds:
            os.dup2(log_file.fileno(), fd)
        handler = logging.StreamHandler(log_file)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        library_logger = logging.getLogger("torch_tweak")
        library_logger.addHandler(handler)
        try:
            with contextlib.redirect_stdout(log_file), contextlib.redirect_stderr(log_file):
                yield log_path
        finally:
            library_logger.removeHandler(handler)
            with contextlib.suppress(Exception):
                log_file.flush()
            for fd, saved in saved_fds:
                os.dup2(saved, fd)
                os.close(saved)


@contextlib.contextmanager
def _teed(log_path: Path) -> Iterator[None]:
    with open_secure(log_path, "a") as log_file:
        handler = logging.StreamHandler(log_file)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        library_logger = logging.getLogger("torch_tweak")
        library_logger.addHandler(handler)
        try:
            with contextlib.redirect_stdout(_Tee(sys.stdout, log_file)), \
                    contextlib.redirect_stderr(_Tee(sys.stderr, log_file)):
                yield
        finally:
            library_logger.removeHandler(handler)
