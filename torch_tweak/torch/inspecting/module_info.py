"""Reference-compatible import path (``docs/migrating.md``); the code is in :mod:`.inspect`.

The reference's ``InspectedModulesInfo`` is :class:`~torch_tweak.torch.inspecting.inspect.InspectionReport`.
"""

from torch_tweak.torch.inspecting.inspect import InspectionReport, ModuleInfo

InspectedModulesInfo = InspectionReport

__all__ = ["InspectedModulesInfo", "ModuleInfo"]
