"""torch_tweak's cache folder: the one place that creates, adopts, records and clears it.

Why this exists: ``tt.config.cache_dir`` (``TORCH_TWEAK_CACHE_DIR``) may point at any folder, including
a user's own folder or a shared one such as ``/tmp``. torch_tweak must never delete or re-permission
files it did not write, so the cache root holds a marker that records what torch_tweak owns, and
clearing deletes exactly that and nothing else.

The marker, ``<cache>/.torch_tweak_cache``, is a small JSON file (written atomically, mode 0o600)::

    {"torch_tweak_cache": 1, "created_root": true, "entries": ["mlp", "reports"]}

``created_root`` says whether torch_tweak created the root folder (only then may clearing remove the
folder itself); ``entries`` lists the top-level names torch_tweak created in it. A marker that cannot
be read or validated means "not ours": the folder is neither used nor cleared. An empty marker file
is one written by an older torch_tweak (which did not record its files): the folder keeps being used,
the marker is upgraded with no entries, and clearing never removes what was there before.

Rules:

* :func:`cache_root` creates a missing root (and only its missing parents) owner-only (0o700); adopts
  an existing *empty* folder without changing its mode; refuses an existing folder that holds files
  and no marker (:class:`ConfigError`).
* :func:`cache_folder` creates ``<cache>/<parts...>`` (0o700 for the folders it creates, no chmod on
  folders that exist) and records ``parts[0]`` when it creates it.
* :func:`clear_cache` deletes only the recorded entries (a recorded entry that is now a symbolic link
  is unlinked, never followed), then the marker, then the root if torch_tweak created it and it is empty.

Updates of the marker are serialized with an advisory lock on the root folder where the platform has
one; a lost race can only leave an entry unrecorded, which clearing then leaves in place.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_tweak.errors import ConfigError
from torch_tweak.torch.config import config
from torch_tweak.utils.permissions import SECURE_DIR_MODE, SECURE_FILE_MODE, secure_mkdir

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

CACHE_MARKER = ".torch_tweak_cache"
MARKER_VERSION = 1
_MAX_MARKER_BYTES = 1 << 20
_FIX = ("Point TORCH_TWEAK_CACHE_DIR or tt.config.cache_dir at a new or empty folder, for example a subfolder "
        "such as {example}.")


@dataclass(frozen=True)
class CacheMarker:
    """What the marker of a cache folder records: whether torch_tweak created the folder, and its entries."""

    created_root: bool
    entries: frozenset[str]


def cache_root() -> Path:
    """``tt.config.cache_dir``, ready for use (created owner-only, or adopted if empty, with its marker).

    Raises:
        ConfigError: the folder exists with files but no marker (they are not torch_tweak's), has a marker
            that cannot be read, is not a folder, or cannot be created.
    """
    root = Path(config.cache_dir)
    created = _create_root(root)
    with _locked(root):
        state, marker = _read(root)
        if marker is not None:
            return root
        if state == "legacy":
            _write_marker(root, CacheMarker(created_root=False, entries=frozenset()))
            logger.warning(
                "The cache folder %s was marked by an older torch_tweak, which did not record its files: torch_tweak "
                "keeps using it, but `torch-tweak cache clear` will only remove what is written from now on. If it "
                "holds only torch_tweak's cache, delete it to start afresh; if it is one of your own folders, point "
                "TORCH_TWEAK_CACHE_DIR at a new folder and delete %s.", root, root / CACHE_MARKER)
            return root
        if state == "corrupt":
            raise ConfigError(
                f"The cache folder {root} has a {CACHE_MARKER} marker that torch_tweak cannot read (corrupt, not a "
                "regular file, or written by a newer torch_tweak), so it cannot tell which files there are its own and "
                f"will not use the folder. {_FIX.format(example=root / 'torch_tweak')} If everything in {root} is "
                "torch_tweak's cache, you may delete the folder yourself instead."
            )
        if created or _is_empty(root):
            _write_marker(root, CacheMarker(created_root=created, entries=frozenset()))
            if not created:
                logger.info("Using the empty folder %s as torch_tweak's cache (its permissions are left as they are)",
                            root)
            return root
    raise ConfigError(
        f"The cache folder {root} already holds files that torch_tweak did not write (it has no {CACHE_MARKER} "
        "marker), so torch_tweak will not use it: it never mixes its cache with your files, nor changes their "
        f"permissions or deletes them. {_FIX.format(example=root / 'torch_tweak')}"
    )


def cache_folder(*parts: str) -> Path:
    """``<cache>/<parts...>``, created owner-only; the top-level entry ``parts[0]`` is recorded as torch_tweak's.

    Folders this call creates get mode 0o700; folders that exist keep theirs. An existing top-level entry
    that torch_tweak did not create is used only if it is a real folder of the current user (it is not
    recorded, so clearing leaves it); a symbolic link, a file or another user's folder is refused.

    Raises:
        ConfigError: a part is not a plain folder name, the top-level entry cannot be used, or
            :func:`cache_root` refuses the cache folder.
    """
    if not parts:
        raise ConfigError("cache_folder() needs at least one folder name, e.g. cache_folder('reports').")
    for part in parts:
        if not isinstance(part, str) or not _is_entry_name(part):
            raise ConfigError(
                f"Cannot make the cache folder {'/'.join(map(str, parts))!r}: {part!r} is not a plain folder name "
                f"(empty, '.', '..', {CACHE_MARKER!r} or containing a path separator). Use simple names such as a "
                "module name."
            )
    root = cache_root()
    top = root / parts[0]
    try:
        os.mkdir(top, SECURE_DIR_MODE)
    except FileExistsError:
        _check_existing_entry(root, top)
    else:
        os.chmod(top, SECURE_DIR_MODE)
        _record(root, parts[0])
    return secure_mkdir(top.joinpath(*parts[1:])) if len(parts) > 1 else top


def clear_cache() -> None:
    """Delete what torch_tweak wrote in ``tt.config.cache_dir``: its recorded entries, its marker, the root.

    The root folder itself is removed only when torch_tweak created it and nothing else is left in it.
    A missing folder is nothing to clear.

    Raises:
        ConfigError: the folder has no valid marker (it may hold your files), or it is a symbolic link.
        OSError: an entry could not be deleted; the marker then still lists what is left.
    """
    root = Path(config.cache_dir)
    if not os.path.lexists(root):
        logger.info("Cache folder %s does not exist: nothing to clear", root)
        return
    if root.is_symlink():
        raise ConfigError(
            f"Refusing to clear {root}: it is a symbolic link (to {os.readlink(root)}). Point TORCH_TWEAK_CACHE_DIR "
            "or tt.config.cache_dir at the real folder and clear again."
        )
    if not root.is_dir():
        raise ConfigError(f"Refusing to clear {root}: it is not a folder, so it is not torch_tweak's cache.")
    with _locked(root):
        state, marker = _read(root)
        if marker is None:
            raise ConfigError(_refusal(root, state))
        failed: list[tuple[str, OSError]] = []
        for name in sorted(marker.entries):
            try:
                _remove_entry(root / name)
            except OSError as exc:
                failed.append((name, exc))
        if failed:
            _write_marker(root, CacheMarker(marker.created_root, frozenset(name for name, _ in failed)))
            name, exc = failed[0]
            raise OSError(
                exc.errno, f"Could not delete {root / name} while clearing the cache ({exc.strerror or exc}); it is "
                f"still listed in {root / CACHE_MARKER}, so fix its permissions and clear again."
            ) from exc
        os.unlink(root / CACHE_MARKER)
    logger.info("Cleared %d torch_tweak entr%s from %s", len(marker.entries), "y" if len(marker.entries) == 1 else "ies",
                root)
    if marker.created_root:
        try:
            os.rmdir(root)
        except OSError:
            logger.info("Kept the cache folder %s: it holds files torch_tweak did not write", root)


def read_marker(root: str | os.PathLike[str] | None = None) -> CacheMarker | None:
    """The marker of ``root`` (``tt.config.cache_dir`` by default); None when it is missing or invalid."""
    return _read(Path(root if root is not None else config.cache_dir))[1]


def _create_root(root: Path) -> bool:
    """Create ``root`` owner-only if it is missing; True when this call created it."""
    if os.path.lexists(root):
        if not root.is_dir():
            raise ConfigError(
                f"The cache folder {root} exists but is not a folder (a file or a broken symbolic link). "
                f"{_FIX.format(example=root.with_name(root.name + '_torch_tweak'))}"
            )
        return False
    try:
        secure_mkdir(root.parent)
        os.mkdir(root, SECURE_DIR_MODE)
    except FileExistsError:
        return False
    except OSError as exc:
        raise ConfigError(
            f"Cannot create the cache folder {root}: {exc}. Point TORCH_TWEAK_CACHE_DIR or tt.config.cache_dir at a "
            "folder you can write to."
        ) from exc
    os.chmod(root, SECURE_DIR_MODE)
    return True


def _check_existing_entry(root: Path, top: Path) -> None:
    st = os.lstat(top)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise ConfigError(
            f"Cannot use {top} in the cache: it is {what}, and torch_tweak only writes into folders it can trust. "
            f"Move {top} away (`torch-tweak cache clear` removes it if torch_tweak created it)."
        )
    marker = read_marker(root)
    if marker is not None and top.name in marker.entries:
        return
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise ConfigError(
            f"Cannot use {top} in the cache: it belongs to another user, who could read or change what torch_tweak "
            f"builds there. {_FIX.format(example=root / 'torch_tweak')}"
        )
    logger.info("Using %s, which torch_tweak did not create: `torch-tweak cache clear` will leave it", top)


def _record(root: Path, name: str) -> None:
    with _locked(root):
        marker = read_marker(root)
        if marker is None:
            raise ConfigError(
                f"The marker {root / CACHE_MARKER} disappeared or became unreadable while torch_tweak was using the "
                f"cache, so {root / name} cannot be recorded as torch_tweak's. Check what else writes to {root}; "
                f"{_FIX.format(example=root / 'torch_tweak')}"
            )
        if name not in marker.entries:
            _write_marker(root, CacheMarker(marker.created_root, marker.entries | {name}))


def _remove_entry(path: Path) -> None:
    """Delete a recorded entry; a file or symbolic link is unlinked (a link's target is never touched)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # does not follow symbolic links found inside
    else:
        os.unlink(path)


def _refusal(root: Path, state: str) -> str:
    why = {
        "missing": f"it has no {CACHE_MARKER} marker, so it may not be torch_tweak's cache and its files may be yours",
        "legacy": f"its {CACHE_MARKER} marker was written by an older torch_tweak that did not record which files are "
                  "its own (if the folder holds only torch_tweak's cache, delete it yourself)",
        "corrupt": f"its {CACHE_MARKER} marker cannot be read (corrupt, not a regular file, or written by a newer "
                   "torch_tweak), so torch_tweak cannot tell its files from yours",
    }[state]
    return (f"Refusing to delete anything in {root}: {why}. Point TORCH_TWEAK_CACHE_DIR or tt.config.cache_dir at "
            "torch_tweak's own cache folder.")


def _read(root: Path) -> tuple[str, CacheMarker | None]:
    """(state, marker): state is "ok", "missing", "legacy" (an empty marker file) or "corrupt"."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(root / CACHE_MARKER, flags)
    except FileNotFoundError:
        return "missing", None
    except OSError:  # a symbolic link, no permission, ...
        return "corrupt", None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_MARKER_BYTES:
            return "corrupt", None
        chunks: list[bytes] = []
        while chunk := os.read(fd, _MAX_MARKER_BYTES + 1):
            chunks.append(chunk)
            if sum(map(len, chunks)) > _MAX_MARKER_BYTES:
                return "corrupt", None
        data = b"".join(chunks)
    except OSError:
        return "corrupt", None
    finally:
        os.close(fd)
    if not data.strip():
        return "legacy", None
    try:
        marker = _parse(json.loads(data.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError):
        marker = None
    return ("ok", marker) if marker is not None else ("corrupt", None)


def _parse(doc: Any) -> CacheMarker | None:
    if not isinstance(doc, dict):
        return None
    version, created, entries = doc.get("torch_tweak_cache"), doc.get("created_root"), doc.get("entries")
    if type(version) is not int or version != MARKER_VERSION or not isinstance(created, bool):
        return None
    if not isinstance(entries, list) or not all(isinstance(e, str) and _is_entry_name(e) for e in entries):
        return None
    return CacheMarker(created_root=created, entries=frozenset(entries))


def _write_marker(root: Path, marker: CacheMarker) -> None:
    """Replace the marker atomically (a temporary file renamed over it; a link there is replaced, not followed)."""
    payload = json.dumps({"torch_tweak_cache": MARKER_VERSION, "created_root": marker.created_root,
                          "entries": sorted(marker.entries)}, indent=1) + "\n"
    tmp = root / f"{CACHE_MARKER}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, SECURE_FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(payload)
        os.replace(tmp, root / CACHE_MARKER)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _is_entry_name(name: str) -> bool:
    return (name not in ("", ".", "..", CACHE_MARKER) and "/" not in name and "\0" not in name
            and (os.altsep is None or os.altsep not in name) and os.sep not in name)


def _is_empty(root: Path) -> bool:
    with os.scandir(root) as entries:
        return next(entries, None) is None


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Hold an advisory lock on the root folder (POSIX ``flock``); a no-op where locking is unavailable."""
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(root, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


__all__ = ["CACHE_MARKER", "CacheMarker", "cache_folder", "cache_root", "clear_cache", "read_marker"]
