"""Recognizing a checkpoint written by the reference Torch Tweak, to refuse it with a message that helps.

The reference stores its tuned modules in ``state_dict.pt``, a ``torch.save`` pickle, inside a ``.tt`` zip (or
an unpacked folder). torch_tweak never unpickles: loading a pickle can run any code its author chose. Only
the names in the zip's directory are read here; no member is opened.
"""

from __future__ import annotations

import contextlib
import zipfile
from pathlib import Path

from torch_tweak.errors import CheckpointError
from torch_tweak.torch.checkpoint.manifest import MANIFEST_NAME

REFERENCE_STATE = "state_dict.pt"


def _message(path: Path) -> str:
    return (f"{path} is a checkpoint of the reference Torch Tweak (it holds {REFERENCE_STATE}, a pickle). "
            "torch_tweak does not load pickles, because unpickling a file can run any code its author put in it. "
            "Re-tune the model with torch_tweak (tt.tune on the same samples) and save it with "
            "tt.save(model, 'model.tt'); see docs/migrating.md.")


def refuse_reference_checkpoint(path: Path) -> None:
    """Raise :class:`CheckpointError` if ``path`` is a reference checkpoint (a ``.tt`` zip or its unpacked folder)."""
    if path.is_dir():
        if (path / REFERENCE_STATE).is_file():
            raise CheckpointError(_message(path))
        return
    if not path.is_file():
        return
    names: list[str] = []
    with contextlib.suppress(Exception):  # not a readable zip: the verifying reader reports what is wrong
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
    if MANIFEST_NAME not in names and any(name.rpartition("/")[2] == REFERENCE_STATE for name in names):
        raise CheckpointError(_message(path))
