"""Warm load for the backends that compile with ``torch.compile`` (Inductor, TorchAO): an AOTInductor package.

A checkpoint of :class:`TorchInductorBackend` or :class:`TorchAOBackend` carries, besides the config, an
AOTInductor package of the graph the backend compiled (the quantized copy for TorchAO), written at
``tt.save``. ``tt.load`` serves the first call from it, compiling nothing.

Why a package and not PyTorch's portable compiler cache (measured on 2026-12-01, BERT-shaped encoder with 4
layers, hidden 256, seq 32, on 2 Xeon cores with AMX; a fresh process and an empty Inductor cache):

* ``torch.compiler.save_cache_artifacts()`` at save, ``load_cache_artifacts()`` before the first call: every
  AOTAutograd and Inductor lookup hits, yet the first output came 16-17 s after loading (20-22 s from process
  start, eager: 4.3-4.5 s), because Dynamo still traces the forward (twice: batch 1 and the dynamic graph).
  Its entries are pickled Python objects, too.
* ``torch.export`` + ``aoti_compile_and_package`` of the same graph: 0.04 s to load the package, 0.1-0.7 s to
  the first output, 4.2-6.7 s from process start, nothing traced or compiled; the torchao int8 dynamic
  quantized model exports as well. One package with symbolic batch and sequence axes serves every size, so a
  size never seen at tuning does not recompile either.

The package costs one AOT compile at ``tt.save`` (20-30 s for that encoder), paid only for the backends
chosen, never for every candidate tried while tuning. Before it is stored, its outputs are compared with the
compiled module's on synthesized inputs: a package that fails to export, compile or match is not stored, and
that module compiles at load as before.

The package is native code (a shared object whose constructors run when it is loaded), so backends list its
key in ``optional_native_keys``: ``tt.load`` extracts and uses it only with ``trust_native_code=True`` or a
verified signature, and otherwise compiles. It is also used only in the environment that made it (torch and
torchao versions, CPU instruction-set flags: :func:`fingerprint`); elsewhere the backend compiles and warns.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.torch import environment
from torch_tweak.torch.backend._compile_helpers import example_batch_sizes
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import flatten, flatten_sample, unflatten
from torch_tweak.utils.permissions import secure_file

logger = logging.getLogger(__name__)

STATE_PACKAGE = "warm_package"
STATE_ENVIRONMENT = "warm_environment"
PACKAGE_NAME = "warm.pt2"
# Largest relative L2 error of a package's outputs against the compiled module's, by executed precision. The
# package and torch.compile run the same Inductor lowering, so fp32 agrees to rounding; quantized graphs may
# round one int8 step differently where a scale differs in its last bit.
_TOLERANCE = {"fp32": 1e-4}
_DEFAULT_TOLERANCE = 2e-2


class WarmLoadWarning(UserWarning):
    """A checkpoint's compiled artifacts are not used (other environment, or not trusted): the module compiles."""


def fingerprint(libraries: tuple[str, ...]) -> dict[str, Any]:
    """What a package depends on: the versions of ``libraries`` (``torch``, ``torchao``) and the CPU's ISA flags."""
    versions = {name: torch.__version__ if name == "torch" else environment.distribution_version(name)
                for name in libraries}
    return {**versions, "isa": environment.isa_flags()}


def mismatch(saved: Any, libraries: tuple[str, ...]) -> str | None:
    """Why a package made in environment ``saved`` (read from a checkpoint) must not run here; None if it may."""
    if not isinstance(saved, dict):
        return "the checkpoint does not record the environment they were compiled in"
    current = fingerprint(libraries)
    reasons = [f"{name} {str(saved.get(name))[:40]} → {current[name]}" for name in libraries
               if saved.get(name) != current[name]]
    isa = saved.get("isa")
    if not (isinstance(isa, list) and all(isinstance(f, str) for f in isa)):
        reasons.append("no CPU flags recorded")
    elif current["isa"] is None or sorted(isa) != current["isa"]:
        here = set(current["isa"] or ())
        missing, extra = sorted(set(isa) - here), sorted(here - set(isa))
        reasons.append("CPU flags differ (" + ", ".join(
            [*(f"{f[:20]} missing here" for f in missing[:5]), *(f"{f} only here" for f in extra[:5])]) + ")")
    return "; ".join(reasons) or None


class PackageRunner:
    """Runs a loaded AOTInductor package with a graph's call structure (flat tensors in, the output rebuilt)."""

    def __init__(self, run: Callable[..., Any], graph_spec: GraphSpec) -> None:
        self._run = run
        self._structure = graph_spec.output_structure

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = flatten_sample(args, kwargs)
        return unflatten(self._structure, self._run(*leaves))


def load(package: Path, graph_spec: GraphSpec, device: torch.device | None) -> PackageRunner:
    """Load ``package`` (native code: callers load only trusted packages) for ``graph_spec``'s calls."""
    from torch_tweak.torch.backend.torch_inductor_aot import _load_package

    index = device.index if device is not None and device.index is not None else -1
    return PackageRunner(_load_package(package, index), graph_spec)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return float("inf")
    if not expected.dtype.is_floating_point:
        return 0.0 if torch.equal(actual, expected) else float("inf")
    diff = torch.linalg.vector_norm((actual - expected).double())
    return float(diff / torch.linalg.vector_norm(expected.double()).clamp_min(1e-12))


