"""Send everything a backend build prints (Python and C++ alike) to a log file.

Compilers such as OpenVINO's converter and Inductor write to the process's file descriptors 1 and 2
directly, so ``capture_output`` redirects the descriptors as well as ``sys.stdout``/``sys.stderr``
and attaches a handler for the ``torch_tweak`` logger tree. It is meant for the single tuning thread;
it restores everything on exit, also when the build raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from torch_tweak.utils.permissions import open_secure

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def capture_output(log_path: str | Path) -> Iterator[Path]:
    """Redirect stdout, stderr and library logging into ``log_path`` for the duration of the block."""
    log_path = Path(log_path)
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
