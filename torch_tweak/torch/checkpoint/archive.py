"""The checkpoint on disk: a zip archive and a SHA-256 sums file beside it.

Reading trusts nothing until it has been checked. :func:`open_verified` checks the zip's structure (names
that are relative, plain and unique; regular files only; no encryption; stored or deflated; sizes within
:data:`LIMITS`), that the sums file lists exactly the archive's members, and that the manifest's own file
table agrees with both. It then reads every member and compares its size and SHA-256 with the manifest
and the sums file. Only a verified archive can be extracted, and only the members the caller names (those
a backend refers to), into a fresh private folder, after checking that the disk has room; extraction hashes
every member again so that a file changed in between is caught as well.

The sums file proves integrity, not origin: whoever sent a checkpoint can rewrite it. The checks here keep
a crafted archive from escaping its folder, exhausting the disk or hiding members; what the manifest may
say is checked by the loader (:mod:`.codec`), and who wrote it by a signature (:mod:`.signing`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_tweak.errors import CheckpointError
from torch_tweak.torch.checkpoint.foreign import refuse_reference_checkpoint
from torch_tweak.torch.checkpoint.manifest import MANIFEST_NAME, check_header, parse_json
from torch_tweak.torch.checkpoint.signing import SIGNATURE_NAME

logger = logging.getLogger(__name__)

SUMS_SUFFIX = "_sha256_sums.txt"
_CHUNK = 1 << 20
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")
_SUMS_LINE = re.compile(r"([0-9a-f]{64})  (\S+)")


@dataclass
class Limits:
    """Bounds applied when reading a checkpoint (a larger member or archive is refused before it is read)."""

    max_member_bytes: int = 64 << 30
    max_total_bytes: int = 256 << 30
    max_members: int = 100_000
    max_manifest_bytes: int = 64 << 20
    max_sums_bytes: int = 16 << 20
    max_signature_bytes: int = 64 << 10
    #: Largest compression ratio of a member over ``ratio_min_bytes`` (tt.save stores binaries uncompressed
    #: and deflates JSON/XML text, which stays far below this; a "zip bomb" is far above).
    max_compression_ratio: int = 200
    ratio_min_bytes: int = 1 << 20


LIMITS = Limits()


def sums_path(path: Path) -> Path:
    """``x.tt`` → ``x_sha256_sums.txt`` in the same folder."""
    stem = path.name[:-3] if path.name.endswith(".tt") else path.name
    return path.with_name(stem + SUMS_SUFFIX)


def member_name_problem(name: Any) -> str | None:
    """Why ``name`` is not acceptable as a member name, or None if it is."""
    if not isinstance(name, str) or not name:
        return "it is empty"
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        return "it is an absolute path"
    if "\\" in name:
        return "it contains a backslash"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "it has an empty, '.' or '..' component (the path could escape the checkpoint folder)"
    if len(parts) > 16 or len(name) > 1024:
        return "it is too long or too deep"
    bad = next((p for p in parts if not _COMPONENT.fullmatch(p)), None)
    if bad is not None:
        return f"the component {bad!r} has characters other than letters, digits and ._+-"
    return None


def _fail(path: Path, problem: str, hint: str = "") -> CheckpointError:
    return CheckpointError(f"Checkpoint {path} {problem}." + (f" {hint}" if hint else ""))


_TAMPERED = "The file is corrupt or was modified after saving; copy it again or save the model again."


@contextlib.contextmanager
def _zip_errors(path: Path, what: str) -> Iterator[None]:
    """Turn any failure of the zip reader on untrusted bytes into a CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # zipfile raises many types (BadZipFile, zlib.error, EOFError, ...) on bad input
        raise _fail(path, f"cannot be read ({what}: {type(exc).__name__}: {exc})", _TAMPERED) from exc


def read_sums(path: Path) -> dict[str, str]:
    """Parse ``<stem>_sha256_sums.txt`` beside ``path``: member name → SHA-256."""
    sums = sums_path(path)
    if not sums.is_file():
        raise _fail(path, f"has no sums file: {sums.name} is missing beside it",
                    "The sums file is written by tt.save next to the .tt file; copy both together.")
    if sums.stat().st_size > LIMITS.max_sums_bytes:
        raise _fail(path, f"has a sums file {sums.name} larger than {LIMITS.max_sums_bytes} bytes")
    entries: dict[str, str] = {}
    try:
        text = sums.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(path, f"has an unreadable sums file {sums.name} ({exc})") from exc
    for number, line in enumerate(text.splitlines(), 1):
        match = _SUMS_LINE.fullmatch(line)
        if match is None or match.group(2) in entries:
            raise _fail(path, f"has a malformed sums file: line {number} of {sums.name} is {line[:120]!r}", _TAMPERED)
        entries[match.group(2)] = match.group(1)
    if not entries:
        raise _fail(path, f"has an empty sums file {sums.name}", _TAMPERED)
    return entries


