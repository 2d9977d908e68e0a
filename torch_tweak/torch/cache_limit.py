"""Keeping the cache folder under its size limit: least recently used items go first.

Items are the units that can be rebuilt on their own: a candidate's build folder
(``<cache>/<module>/<graph>/<backend key>/``, touched each time a candidate builds there, including when it
reuses a converted model), a stored tuning result (``<cache>/results/<key>.json``, touched when it is
reused), a module's recorded output shapes (``<cache>/recordings/<key>.json``, touched when a run reads it)
and a model OpenVINO compiled for ``tt.load`` (``<cache>/openvino_model_cache/<hash>.blob``, as old as
its first load: OpenVINO does not say which blob a later load reused). Only items inside top-level entries that
the cache marker lists as torch_tweak's are counted or deleted (see :mod:`torch_tweak.torch.cache`); items used
by the running tuning or load stay.
``tt.tune`` and ``tt.load`` call :func:`enforce_size_limit` when they end.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

from torch_tweak.torch.cache import read_marker
from torch_tweak.torch.config import config

logger = logging.getLogger(__name__)

OPENVINO_BLOBS = "openvino_model_cache"  # where OpenVINO keeps the models it compiled for tt.load
RECORDED_SHAPES = "recordings"  # output shapes a tuning run recorded, per module (module/known_shapes.py)
_FILE_ITEMS = {"results": ".json", RECORDED_SHAPES: ".json", OPENVINO_BLOBS: ".blob"}  # entries of files: suffix


def _size(path: Path) -> int:
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def cache_items(root: Path) -> list[tuple[float, int, Path]]:
    """``(last use, bytes, path)`` of every item in torch_tweak's entries of ``root``, oldest first."""
    marker = read_marker(root)
    if marker is None:
        return []
    items: list[tuple[float, int, Path]] = []
    for entry in sorted(marker.entries):
        top = root / entry
        if top.is_symlink() or not top.is_dir():
            continue
        if entry in _FILE_ITEMS:
            candidates = [p for p in top.iterdir() if p.suffix == _FILE_ITEMS[entry]]
        else:
            candidates = [p for graph in top.iterdir() if graph.is_dir() and not graph.is_symlink()
                          for p in graph.iterdir()]
        for path in candidates:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            size = _size(path) if stat.S_ISDIR(st.st_mode) else st.st_size
            items.append((st.st_mtime, size, path))
    return sorted(items, key=lambda item: item[0])


def enforce_size_limit(limit_gb: float | None = None, keep_since: float | None = None) -> list[Path]:
    """Delete least recently used items until the cache holds at most ``limit_gb`` (default
    ``tt.config.cache_size_limit_gb``; None: no limit). Items used at or after ``keep_since`` (a
    ``time.time()`` value: the running tuning's start) stay, since live backends may read them. Returns what
    was deleted."""
    limit = config.cache_size_limit_gb if limit_gb is None else limit_gb
    root = Path(config.cache_dir)
    if limit is None or not root.is_dir():
        return []
    items = cache_items(root)
    total = sum(size for _, size, _ in items)
    budget = int(limit * 2**30)
    deleted: list[Path] = []
    for used, size, path in items:
        if total <= budget or (keep_since is not None and used >= keep_since):
            break
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        except OSError as exc:
            logger.warning("Could not delete %s to keep the cache under %g GB: %s", path, limit, exc)
            continue
        total -= size
        deleted.append(path)
    if deleted:
        logger.info("Deleted %d least recently used cache item(s) to keep %s under %g GB", len(deleted), root, limit)
    return deleted


def touch(path: Path) -> None:
    """Mark ``path`` as just used."""
    try:
        os.utime(path)
    except OSError:
        pass
