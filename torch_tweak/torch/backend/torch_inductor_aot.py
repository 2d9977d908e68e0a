"""AOTInductor: ``torch.export`` of one graph, compiled ahead of time into a ``.pt2`` package.

The graph is exported through a flat wrapper (inputs are the graph's tensors in :class:`GraphSpec` order,
non-tensor values are bound from the recorded structure, outputs are returned flattened), with dynamic
shapes from the graph spec: one shared ``Dim`` for every batch axis (``k * batch`` for an axis that holds
``k`` items per batch element) and one per dynamic axis with its observed range. Export examples use batch
and dynamic sizes >= 2, because ``torch.export`` specialises sizes 0 and 1. The package
(``<cache_dir>/model.pt2``) holds the compiled code and the weights, so neither the original module nor a
compiler is needed at inference, and a backend restored from a checkpoint only loads the package.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import BuildError, ConversionError, UnsupportedDeviceError
from torch_tweak.torch.backend._compile_helpers import build_failure
from torch_tweak.torch.backend._export import (
    FlatForward,
    check_served_sizes,
    dynamic_shapes,
    example_leaves,
    export_with_dims,
)
from torch_tweak.torch.backend._inductor_options import unsafe_inductor_options, validate_inductor_options
from torch_tweak.torch.backend.backend import Backend, BackendConfig
from torch_tweak.torch.module.forward import pristine
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, flatten_sample, unflatten
from torch_tweak.utils.permissions import secure_file
from torch_tweak.utils.validate import check_bool

logger = logging.getLogger(__name__)

PACKAGE_NAME = "model.pt2"
STATE_PACKAGE = "package"


@dataclass
class TorchInductorAOTBackendConfig(BackendConfig):
    """Configuration of :class:`TorchInductorAOTBackend`.

    Attributes:
        options: Inductor config options for ``aoti_compile_and_package`` (e.g. ``{"max_autotune": True}``).
        strict: export with ``torch.export``'s strict mode (TorchDynamo tracing) instead of the default
            non-strict mode (Python runs as usual; more models export).
    """

    options: dict[str, Any] | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_bool(self.strict, f"{owner}.strict")
        if self.options is not None:
            self.options = validate_inductor_options(self.options, owner)

    def unsafe_settings(self) -> list[str]:
        """Inductor options outside the inert allowlist (see :func:`unsafe_inductor_options`)."""
        return unsafe_inductor_options(self.options)


def export_graph(module: nn.Module, graph_spec: GraphSpec, data: list[Sample], strict: bool) -> Any:
    """``torch.export`` one graph of ``module`` through :class:`FlatForward`; raise :class:`ConversionError`.

    Independent dynamic axes are tried first; if ``torch.export`` finds them related (e.g. the sequence axis of
    ids and of their mask), it is retried with ``Dim.AUTO`` so that export infers the relation
    (:func:`~._export.export_with_dims`); a program that does not take every recorded size is refused
    (:func:`~._export.check_served_sizes`).
    """
    leaves = tuple(example_leaves(graph_spec, data))
    with torch.no_grad(), pristine(module):
        wrapper = FlatForward(module, graph_spec).eval()

        def export(auto_dims: bool) -> Any:
            shapes = dynamic_shapes(graph_spec, auto_dims=auto_dims)
            return torch.export.export(wrapper, leaves, dynamic_shapes=shapes, strict=strict)

        program = export_with_dims(module, graph_spec, export, "torch.export")
    check_served_sizes(program, graph_spec)
    return program


class TorchInductorAOTBackend(Backend):
    """Runs one graph as an AOTInductor package compiled at build time and loaded without recompiling.

    Checkpoints store the config, the graph spec (the output structure included) and the package file
    (``to_dict()["package"]`` is a :class:`pathlib.Path`); no tensors and no recorded inputs.
    """

    native_code = True  # the .pt2 holds a shared object whose constructors run when it is loaded
    artifact_keys = (STATE_PACKAGE,)
    config_class = TorchInductorAOTBackendConfig

    requires_original_module = False

    def __init__(self, config: TorchInductorAOTBackendConfig | None = None) -> None:
        super().__init__()
        self._config = config or TorchInductorAOTBackendConfig()
        self._graph_spec: GraphSpec | None = None
        self._package: Path | None = None
        self._runner: Any = None

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        self._graph_spec = graph_spec
        try:
            program = export_graph(module, graph_spec, data, self._config.strict)
        except Exception as exc:
            raise build_failure(
                f"torch.export of graph {graph_spec.name!r} for AOTInductor failed",
                exc,
                cache_dir,
                "The module could not be captured as one graph with the recorded dynamic shapes; data-dependent "
                "Python control flow and sizes fixed by the code are the usual causes. Use TorchInductorBackend "
                "(torch.compile allows graph breaks) for this module.",
                error_cls=ConversionError,
            ) from exc
        package = cache_dir / PACKAGE_NAME
        try:
            import torch._inductor

            with torch.no_grad():
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(package), inductor_configs=self._config.options
                )
        except Exception as exc:
            raise build_failure(f"AOTInductor compilation of graph {graph_spec.name!r} failed", exc, cache_dir) from exc
        secure_file(package)
        self._package = package
        self._load()
        for sample in data:  # the first run of each recorded shape happens now, not at the user's first call
            self._infer(*sample[0], **sample[1])
        return self

    def _load(self) -> None:
        if self._package is None or not self._package.is_file():
            raise BuildError(f"The AOTInductor package {self._package} does not exist; build the backend again.")
        index = self._device.index if self._device is not None and self._device.index is not None else -1
        try:
            self._runner = _load_package(self._package, index)
        except Exception as exc:
            raise build_failure(f"Loading the AOTInductor package {self._package} failed", exc, None) from exc

    def reactivates_quickly(self) -> bool:
        """True: the compiled package loads again from its file (a build would compile it again)."""
        return True

    def _activate(self) -> None:
        if self._runner is None:
            self._load()

    def _deactivate(self) -> None:
        self._runner = None

    def _deploy(self) -> None:
        self._load()

    def _set_device(self, device: torch.device | str | None) -> None:
        previous = self._device
        super()._set_device(device)
        if previous is not None and self._device is not None and previous.type != self._device.type:
            self._device = previous
            raise UnsupportedDeviceError(
                f"{self.name}: the AOTInductor package was compiled for {previous.type!r} and cannot run on "
                f"{str(device)!r}; tune the module again on that device."
            )

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = flatten_sample(args, kwargs)
        with torch.no_grad():
            outputs = self._runner(*leaves)
        return unflatten(self._graph_spec.output_structure, outputs)  # type: ignore[union-attr]

    def to_dict(self) -> dict[str, Any]:
        """Type, config, graph spec, device and the package file to store (a :class:`pathlib.Path`)."""
        if self._package is None:
            raise RuntimeError("Backend has not been properly initialized. Please call build() first.")
        return {**self._common_state(), STATE_PACKAGE: self._package}

    @classmethod
    def from_dict(cls, module: nn.Module | None, state_dict: dict[str, Any]) -> TorchInductorAOTBackend:
        """Restore from :meth:`to_dict` output (``package`` is the extracted file); ``module`` is not needed."""
        backend = cls._from_common_state(state_dict, TorchInductorAOTBackendConfig)
        package = state_dict.get(STATE_PACKAGE)
        if not isinstance(package, (str, Path)):
            raise ValueError(f"{cls.__name__} state_dict needs the package path under {STATE_PACKAGE!r}.")
        backend._package = Path(package)
        return backend


def _load_package(package: Path, device_index: int) -> Any:
    """A callable running the package's model on flat input tensors.

    ``torch._inductor.aoti_load_package`` imports Inductor and probes the CPU's vector ISA by compiling small
    C++ programs (1-12 s) only to warn about a mismatch; the package loader it wraps takes ~10 ms. Use the
    loader directly when this torch exposes it (the checkpoint layer checks CPU flags itself), else the
    public function.
    """
    try:
        from torch._C._aoti import AOTIModelPackageLoader
    except ImportError:
        loader = None
    else:
        try:
            loader = AOTIModelPackageLoader(str(package), "model", False, 1, device_index)
        except TypeError:  # a torch whose private loader has another signature
            loader = None
    if loader is None:
        import torch._inductor

        return torch._inductor.aoti_load_package(str(package), device_index=device_index)
    run = loader.run
    return lambda *leaves: run(list(leaves))
