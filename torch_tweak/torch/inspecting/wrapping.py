"""``tt.wrap``: install ``tt.Module`` proxies in place inside a pipeline object."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from torch_tweak.errors import ConfigError
from torch_tweak.torch.inspecting.inspect import ModuleInfo
from torch_tweak.torch.module.forward import is_intercepted
from torch_tweak.torch.module.walk import path_name, walk
from torch_tweak.torch.module.wrapper import Module, unwrap

logger = logging.getLogger(__name__)


def wrap(obj: Any, modules: list[ModuleInfo | nn.Module], strategy: Any = None, strategies: Any = None) -> Any:
    """Replace each selected module inside ``obj`` by a ``tt.Module`` (attribute, list index or dict key).

    Modules the user already wrapped are kept as they are. Each proxy is named after its path in
    ``obj`` (the object itself: its class name), so a later process that builds the same pipeline gets
    the same names. Returns ``obj``, or the root proxy when ``obj`` itself was selected.
    """
    if strategy is not None and strategies is not None:
        raise ConfigError("Only one of strategy or strategies should be provided")
    if not isinstance(modules, (list, tuple)):
        raise ConfigError(f"modules must be a list of ModuleInfo (from tt.inspect) or nn.Module, got {type(modules).__name__}.")
    found = {id(f.module): f for f in walk(obj, max_depth=64)}
    targets = []
    for item in modules:
        module = unwrap(item.module if isinstance(item, ModuleInfo) else item)
        if not isinstance(module, nn.Module):
            raise ConfigError(f"wrap expects ModuleInfo or nn.Module items, got {type(item).__name__}.")
        if id(module) not in found:
            raise ConfigError(
                f"The {type(module).__name__} to wrap is not reachable from the given {type(obj).__name__} (through "
                "attributes, dicts, lists or child modules); pass modules found by tt.inspect on the same object."
            )
        targets.append(found[id(module)])
    paths = [t.path for t in targets]
    for target in targets:
        for other in paths:
            if other != target.path and target.path[:len(other)] == other:
                raise ConfigError(
                    f"{target.name!r} is inside {path_name(other) or '<root>'!r}, which is also selected; wrap either "
                    "the outer or the inner module, not both."
                )
    root = obj
    for target in targets:
        if is_intercepted(target.module):
            logger.info("Keeping the existing tt.Module around %s", target.name or "<root>")
            continue
        name = target.name or type(target.module).__name__
        proxy = Module(target.module, name=name, strategy=strategy, strategies=strategies)
        if target.path:
            target.slot.set(proxy)
        else:
            root = proxy
    return root
