"""Owner-only files and folders.

Folders are created with mode 0o700 and files restricted to 0o600, so tuned artifacts, logs and
checkpoints in a shared machine are readable only by their owner. Folders that already exist are
never re-permissioned: they belong to whoever created them.
"""

from __future__ import annotations

import os
from pathlib import Path

SECURE_DIR_MODE = 0o700
SECURE_FILE_MODE = 0o600


def secure_mkdir(path: str | Path) -> Path:
    """Create ``path`` (and missing parents) with owner-only permissions and return it.

    Only the folders that this call creates are made owner-only (mode 0o700, set again with chmod so
    that an unusual umask cannot leave them unusable). A folder that already exists keeps its mode:
    it may be a user's or a shared folder (``/tmp``), and re-permissioning it is not ours to do.
    """
    path = Path(path)
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, SECURE_DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(folder, SECURE_DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists but is not a folder, so nothing can be written in it; move it away.")
    return path


def secure_file(path: str | Path) -> None:
    """Restrict an existing file to owner read/write (0o600); a missing file is ignored."""
    try:
        os.chmod(path, SECURE_FILE_MODE)
    except FileNotFoundError:
        pass


def open_secure(path: str | Path, mode: str = "w", encoding: str | None = "utf-8"):  # noqa: ANN201
    """Open ``path`` for writing so that it is created with mode 0o600 (no chmod race)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, SECURE_FILE_MODE)
    os.chmod(path, SECURE_FILE_MODE)
    if "b" in mode:
        return os.fdopen(fd, mode)
    return os.fdopen(fd, mode, encoding=encoding)