def _check_structure(path: Path, infos: list[zipfile.ZipInfo]) -> dict[str, zipfile.ZipInfo]:
    if len(infos) > LIMITS.max_members:
        raise _fail(path, f"has {len(infos)} members, more than the limit of {LIMITS.max_members}")
    members: dict[str, zipfile.ZipInfo] = {}
    folded: set[str] = set()
    total = 0
    for info in infos:
        name = info.filename
        problem = member_name_problem(name)
        if problem is not None:
            raise _fail(path, f"has a member named {name[:200]!r}, which is refused because {problem}", _TAMPERED)
        if name in members or name.lower() in folded:
            raise _fail(path, f"has a duplicate member {name!r}", _TAMPERED)
        kind = stat.S_IFMT(info.external_attr >> 16)
        if kind == stat.S_IFLNK:
            raise _fail(path, f"has a symbolic link entry {name!r}; checkpoints hold regular files only", _TAMPERED)
        if kind not in (0, stat.S_IFREG):
            raise _fail(path, f"has a member {name!r} that is not a regular file (mode {oct(kind)})", _TAMPERED)
        if info.flag_bits & 0x1:
            raise _fail(path, f"has an encrypted member {name!r}", _TAMPERED)
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise _fail(path, f"has a member {name!r} with unsupported compression {info.compress_type}", _TAMPERED)
        if info.file_size > LIMITS.max_member_bytes:
            raise _fail(path, f"has a member {name!r} of {info.file_size} bytes, over the limit of "
                        f"{LIMITS.max_member_bytes} bytes", "Raise torch_tweak.torch.checkpoint.archive.LIMITS "
                        "if you trust this file.")
        if info.file_size > LIMITS.ratio_min_bytes and info.file_size > info.compress_size * LIMITS.max_compression_ratio:
            raise _fail(path, f"has a member {name!r} that expands {info.file_size} bytes from {info.compress_size} "
                        f"(ratio over {LIMITS.max_compression_ratio}); tt.save never compresses that much, so it is "
                        "refused as a decompression bomb", _TAMPERED)
        total += info.file_size
        members[name] = info
        folded.add(name.lower())
    if total > LIMITS.max_total_bytes:
        raise _fail(path, f"holds {total} bytes, over the limit of {LIMITS.max_total_bytes} bytes")
    prefixes = {"/".join(n.lower().split("/")[:i]) for n in members for i in range(1, n.count("/") + 1)}
    clash = sorted(prefixes & folded)
    if clash:
        raise _fail(path, f"has a member {clash[0]!r} that is also used as a folder", _TAMPERED)
    return members


class VerifiedArchive:
    """An opened checkpoint whose members all matched the manifest and the sums file (see :func:`open_verified`)."""

    def __init__(self, path: Path, zf: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo],
                 manifest: dict[str, Any], sums: dict[str, str]) -> None:
        self.path = path
        self.manifest = manifest
        #: The manifest exactly as stored (what a signature covers) and ``signature.json`` (None if unsigned).
        self.manifest_bytes = b""
        self.signature: bytes | None = None
        self._zip = zf
        self._members = members
        self._sums = sums

    @property
    def names(self) -> list[str]:
        """Every member name, sorted (the manifest included)."""
        return sorted(self._members)

    def _stream(self, name: str, sink: Callable[[bytes], None]) -> str:
        """Feed member ``name`` to ``sink`` chunk by chunk; return its SHA-256 after checking its size."""
        info, digest, size = self._members[name], hashlib.sha256(), 0
        with _zip_errors(self.path, f"member {name!r}"), self._zip.open(info) as src:
            while chunk := src.read(_CHUNK):
                size += len(chunk)
                if size > info.file_size:
                    raise _fail(self.path, f"has a member {name!r} longer than its declared size", _TAMPERED)
                digest.update(chunk)
                sink(chunk)
        if size != info.file_size:
            raise _fail(self.path, f"has a truncated member {name!r} ({size} of {info.file_size} bytes)", _TAMPERED)
        return digest.hexdigest()

    def _check_digest(self, name: str, sha: str) -> None:
        if sha != self._sums[name] or sha != self.manifest["files"].get(name, {}).get("sha256", sha):
            raise _fail(self.path, f"has a member {name!r} whose SHA-256 does not match the manifest and the "
                        "sums file", _TAMPERED)

    def verify_members(self) -> None:
        """Hash every member (without writing anything) and compare with the manifest and the sums file."""
        for name in self.names:
            if name not in (MANIFEST_NAME, SIGNATURE_NAME):
                self._check_digest(name, self._stream(name, lambda chunk: None))

    def extract(self, dest: Path, names: set[str]) -> None:
        """Write members ``names`` under the new private folder ``dest`` (0o700 folders, 0o600 files), hashing
        them again; nothing else of the archive reaches the disk."""
        unknown = sorted(names - set(self._members) | names & {MANIFEST_NAME, SIGNATURE_NAME})
        if unknown:
            raise _fail(self.path, f"has no extractable member(s) {unknown[:5]}", _TAMPERED)
        needed = sum(self._members[n].file_size for n in names)
        try:
            free = shutil.disk_usage(dest).free
        except OSError:
            free = needed
        if needed > free:
            raise _fail(self.path, f"needs {needed} bytes to extract, but {dest} has {free} bytes free",
                        "Free some space, or point tt.config.cache_dir (TORCH_TWEAK_CACHE_DIR) at a larger disk.")
        for name in sorted(names):
            target = dest.joinpath(*name.split("/"))
            try:
                for parent in reversed(target.relative_to(dest).parents[:-1]):
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(dest / parent, 0o700)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                with os.fdopen(os.open(target, flags, 0o600), "wb") as out:
                    sha = self._stream(name, out.write)
            except OSError as exc:
                hint = "The disk is full; free some space." if exc.errno == errno.ENOSPC else (
                    "Check that the folder is writable, or point tt.config.cache_dir at one that is.")
                raise _fail(self.path, f"could not be extracted to {target} ({exc.strerror or exc})", hint) from exc
            self._check_digest(name, sha)

    def close(self) -> None:
        """Close the archive file."""
        with contextlib.suppress(Exception):
            self._zip.close()


