"""Where ``tt.save``/``tt.load`` put a checkpoint, as the reference Torch Tweak configures it (``storage=``).

The reference runs a list of save and load tasks (pickle the state, copy artifacts, hash, zip). torch_tweak's
checkpoint is always one verified ``.tt`` zip plus its sums file (:mod:`torch_tweak.torch.checkpoint`), so a
storage here only decides the file's location and whether an existing one may be replaced. Options that
would need another format are refused with a message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_tweak.errors import CheckpointError, ConfigError
from torch_tweak.utils.validate import check_bool

SUFFIX = ".tt"


class Storage:
    """Base of the reference's storage classes: maps the ``path`` given to ``tt.save``/``tt.load`` to a file.

    Subclass it and override :meth:`checkpoint_path` (and :meth:`check_save`) to store checkpoints elsewhere.
    """

    def __init__(self, save_tasks: Any = None, load_tasks: Any = None) -> None:
        if save_tasks or load_tasks:
            raise ConfigError(
                "Storage(save_tasks=..., load_tasks=...) is not supported: torch_tweak writes one verified .tt file "
                "(JSON manifest, safetensors, backend artifacts; never pickle), so custom task lists have nothing to "
                "plug into. Subclass Storage and override checkpoint_path() to choose where the file goes."
            )

    def checkpoint_path(self, path: str | os.PathLike[str]) -> Path:
        """The ``.tt`` file for ``path`` (the path itself here)."""
        return Path(path)

    def check_save(self, target: Path) -> None:
        """Raise if a checkpoint must not be written to ``target`` (nothing is refused here)."""


@dataclass
class LocalTorchStorage(Storage):
    """Checkpoints under ``base_folder``, as in the reference: ``tt.save(model, "x.tt", storage=LocalTorchStorage())``
    writes ``checkpoints/x.tt`` and ``checkpoints/x_sha256_sums.txt``.

    Attributes:
        base_folder: folder the paths given to save/load are relative to.
        compress_checkpoint: must stay True: a checkpoint is always a ``.tt`` zip (binaries are stored, text
            is deflated).
        overwrite_checkpoint_on_tune: False refuses to replace an existing checkpoint.
        remove_checkpoint_after_tune: accepted; nothing to remove, since no unpacked folder is ever left behind.
        sha_type: ``"256"`` only: the sums file lists SHA-256 digests.
    """

    base_folder: str | os.PathLike[str] = "checkpoints"
    compress_checkpoint: bool = True
    overwrite_checkpoint_on_tune: bool = True
    remove_checkpoint_after_tune: bool = False
    sha_type: str = "256"

    def __post_init__(self) -> None:
        if not isinstance(self.base_folder, (str, os.PathLike)):
            raise ConfigError(f"LocalTorchStorage.base_folder must be a path, got {type(self.base_folder).__name__}.")
        for name in ("compress_checkpoint", "overwrite_checkpoint_on_tune", "remove_checkpoint_after_tune"):
            check_bool(getattr(self, name), f"LocalTorchStorage.{name}")
        if not self.compress_checkpoint:
            raise ConfigError("LocalTorchStorage(compress_checkpoint=False) is not supported: torch_tweak always writes "
                              "one .tt zip with a sums file beside it, verified member by member on load. Leave "
                              "compress_checkpoint at True.")
        if self.sha_type != "256":
            raise ConfigError(f"LocalTorchStorage(sha_type={self.sha_type!r}) is not supported: the sums file lists "
                              "SHA-256 digests. Use sha_type='256' (the default).")

    def checkpoint_path(self, path: str | os.PathLike[str]) -> Path:
        """``base_folder / path``, with the ``.tt`` suffix added when missing."""
        target = Path(self.base_folder) / Path(path)
        return target if target.suffix == SUFFIX else target.with_name(target.name + SUFFIX)

    def check_save(self, target: Path) -> None:
        """Refuse to replace an existing checkpoint when ``overwrite_checkpoint_on_tune`` is False."""
        if not self.overwrite_checkpoint_on_tune and target.exists():
            raise CheckpointError(f"{target} exists and LocalTorchStorage(overwrite_checkpoint_on_tune=False) forbids "
                                  "replacing it; delete it or choose another path.")
