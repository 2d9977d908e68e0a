"""Reference-compatible import path (``docs/migrating.md``): ``MODULE_REGISTRY``, a read-only view of the live
``tt.Module`` objects by name. torch_tweak registers and forgets modules by itself (a module is dropped when it is
garbage collected), so the reference's ``register``/``unregister``/``clear`` do not exist."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from torch_tweak.errors import ConfigError
from torch_tweak.torch.module.wrapper import Module, registered_modules


class _Registry(Mapping[str, Module]):
    def __getitem__(self, name: str) -> Module:
        return registered_modules()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(registered_modules())

    def __len__(self) -> int:
        return len(registered_modules())

    @property
    def modules(self) -> dict[str, Module]:
        """The live modules by name."""
        return registered_modules()

    def get(self, name: str, default: object = None) -> Module:  # type: ignore[override]
        """The module named ``name``; ConfigError if there is none (as in the reference)."""
        modules = registered_modules()
        if name not in modules:
            raise ConfigError(f"No live tt.Module is named {name!r}; live modules: {sorted(modules)}.")
        return modules[name]


MODULE_REGISTRY = _Registry()

__all__ = ["MODULE_REGISTRY"]
