"""``tt.save`` and ``tt.load`` with the reference Torch Tweak's extra arguments (``docs/migrating.md``).

Both delegate to :func:`torch_tweak.torch.checkpoint.save` and :func:`torch_tweak.torch.checkpoint.load`;
``storage`` only decides where the ``.tt`` file is (:mod:`torch_tweak.torch.checkpoint.storage`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch_tweak.errors import CheckpointError, ConfigError
from torch_tweak.torch import checkpoint as _checkpoint
from torch_tweak.torch.checkpoint.storage import LocalTorchStorage, Storage
from torch_tweak.utils.quiet import external_logging_disabled
from torch_tweak.utils.validate import check_bool


def _storage(storage: Any) -> Storage:
    if storage is None:
        return Storage()
    if not isinstance(storage, Storage):
        raise ConfigError(f"storage must be a tt.Storage (e.g. tt.LocalTorchStorage()), got {type(storage).__name__}.")
    return storage


def save(obj: Any, path: str | os.PathLike[str], storage: Storage | None = None, *, signing_key: Any = None) -> Path:
    """Save the tuned modules of ``obj`` to the ``.tt`` file ``path`` (see :func:`torch_tweak.torch.checkpoint.save`).

    Args:
        storage: where the file goes; ``tt.LocalTorchStorage()`` puts it under ``checkpoints/`` as the reference
            does. Without one, ``path`` is used as given.
        signing_key: sign the checkpoint (see ``docs/security.md``).

    Returns:
        The path of the ``.tt`` file written.
    """
    where = _storage(storage)
    target = where.checkpoint_path(path)
    where.check_save(target)
    return _checkpoint.save(obj, target, signing_key=signing_key)


def load(obj: Any, path: str | os.PathLike[str], device_map: dict[str, Any] | None = None,
         storage: Storage | None = None, disable_external_logging: bool = False, *,
         trust_native_code: bool = False, verify_key: Any = None) -> Any:
    """Restore the tuned modules saved in ``path`` into ``obj`` (see :func:`torch_tweak.torch.checkpoint.load`).

    Args:
        device_map: ``{module name: device}``; the key ``""`` stands for every module.
        storage: where the file is (as for :func:`save`). The reference's positional order
            ``load(obj, path, storage)`` works too: a storage passed third is taken as ``storage``.
        disable_external_logging: drop other libraries' log records while loading (off by default here;
            the reference turns it on).
        trust_native_code: allow artifacts that are native code (see ``docs/security.md``).
        verify_key: require a valid signature made with this key (see ``docs/security.md``).

    Returns:
        ``obj``, or the root ``tt.Module`` when the saved object was itself a tuned ``tt.Module``.
    """
    if isinstance(device_map, Storage) or (isinstance(storage, dict) and device_map is None):
        device_map, storage = storage, device_map  # type: ignore[assignment]
    target = _storage(storage).checkpoint_path(path)
    reference_place = LocalTorchStorage().checkpoint_path(path)
    if storage is None and not target.exists() and reference_place.exists():
        raise CheckpointError(f"There is no checkpoint at {target}, but there is one at {reference_place}: the "
                              "reference Torch Tweak puts checkpoints under checkpoints/, torch_tweak uses the path as "
                              "given. Pass that path, or storage=tt.LocalTorchStorage().")
    with external_logging_disabled(check_bool(disable_external_logging, "disable_external_logging")):
        return _checkpoint.load(obj, target, device_map, trust_native_code=trust_native_code, verify_key=verify_key)