@contextlib.contextmanager
def open_verified(path: str | os.PathLike[str]) -> Iterator[VerifiedArchive]:
    """Open and fully verify the checkpoint at ``path`` (see the module docstring); raise CheckpointError."""
    path = Path(path)
    refuse_reference_checkpoint(path)
    if not path.exists():
        raise CheckpointError(f"There is no checkpoint at {path}; check the path (tt.save writes a .tt file).")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file; tt.load expects the .tt file written by tt.save.")
    sums = read_sums(path)
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed by the ZipFile below or on failure
    except OSError as exc:
        raise _fail(path, f"cannot be opened ({exc.strerror or exc})") from exc
    try:
        with _zip_errors(path, "zip directory"):
            zf = zipfile.ZipFile(handle)
            infos = zf.infolist()
    except CheckpointError:
        handle.close()
        raise
    archive: VerifiedArchive | None = None
    try:
        members = _check_structure(path, infos)
        missing = sorted(set(sums) - set(members))
        unlisted = sorted(set(members) - set(sums))
        if missing:
            raise _fail(path, f"lacks member(s) {missing[:5]} listed in its sums file", _TAMPERED)
        if unlisted:
            raise _fail(path, f"has member(s) {unlisted[:5]} that its sums file does not list", _TAMPERED)
        if MANIFEST_NAME not in members:
            raise _fail(path, f"has no {MANIFEST_NAME}; it was not written by tt.save")
        if members[MANIFEST_NAME].file_size > LIMITS.max_manifest_bytes:
            raise _fail(path, f"has a {MANIFEST_NAME} over {LIMITS.max_manifest_bytes} bytes")
        chunks: list[bytes] = []
        archive = VerifiedArchive(path, zf, members, {"files": {}}, sums)
        archive._check_digest(MANIFEST_NAME, archive._stream(MANIFEST_NAME, chunks.append))
        archive.manifest_bytes = b"".join(chunks)
        manifest = parse_json(archive.manifest_bytes, f"{path} ({MANIFEST_NAME})")
        check_header(manifest, path)
        _check_file_table(path, manifest.get("files"), members, sums)
        if SIGNATURE_NAME in members:
            if members[SIGNATURE_NAME].file_size > LIMITS.max_signature_bytes:
                raise _fail(path, f"has a {SIGNATURE_NAME} over {LIMITS.max_signature_bytes} bytes", _TAMPERED)
            signature: list[bytes] = []
            archive._check_digest(SIGNATURE_NAME, archive._stream(SIGNATURE_NAME, signature.append))
            archive.signature = b"".join(signature)
        archive.manifest = manifest
        archive.verify_members()
        yield archive
    finally:
        if archive is not None:
            archive.close()
        with contextlib.suppress(Exception):
            zf.close()
        handle.close()


def _check_file_table(path: Path, files: Any, members: dict[str, zipfile.ZipInfo], sums: dict[str, str]) -> None:
    if not isinstance(files, dict):
        raise _fail(path, "has a manifest without a 'files' table", _TAMPERED)
    expected = set(members) - {MANIFEST_NAME, SIGNATURE_NAME}
    if set(files) != expected:
        odd = sorted(set(files) ^ expected)[:5]
        raise _fail(path, f"has a manifest whose file table disagrees with the archive members (e.g. {odd})", _TAMPERED)
    for name, entry in files.items():
        if not (isinstance(entry, dict) and set(entry) == {"size", "sha256"}
                and type(entry["size"]) is int and isinstance(entry["sha256"], str)):
            raise _fail(path, f"has a malformed manifest entry for {name!r}", _TAMPERED)
        if entry["size"] != members[name].file_size:
            raise _fail(path, f"has a member {name!r} whose size differs from the manifest's", _TAMPERED)
        if entry["sha256"] != sums[name]:
            raise _fail(path, f"has a sums file that disagrees with the manifest about {name!r}", _TAMPERED)

