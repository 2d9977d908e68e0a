"""Finding the modules that matter (``tt.inspect``) and wrapping them in place (``tt.wrap``)."""

from torch_tweak.torch.inspecting.inspect import InspectionReport, ModuleInfo, inspect
from torch_tweak.torch.inspecting.wrapping import wrap

__all__ = ["InspectionReport", "ModuleInfo", "inspect", "wrap"]
