"""Following a checkpoint's stored module path in the object being loaded into, with errors that say what to fix.

Paths are the steps of ``module/walk.py`` (which also finds the modules ``tt.save`` stores); a step is
followed only if a storable walk of the loading object takes it, so a manifest cannot lead the load
anywhere a save could not have come from.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torch_tweak.errors import CheckpointError
from torch_tweak.torch.checkpoint.manifest import path_text
from torch_tweak.torch.module.walk import Slot, Step, steps_below
from torch_tweak.torch.module.wrapper import unwrap

# What each step kind names in an error, and how to fix a missing one.
_MISSING = {
    "child": ("child module", "Load into the same model or pipeline class that was saved."),
    "attr": ("attribute", "Load into the same pipeline class that was saved."),
    "item": ("dict entry", "Load into the same pipeline that was saved."),
    "index": ("list entry", "Load into the same pipeline that was saved."),
}


def resolve(obj: Any, path: list[Step], name: str) -> Slot:
    """Follow ``path`` from ``obj`` without changing anything; raise CheckpointError naming the failing step."""
    slot = Slot(None, None, obj)
    for depth, step in enumerate(path):
        steps = steps_below(slot.value, storable=True)
        reached = dict(steps)
        if step not in reached:
            kind, key = step
            what, fix = _MISSING[kind]
            here = path_text(path[:depth]) if depth else "the object"
            listing = f" (it has {[str(k) for (_, k), _ in steps][:20]})" if kind in ("child", "attr") else ""
            raise CheckpointError(f"The checkpoint has module {name!r} at {path_text(path)}, but {here} has no {what} "
                                  f"{key!r}{listing}. {fix}")
        slot = Slot(unwrap(slot.value), step, reached[step])
    if not isinstance(slot.value, nn.Module):
        raise CheckpointError(f"The checkpoint has module {name!r} at {path_text(path)}, but the object there is a "
                              f"{type(slot.value).__name__}, not a torch module.")
    return slot
