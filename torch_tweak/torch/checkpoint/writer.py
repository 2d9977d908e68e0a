"""Writing a checkpoint atomically: a zip and its sums file, renamed over the previous pair only when complete.

Members go to a temporary zip in the destination folder; :meth:`ArchiveWriter.commit` writes the sums file
to a temporary name too, fsyncs both and renames them into place. A failure before the renames leaves the
previous checkpoint untouched. The two renames are separate steps: if the second fails, the previous
archive is put back; a crash exactly between them leaves a pair that ``tt.load`` refuses (the sums disagree)
rather than one it would load wrongly.

Temporary names carry the saving process's tag (:mod:`torch_tweak.utils.leftovers`), so the next save to
the same folder removes what a killed save left behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import IO

from torch_tweak.errors import CheckpointError
from torch_tweak.torch.checkpoint.archive import member_name_problem, sums_path
from torch_tweak.utils.leftovers import owner_tag, remove_leftovers

_CHUNK = 1 << 20
_DEFLATED_SUFFIXES = (".json", ".xml", ".txt")
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def _write_chunk(stream: IO[bytes], data: bytes) -> None:
    """Write one chunk of member data (a separate function so tests can simulate a full disk)."""
    stream.write(data)


def temporary_prefix(target: Path) -> str:
    """The prefix of every temporary file or folder a save of ``target`` makes beside it."""
    return f".{target.name}.{owner_tag()}."


def remove_save_leftovers(target: Path) -> None:
    """Remove temporary files and folders of earlier saves of ``target`` whose process was killed."""
    for name in (target.name, sums_path(target).name):
        remove_leftovers(target.parent, re.compile(rf"\.{re.escape(name)}\.(?P<tag>\d+x\d+)\.[^./]+(\.partial|\.previous)?"))


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class ArchiveWriter:
    """Writes members to a temporary zip beside ``target``; :meth:`commit` puts the zip and sums in place."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.sums_target = sums_path(target)
        self.files: dict[str, tuple[int, str]] = {}
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(target), suffix=".partial", dir=target.parent)
        self._tmp = Path(tmp)
        self._sums_tmp: Path | None = None
        self._file = os.fdopen(fd, "w+b")
        self._zip = zipfile.ZipFile(self._file, "w", allowZip64=True)

    def _open(self, name: str, size: int) -> IO[bytes]:
        if member_name_problem(name) is not None or name in self.files:
            raise CheckpointError(f"Cannot store {name!r} in a checkpoint: {member_name_problem(name) or 'duplicate'}.")
        info = zipfile.ZipInfo(name, date_time=_ZIP_EPOCH)
        info.create_system = 3
        info.external_attr = (stat.S_IFREG | 0o600) << 16
        info.compress_type = zipfile.ZIP_DEFLATED if name.endswith(_DEFLATED_SUFFIXES) else zipfile.ZIP_STORED
        return self._zip.open(info, "w", force_zip64=size > (1 << 31))

    def add_bytes(self, name: str, data: bytes) -> None:
        """Store ``data`` as member ``name``."""
        with self._open(name, len(data)) as out:
            _write_chunk(out, data)
        self.files[name] = (len(data), hashlib.sha256(data).hexdigest())

    def add_file(self, name: str, source: Path) -> None:
        """Store the regular file ``source`` as member ``name`` (streamed)."""
        digest, size = hashlib.sha256(), 0
        with open(source, "rb") as src, self._open(name, source.stat().st_size) as out:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                _write_chunk(out, chunk)
        self.files[name] = (size, digest.hexdigest())

    def commit(self) -> None:
        """Finish the zip, write the sums file, fsync both and rename them over the previous checkpoint."""
        self._zip.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        lines = "".join(f"{sha}  {name}\n" for name, (_, sha) in sorted(self.files.items()))
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(self.sums_target), suffix=".partial",
                                   dir=self.target.parent)
        self._sums_tmp = Path(tmp)
        with os.fdopen(fd, "wb") as f:
            _write_chunk(f, lines.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        had_previous = self.target.exists()
        backup = self._backup_previous()
        try:
            os.replace(self._tmp, self.target)
            try:
                os.replace(self._sums_tmp, self.sums_target)
            except OSError:  # put the previous archive back (or remove the new one) so no half pair is left
                if backup is not None:
                    os.replace(backup, self.target)
                    backup = None
                elif not had_previous:
                    self.target.unlink(missing_ok=True)
                raise
        finally:
            if backup is not None:
                backup.unlink(missing_ok=True)
        _fsync_dir(self.target.parent)

    def _backup_previous(self) -> Path | None:
        if not self.target.is_file():
            return None
        backup = self._tmp.with_suffix(".previous")
        try:
            os.link(self.target, backup)
        except OSError:
            return None
        return backup

    def abort(self) -> None:
        """Remove the temporary files; the previous checkpoint is untouched."""
        with contextlib.suppress(Exception):
            self._zip.close()
        with contextlib.suppress(Exception):
            self._file.close()
        for tmp in (self._tmp, self._sums_tmp):
            if tmp is not None:
                tmp.unlink(missing_ok=True)


def no_space_hint(exc: OSError) -> str:
    """A hint for OSErrors during save."""
    return " The disk is full; free some space and save again." if exc.errno == errno.ENOSPC else ""