def build(module: nn.Module, graph_spec: GraphSpec, folder: Path, *, options: dict[str, Any] | None,
          context: Callable[[], Any], reference: Callable[..., Any], precision: str,
          device: torch.device | None) -> Path | None:
    """Export ``module`` (not intercepted) for ``graph_spec``, compile it to ``folder/warm.pt2`` and check it
    against ``reference`` (the backend's compiled callable) on synthesized inputs; None (logged) on failure."""
    from torch_tweak.torch.backend.torch_inductor_aot import export_graph

    package = folder / PACKAGE_NAME
    what = f"the warm-load package of graph {graph_spec.name!r}"
    try:
        with warnings.catch_warnings():  # torchao's deprecation and cache-hash warnings (G4); harmless here
            warnings.simplefilter("ignore")
            with context():
                program = export_graph(module, graph_spec, [], strict=False)
            import torch._inductor

            with torch.no_grad():
                torch._inductor.aoti_compile_and_package(program, package_path=str(package),
                                                         inductor_configs=options or None)
        secure_file(package)
        runner = load(package, graph_spec, device)
        tolerance = _TOLERANCE.get(precision, _DEFAULT_TOLERANCE)
        with torch.no_grad(), context():
            for batch in example_batch_sizes(graph_spec):
                args, kwargs = graph_spec.example_inputs(batch, device=device or "cpu")
                expected, _ = flatten(reference(*args, **kwargs))
                actual, _ = flatten(runner(*args, **kwargs))
                errors = [_relative_error(a, e) for a, e in zip(actual, expected, strict=True)]
                if max(errors, default=0.0) > tolerance:
                    raise ValueError(f"its outputs differ from the compiled module's at batch {batch} (relative "
                                     f"error {max(errors):.2e} > {tolerance:.0e})")
    except Exception as exc:  # noqa: BLE001 - the checkpoint is still valid without it
        logger.warning("Not storing %s: %s: %s. tt.load will compile this graph.", what, type(exc).__name__,
                       str(exc)[:300])
        package.unlink(missing_ok=True)
        return None
    logger.info("Stored %s (%.1f MB): tt.load serves it without compiling.", what, package.stat().st_size / 2**20)
    return package


def restore(state_dict: dict[str, Any]) -> tuple[Path | None, dict[str, Any] | None]:
    """The package path (None when absent or not trusted) and its recorded environment from a backend state."""
    package = state_dict.get(STATE_PACKAGE)
    if package is not None and not isinstance(package, (str, Path)):
        raise ValueError(f"The backend state's {STATE_PACKAGE!r} must be a path, got {type(package).__name__}.")
    saved = state_dict.get(STATE_ENVIRONMENT)
    return (Path(package) if package is not None else None), (saved if isinstance(saved, dict) else None)


class WarmLoads:
    """Mixed into (before ``Backend``) a backend that saves a warm-load package: ``deploy`` serves from the package
    when it is usable here, and otherwise forgets it and runs :meth:`_deploy_cold` (quantize, compile...)."""

    _WARM_LIBRARIES: tuple[str, ...]
    _warm: Path | None
    _warm_environment: dict[str, Any] | None
    _graph_spec: GraphSpec | None
    _device: torch.device | None
    _compiled: Callable[..., Any] | None
    name: str

    def _deploy(self) -> None:
        self._compiled = load_usable(self._warm, self._warm_environment, self._WARM_LIBRARIES, self.name,
                                     self._graph_spec, self._device)
        if self._compiled is None:
            self._warm = None  # not used here, so not saved again either
            self._deploy_cold()

    def _deploy_cold(self) -> None:
        """Make the backend servable without its package."""
        raise NotImplementedError


def load_usable(package: Path | None, saved_environment: Any, libraries: tuple[str, ...], owner: str,
                graph_spec: GraphSpec | None, device: torch.device | None) -> PackageRunner | None:
    """What a restored backend serves from ``package`` when it may (:func:`usable`), else None: it compiles."""
    if graph_spec is None or not usable(package, saved_environment, libraries, owner, stacklevel=5):
        return None
    assert package is not None  # usable() said so
    return load(package, graph_spec, device)


def state(package: Path | None, environment: dict[str, Any] | None) -> dict[str, Any]:
    """The backend-state entries of a warm-load package and its environment (none without a package)."""
    return {} if package is None else {STATE_PACKAGE: package, STATE_ENVIRONMENT: environment}


def usable(package: Path | None, saved_environment: Any, libraries: tuple[str, ...], owner: str,
           stacklevel: int) -> bool:
    """True if a restored backend may serve from ``package``; warns why not when one was stored but cannot be used
    (``stacklevel``: of the warning, to point at the caller of the backend's ``deploy``)."""
    if package is None:
        return False
    reason = mismatch(saved_environment, libraries)
    if reason is None:
        return True
    message = (f"{owner}: the compiled artifacts in the checkpoint were made in another environment ({reason}); "
               "compiling the module here instead (the first calls are slower; outputs are unaffected). Save the "
               "checkpoint again in this environment to load it warm.")
    warnings.warn(message, WarmLoadWarning, stacklevel=stacklevel)
    return False
