"""torch_tweak's public API: ``import torch_tweak.torch as tt``.

Typical use::

    import torch_tweak.torch as tt

    model = tt.Module(model)                  # or tt.wrap(pipeline, tt.inspect(pipeline, data).get_modules())
    report = tt.tune(model, samples)          # record, build candidates, check fidelity, choose
    print(report)
    outputs = model(inputs)                   # runs the chosen backend

Importing this module imports torch but neither openvino nor torchao.

Names kept for code written for the reference Torch Tweak (``docs/migrating.md``): ``DataLoaderFactory``,
``LocalTorchStorage``, ``Storage``, ``torch_tweak_cache_dir``, and the ``storage``/``disable_external_logging``
arguments of ``save``/``load``.
"""

from torch_tweak.torch._reference_compat import load, save
from torch_tweak.torch.checkpoint.storage import LocalTorchStorage, Storage
from torch_tweak.torch.config import config, torch_tweak_cache_dir
from torch_tweak.torch.dataset import DataLoaderFactory
from torch_tweak.torch.fidelity import FidelityConfig, Tolerance
from torch_tweak.torch.inspecting import InspectionReport, ModuleInfo, inspect, wrap
from torch_tweak.torch.module.spec import GraphSpec, TensorSpec
from torch_tweak.torch.module.tree import register_type
from torch_tweak.torch.module.wrapper import Module, ModuleState
from torch_tweak.torch.report import TuningReport
from torch_tweak.torch.tune_strategy import (
    FirstWinsStrategy,
    HighestThroughputStrategy,
    LatencyBudgetStrategy,
    LowestLatencyStrategy,
    OneBackendStrategy,
    TuneStrategy,
)
from torch_tweak.torch.tuning import tune

__all__ = [
    "DataLoaderFactory",
    "FidelityConfig",
    "FirstWinsStrategy",
    "GraphSpec",
    "HighestThroughputStrategy",
    "InspectionReport",
    "LatencyBudgetStrategy",
    "LocalTorchStorage",
    "LowestLatencyStrategy",
    "Module",
    "ModuleInfo",
    "ModuleState",
    "OneBackendStrategy",
    "Storage",
    "TensorSpec",
    "Tolerance",
    "TuneStrategy",
    "TuningReport",
    "config",
    "inspect",
    "load",
    "register_type",
    "save",
    "torch_tweak_cache_dir",
    "tune",
    "wrap",
]
