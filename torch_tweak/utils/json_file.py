"""Writing a small JSON file atomically: a reader (another tuning process, a rerun) never sees half of one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write ``doc`` to ``path`` through a temporary file in the same folder; OSError/TypeError/ValueError pass on
    (the temporary file is removed)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}-", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(doc, out, default=str)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
