"""BackendConfig: the base of every backend's configuration dataclass (key, description, JSON, checkpoint form).

A config is data a checkpoint carries, so it has its own module: :mod:`.backend` (the Backend contract) and the
checkpoint code read it without the state machine. ``torch_tweak.torch.backend.backend.BackendConfig`` stays
the public path.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from torch_tweak.errors import ConfigError
from torch_tweak.utils.hashing import hash_string
from torch_tweak.utils.permissions import open_secure


@dataclass
class BackendConfig:
    """Base class of backend configurations (dataclasses validated in ``__post_init__``)."""

    #: Fields that change only how calls are scheduled (streams, threads), never what they compute.
    scheduling_settings: ClassVar[tuple[str, ...]] = ()

    def key(self) -> str:
        """Returns the keys of the backend configuration."""
        config_dict = self._to_json(self.to_dict())
        return hash_string(json.dumps(config_dict, sort_keys=True))

    def outputs_key(self) -> str | None:
        """A hash of every field but :attr:`scheduling_settings`: configurations with the same one compute the same
        outputs. None when the config has no scheduling settings."""
        if not self.scheduling_settings:
            return None
        fields = {k: v for k, v in self._to_json(self.to_dict()).items() if k not in self.scheduling_settings}
        return hash_string(json.dumps(fields, sort_keys=True))

    def describe(self) -> str:
        """Describe the backend configuration. Display only changed fields."""
        default = self.__class__()
        return ",".join(self._get_changed_fields(self, default))

    def unsafe_settings(self) -> list[str]:
        """Settings that could make loading run a program or touch files outside a checkpoint.

        A checkpoint may come from a stranger, so ``tt.load`` refuses a config for which this list is not
        empty, and ``tt.save`` refuses to write one. Each entry says which setting and why. Fields validated
        by type and range in ``__post_init__`` are inert; a config with free-form options (compiler flags,
        folders) overrides this and allows only keys known to be inert.
        """
        return []

    def to_dict(self) -> dict[str, Any]:
        """Returns the state_dict of the backend."""
        return asdict(self)

    def to_json(self, path: str | Path) -> None:
        """Saves the backend configuration to a file (created with owner-only permissions)."""
        config_dict = self._to_json(self.to_dict())
        with open_secure(path, "w") as f:
            json.dump(config_dict, f, indent=2)

    @classmethod
    def from_dict(cls, state_dict: dict[str, Any]) -> BackendConfig:
        """Create a config from :meth:`to_dict` output; unknown fields are refused."""
        if not isinstance(state_dict, dict):
            raise ConfigError(f"{cls.__name__}.from_dict expects a dict, got {type(state_dict).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(state_dict) - known)
        if unknown:
            raise ConfigError(f"{cls.__name__} has no field(s) {unknown}; known fields: {sorted(known)}.")
        return cls(**state_dict)

    @staticmethod
    def _to_json(obj: Any) -> Any:
        """Convert ``obj`` recursively into JSON-able values (dtypes and other objects become strings)."""
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, enum.Enum):
            return BackendConfig._to_json(obj.value)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return BackendConfig._to_json(asdict(obj))
        if isinstance(obj, dict):
            return {str(k): BackendConfig._to_json(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple, set, frozenset)):
            items = sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else obj
            return [BackendConfig._to_json(v) for v in items]
        if isinstance(obj, torch.dtype):
            return str(obj).removeprefix("torch.")
        return str(obj)

    @staticmethod
    def _get_changed_fields(config: BackendConfig, default: BackendConfig) -> list[str]:
        """``name=value`` for every field whose value differs from the default."""
        changed = []
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if value != getattr(default, f.name):
                shown = BackendConfig._to_json(value)
                changed.append(f"{f.name}={shown}")
        return changed
