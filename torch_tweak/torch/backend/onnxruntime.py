"""ONNX Runtime: the graph exported to an ONNX file and run by onnxruntime's CPU execution provider.

A peer users set up by hand; as a backend it is tuned, checked against eager and saved like the others. Build
exports the graph (:mod:`._onnx`: dynamo exporter, every batch and dynamic axis unbounded, so any size eager
serves is served) and optionally quantizes its ``MatMul`` weights to INT8; inference feeds numpy views of the
input tensors (no copy for contiguous CPU tensors) and returns torch views of onnxruntime's output buffers,
rebuilt into the module's output structure. Checkpoints hold the ``.onnx`` file, which is data (a graph and
weights), not native code: loading creates a session from it without exporting or compiling anything.

``onnxruntime`` is imported when a backend is built or loaded, never when this module is imported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from torch_tweak.errors import BuildError, CheckpointError, UnsupportedDeviceError
from torch_tweak.torch.backend._artifact_reuse import copy_files, fingerprint, forget, matches, record
from torch_tweak.torch.backend._onnx import OPSET, export_onnx, quantize_int8_dynamic
from torch_tweak.torch.backend._onnx_session import (
    EXECUTION_MODES,
    OPTIMIZATION_LEVELS,
    OnnxSession,
    import_onnxruntime,
)
from torch_tweak.torch.backend.backend import Backend, BackendConfig
from torch_tweak.torch.environment import usable_cores
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample
from torch_tweak.utils.permissions import secure_mkdir
from torch_tweak.utils.validate import check_choice, check_int

logger = logging.getLogger(__name__)

MODEL_NAME = "model.onnx"
EXPORTED_NAME = "exported.onnx"
STATE_MODEL = "onnx_model"
QUANTIZATIONS = ("int8_dynamic_per_tensor", "int8_dynamic")
_FINER = {"int8_dynamic_per_tensor": "int8_dynamic", "int8_dynamic": None}  # a rejected model's next candidate


@dataclass
class ONNXRuntimeBackendConfig(BackendConfig):
    """Configuration of :class:`ONNXRuntimeBackend`.

    Attributes:
        graph_optimization_level: onnxruntime's graph optimizations: ``all`` (fusions and layout changes for this
            CPU), ``extended``, ``basic`` or ``disabled``.
        intra_op_num_threads: threads of the session's pool; None uses every core this process may run on,
            counted when the session is created.
        execution_mode: ``sequential`` (one node at a time, each using the pool) or ``parallel`` (independent
            branches at once).
        quantization: None (fp32); ``int8_dynamic_per_tensor`` (INT8 ``MatMul`` weights with one scale per matrix,
            onnxruntime's default and its faster kernel), or ``int8_dynamic`` (one scale per output channel, finer);
            activations are quantized per call.
    """

    #: Threads and execution mode run the same model: configurations differing only in them are twins.
    scheduling_settings: ClassVar[tuple[str, ...]] = ("intra_op_num_threads", "execution_mode")

    graph_optimization_level: str = "all"
    intra_op_num_threads: int | None = None
    execution_mode: str = "sequential"
    quantization: str | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        level = self.graph_optimization_level
        self.graph_optimization_level = check_choice(level.lower() if isinstance(level, str) else level,
                                                     f"{owner}.graph_optimization_level", OPTIMIZATION_LEVELS)
        check_int(self.intra_op_num_threads, f"{owner}.intra_op_num_threads", minimum=1, allow_none=True)
        mode = self.execution_mode
        self.execution_mode = check_choice(mode.lower() if isinstance(mode, str) else mode,
                                           f"{owner}.execution_mode", EXECUTION_MODES)
        check_choice(self.quantization, f"{owner}.quantization", QUANTIZATIONS, allow_none=True)


class ONNXRuntimeBackend(Backend):
    """Runs one graph as an ONNX model on onnxruntime's CPU execution provider.

    Checkpoints store the config, the graph spec (the output structure included) and the ONNX file
    (``to_dict()["onnx_model"]`` is a :class:`pathlib.Path`; the folder holding ``model.onnx`` and its external
    weights for a model over 2 GiB); no tensors and no recorded inputs.
    """

    runtime = "onnxruntime"  # its own thread pool, separate from torch's
    rebuilds_from_files = True  # the saved ONNX model is reused (fingerprint.json)
    native_code = False  # an ONNX file is a graph and weights; onnxruntime only interprets it
    requires_original_module = False
    artifact_keys = (STATE_MODEL,)
    config_class = ONNXRuntimeBackendConfig
    _devices = ("cpu",)

    def __init__(self, config: ONNXRuntimeBackendConfig | None = None) -> None:
        super().__init__()
        self._config = config or ONNXRuntimeBackendConfig()
        self._graph_spec: GraphSpec | None = None
        self._model: Path | None = None
        self._session: OnnxSession | None = None

    @property
    def executed_precision(self) -> str:
        """``int8`` for the quantized variant, else the precision of the graph's floating-point outputs."""
        if self._config.quantization is not None:
            return "int8"
        dtypes = {s.dtype for s in self._graph_spec.outputs} if self._graph_spec is not None else set()
        return "fp16" if "float16" in dtypes else "fp32"

    @classmethod
    def default_variants(cls) -> list[Backend]:
        """The fp32 model (every graph optimization, one thread per usable core) and, where ``onnx`` is installed,
        its dynamic INT8 variant with per-tensor weights, quantized from the fp32 candidate's export: on CPUs without
        VNNI or AMX it is the int8 that runs faster than float (a BERT-base on 2 cores of an AVX2 EPYC: 77 against
        135 ms at batch 1, cosine 0.9992 of eager; docs/backends.md), and per-tensor weights run faster than
        per-channel ones at small batches (an MLP 768-3072-768 at batch 1: 47 against 59 µs, AVX-512 VNNI EPYC, 2
        cores; the same error on random weights). On a CNN a stand-in rule skips it. With more than one usable core,
        the INT8 model on one thread too (an MLP 256-512-256, 2-core AVX2 EPYC: 23.8 against 32.5 µs at batch 1 in
        one run, 23.8 against 23.3 in another; one-thread fp32 was no faster). ``tune_strategy/twins.py`` skips it."""
        variants: list[Backend] = [cls()]
        if importlib.util.find_spec("onnx") is not None:
            int8 = ONNXRuntimeBackendConfig(quantization="int8_dynamic_per_tensor")
            variants.append(cls(int8))
            if (usable_cores() or 1) > 1:
                variants.append(cls(dataclasses.replace(int8, intra_op_num_threads=1)))
        return variants

    def precision_fallback(self) -> ONNXRuntimeBackend | None:
        """For an INT8 model the fidelity check rejected, the next finer configuration: per-channel weights for
        per-tensor ones, float for per-channel ones."""
        if self._config.quantization is None:
            return None
        return ONNXRuntimeBackend(dataclasses.replace(self._config, quantization=_FINER[self._config.quantization]))

    def every_core_twin(self) -> ONNXRuntimeBackend | None:
        """The same configuration with ``intra_op_num_threads=None`` (every usable core) when this one sets it."""
        if self._config.intra_op_num_threads is None:
            return None
        return ONNXRuntimeBackend(dataclasses.replace(self._config, intra_op_num_threads=None))

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        import_onnxruntime()
        if any(s.dtype == "bfloat16" for s in graph_spec.inputs):
            raise BuildError("ONNX Runtime's Python API takes numpy arrays, which have no bfloat16; this graph has "
                             "bfloat16 inputs. Tune with float32 inputs, or use another backend for this module.")
        self._graph_spec = graph_spec
        folder = secure_mkdir(cache_dir / "onnxruntime")
        settings = {k: v for k, v in self._config.to_dict().items() if k not in self._config.scheduling_settings}
        versions = {"torch": torch.__version__, "onnxruntime": import_onnxruntime().__version__, "opset": OPSET}
        fp = fingerprint(module, graph_spec, settings, versions)
        model = folder / MODEL_NAME
        if model.is_file() and matches(cache_dir, fp):  # built before from the same weights, graph and settings
            self._logger.info("Reusing the ONNX model in %s (same weights, graph and settings)", folder)
        else:
            forget(cache_dir)  # the fingerprint sits beside the model folder, which holds only the model's files
            _clear(folder)
            if not self._copy_twin(cache_dir, folder, fp):
                if self._config.quantization is None:
                    model = export_onnx(module, graph_spec, data, model, cache_dir)
                else:  # quantized from the float candidate's model where one was built for this graph
                    base = fingerprint(module, graph_spec, {**settings, "quantization": None}, versions)
                    exported = next(self._siblings(cache_dir, folder.name, base), None)
                    if exported is None:
                        exported = export_onnx(module, graph_spec, data, cache_dir / EXPORTED_NAME, cache_dir)
                    else:
                        self._logger.info("Quantizing the ONNX model of %s (same weights and graph)", exported.parent)
                        exported = exported / MODEL_NAME
                    model = quantize_int8_dynamic(exported, model, cache_dir,
                                                 per_channel=self._config.quantization == "int8_dynamic")
                    for path in (cache_dir / EXPORTED_NAME, cache_dir / (EXPORTED_NAME + ".data")):
                        path.unlink(missing_ok=True)  # the fp32 model is not used once quantized
            record(cache_dir, fp)
        external = [p.name for p in folder.iterdir() if p != model]
        self._model = folder if external else model  # weights over 2 GiB are external files beside the model
        self._load(building=True)
        return self

    def _copy_twin(self, cache_dir: Path, folder: Path, fp: str | None) -> bool:
        """Copy into ``folder`` the model another candidate of this graph built with fingerprint ``fp`` (a twin that
        differs in threads or execution mode only), instead of exporting again (a BERT-base: 10 s)."""
        for source in self._siblings(cache_dir, folder.name, fp):
            if copy_files(source, folder, sorted(p.name for p in source.iterdir() if p.is_file())):
                self._logger.info("Reusing the ONNX model of %s (same weights, graph and settings)", source.parent)
                return True
            _clear(folder)  # what a failed copy left
        return False

    def _siblings(self, cache_dir: Path, name: str, fp: str | None) -> Iterator[Path]:
        """The model folders (``name``) other candidates of this graph built with fingerprint ``fp``."""
        for sibling in sorted(cache_dir.parent.glob(f"{type(self).__name__}_*")) if fp is not None else ():
            source = sibling / name
            if sibling != cache_dir and matches(sibling, fp) and (source / MODEL_NAME).is_file():
                yield source

    def _load(self, building: bool) -> None:
        if self._model is None or self._graph_spec is None:
            raise RuntimeError("Backend has not been properly initialized. Please call build() first.")
        path = _model_file(self._model)
        try:
            config = self._config
            self._session = OnnxSession(path, self._graph_spec, optimization_level=config.graph_optimization_level,
                                        execution_mode=config.execution_mode, threads=config.intra_op_num_threads)
        except BuildError:
            raise
        except Exception as exc:
            if building:
                raise BuildError(f"onnxruntime could not load the exported model {path}: {exc}") from exc
            raise CheckpointError(
                f"Could not load the ONNX model {path}: {exc}. The file is corrupt, refers to data outside its "
                "folder, or needs a newer onnxruntime; tune the module again or restore the checkpoint."
            ) from exc
        self._logger.debug("Session for %s: %d threads, %s.", path, self._session.threads, self._config)

    def _activate(self) -> None:
        if self._session is None:
            self._load(building=False)

    def _deactivate(self) -> None:
        self._session = None

    def _deploy(self) -> None:
        self._load(building=False)

    def _set_device(self, device: torch.device | str | None) -> None:
        super()._set_device(device)
        if self._device is not None and self._device.type != "cpu":
            wanted, self._device = self._device, torch.device("cpu")
            raise UnsupportedDeviceError(f"{self.name} runs on onnxruntime's CPU execution provider and cannot run on "
                                         f"{str(wanted)!r}; deploy it with device 'cpu' or None.")

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return self._session(args, kwargs)  # type: ignore[misc]

    def _serving(self) -> Callable[..., Any]:
        return self._session.serving()  # type: ignore[union-attr]

    def checked_serving(self, array_ok: Callable[[Any], bool], refused: Callable[..., Any],
                        other: Callable[..., Any]) -> Callable[..., Any] | None:
        """The session's short path with ``array_ok`` asked first (see :meth:`Backend.checked_serving`)."""
        if not self.is_active or self._session is None:
            return None
        return self._session.checked_serving(array_ok, refused, other)

    def to_dict(self) -> dict[str, Any]:
        """Type, config, graph spec, device and the ONNX model to store (a :class:`pathlib.Path`)."""
        if self._model is None:
            raise RuntimeError("Backend has not been properly initialized. Please call build() first.")
        return {**self._common_state(), STATE_MODEL: self._model}

    @classmethod
    def from_dict(cls, module: nn.Module | None, state_dict: dict[str, Any]) -> ONNXRuntimeBackend:
        """Restore from :meth:`to_dict` output (``onnx_model`` is the extracted file); ``module`` is not needed."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"Invalid state_dict type: {type(state_dict).__name__}")
        backend = cls._from_common_state(state_dict, ONNXRuntimeBackendConfig)
        model = state_dict.get(STATE_MODEL)
        if not isinstance(model, (str, Path)):
            raise ValueError(f"Checkpoint is missing the ONNX model path ({STATE_MODEL}).")
        backend._model = Path(model)
        if not _model_file(backend._model).is_file():
            raise CheckpointError(f"The ONNX model {backend._model} does not exist; the checkpoint is incomplete or the "
                                  "cache folder was cleaned. Tune the module again or restore the files.")
        return backend


def _clear(folder: Path) -> None:
    """Remove a previous build's files from ``folder``, which holds one model."""
    for stale in folder.iterdir():
        if stale.is_file():
            stale.unlink()


def _model_file(artifact: Path) -> Path:
    """The ``.onnx`` file of an artifact: the file itself, or ``model.onnx`` in a folder with external weights."""
    return artifact / MODEL_NAME if artifact.is_dir() else artifact
