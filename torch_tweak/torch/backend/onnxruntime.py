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

from torch_tweak.errors import BuildError, CheckpointError, UnsupportedDeviceError, UnsupportedInputError
from torch_tweak.torch.backend._artifact_reuse import copy_files, fingerprint, forget, matches, record
from torch_tweak.torch.backend._export import CallLeaves
from torch_tweak.torch.backend._onnx import OPSET, export_onnx, quantize_int8_dynamic, require
from torch_tweak.torch.backend.backend import Backend, BackendConfig
from torch_tweak.torch.environment import usable_cores
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import TENSOR, Sample, dtype_name, unflatten
from torch_tweak.utils.permissions import secure_mkdir
from torch_tweak.utils.validate import check_choice, check_int

logger = logging.getLogger(__name__)

MODEL_NAME = "model.onnx"
EXPORTED_NAME = "exported.onnx"
STATE_MODEL = "onnx_model"
OPTIMIZATION_LEVELS = {"all": "ORT_ENABLE_ALL", "extended": "ORT_ENABLE_EXTENDED", "basic": "ORT_ENABLE_BASIC",
                       "disabled": "ORT_DISABLE_ALL"}
EXECUTION_MODES = {"sequential": "ORT_SEQUENTIAL", "parallel": "ORT_PARALLEL"}
QUANTIZATIONS = ("int8_dynamic",)
_ONNX_TYPES = {"float": torch.float32, "double": torch.float64, "float16": torch.float16, "int64": torch.int64,
               "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


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
        quantization: None (fp32), or ``int8_dynamic`` (INT8 ``MatMul`` weights per output channel, activations
            quantized per call).
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


def import_onnxruntime() -> Any:
    """Import and return ``onnxruntime``, or raise :class:`BackendUnavailableError`."""
    require("onnxruntime", what="to run ONNX models")
    import onnxruntime

    return onnxruntime


class _Session:
    """An ``InferenceSession`` with the mapping from a call's tensors to its inputs and back to the output structure."""

    def __init__(self, path: Path, config: ONNXRuntimeBackendConfig, spec: GraphSpec) -> None:
        ort = import_onnxruntime()
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[
            config.graph_optimization_level])
        options.execution_mode = getattr(ort.ExecutionMode, EXECUTION_MODES[config.execution_mode])
        options.intra_op_num_threads = config.intra_op_num_threads or usable_cores() or 1
        options.log_severity_level = 3  # errors only: unused-initializer notes are not the user's concern
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.threads = options.intra_op_num_threads
        self._spec = spec
        index = {s.name: i for i, s in enumerate(spec.inputs)}
        names = [i.name for i in self.session.get_inputs()]
        outputs = self.session.get_outputs()
        if any(n not in index for n in names) or len(outputs) != len(spec.outputs):
            raise BuildError(
                f"The ONNX model has inputs {names} and {len(outputs)} outputs, but graph {spec.name!r} has inputs "
                f"{list(index)} and {len(spec.outputs)} outputs; the model was not exported for this graph."
            )
        self._feeds = [(name, index[name]) for name in names]  # an input the module ignores may have been dropped
        self._dtypes = [s.torch_dtype for s in spec.inputs]
        self._out_structure = spec.output_structure
        self._leaves = CallLeaves(spec, "ONNX model")
        self._single = self._out_structure == TENSOR
        produced = [_ONNX_TYPES.get(o.type.removeprefix("tensor(").removesuffix(")")) for o in outputs]
        self._casts = [(i, s.torch_dtype) for i, (d, s) in enumerate(zip(produced, spec.outputs)) if d != s.torch_dtype]
        self._output_names = [o.name for o in outputs]
        # InferenceSession.run checks feeds, ownership and graph capture in Python before calling its binding (3-5
        # µs of a 10 µs call on a tiny MLP); the feeds built here always pass those checks, so call the binding.
        binding = getattr(self.session, "_sess", None)
        self._run = binding.run if callable(getattr(binding, "run", None)) else self.session.run
        # one RunOptions for all calls (a run only reads it): None builds one per call, 0.6-0.8 µs of a 14 µs call
        self._options = ort.RunOptions()

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = self._leaves(args, kwargs)
        try:
            feed = {name: leaves[i].numpy() for name, i in self._feeds}
        except (RuntimeError, TypeError, AttributeError):  # autograd, non-CPU, non-tensor leaves
            feed = self._slow_feed(leaves)
        try:
            arrays = self._run(self._output_names, feed, self._options)
        except Exception as exc:  # onnxruntime's own exception types, none of them a builtin it documents
            raise self._input_error(leaves, exc) from exc
        outputs = [torch.from_numpy(a) for a in arrays]
        for i, dtype in self._casts:
            outputs[i] = outputs[i].to(dtype)
        return outputs[0] if self._single else unflatten(self._out_structure, outputs)

    def serving(self) -> Callable[..., Any]:
        """``self(args, kwargs)`` as a function of the call. A graph of one positional tensor and one output that
        needs no cast (the common small model) goes straight to the binding; any other call takes the general path."""
        general = self.__call__

        def other(*args: Any, **kwargs: Any) -> Any:
            return general(args, kwargs)

        return self.checked_serving(None, None, other) or other

    def checked_serving(self, array_ok: Callable[[Any], bool] | None, refused: Callable[..., Any] | None,
                        other: Callable[..., Any]) -> Callable[..., Any] | None:
        """The short path of :meth:`serving` (None where the graph does not allow it), which first asks ``array_ok``
        (when given) about the call's numpy view and hands a call it refuses to ``refused(args, kwargs)``; calls the
        short path cannot take go to ``other``. The non-finite guard checks the view the session is fed: next to
        onnxruntime's spinning threads a second view and the guard's general walk cost an MLP 256-512-256 at batch
        32 more than a tenth of its 95 µs int8 call (AVX2 EPYC, 2 cores)."""
        if not (self._leaves.single_positional and len(self._feeds) == 1 and self._single and not self._casts):
            return None
        name, run, names, from_numpy, options = (self._feeds[0][0], self._run, self._output_names, torch.from_numpy,
                                                 self._options)

        def serve(*args: Any, **kwargs: Any) -> Any:
            if kwargs or len(args) != 1:
                return other(*args, **kwargs)
            try:
                array = args[0].numpy()
            except (RuntimeError, TypeError, AttributeError):
                return other(*args, **kwargs)
            if array_ok is not None and not array_ok(array):
                return refused(args, kwargs)  # type: ignore[misc]
            try:
                return from_numpy(run(names, {name: array}, options)[0])
            except Exception as exc:  # as in __call__
                raise self._input_error(args, exc) from exc

        return serve

    def _slow_feed(self, leaves: Any) -> dict[str, Any]:
        feed = {}
        for name, i in self._feeds:
            t = leaves[i] if i < len(leaves) else None
            if not isinstance(t, torch.Tensor) or t.dtype is not self._dtypes[i]:
                raise self._input_error(leaves, None)
            feed[name] = t.numpy(force=True)
        return feed

    def _input_error(self, leaves: Any, exc: BaseException | None) -> UnsupportedInputError:
        for t, spec in zip(leaves, self._spec.inputs):
            if not isinstance(t, torch.Tensor):
                return UnsupportedInputError(f"{spec.locator}: expected a tensor, got {type(t).__name__}.")
            if dtype_name(t.dtype) != spec.dtype:
                return UnsupportedInputError(
                    f"{spec.locator}: expected dtype {spec.dtype}, got {dtype_name(t.dtype)}; the ONNX model was built "
                    f"for {spec.dtype} inputs. Cast the input, or tune with {dtype_name(t.dtype)} inputs."
                )
            if t.dim() != spec.rank or any(isinstance(s, int) and s != n for s, n in zip(spec.shape, t.shape)):
                return UnsupportedInputError(
                    f"{spec.locator}: shape {list(t.shape)} does not fit the tuned shape {list(spec.shape)} (only "
                    "batch and dynamic axes may change size). Tune with inputs of this shape."
                )
        cause = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else "see the cause"
        return UnsupportedInputError(f"ONNX Runtime rejected the inputs of graph {self._spec.name!r}: {cause[:500]}")


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
        self._session: _Session | None = None

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
        its dynamic INT8 variant, quantized from the fp32 candidate's export: on CPUs without VNNI or AMX it is the
        int8 that runs faster than float (a BERT-base on 2 cores of an AVX2 EPYC: 77 against 135 ms at batch 1,
        cosine 0.9992 of eager; docs/backends.md). On a CNN a stand-in rule skips it. With more than one usable core,
        the INT8 model on one thread too (an MLP 256-512-256, 2-core AVX2 EPYC: 23.8 against 32.5 µs at batch 1 in
        one run, 23.8 against 23.3 in another; one-thread fp32 was no faster). ``tune_strategy/twins.py`` skips it."""
        variants: list[Backend] = [cls()]
        if importlib.util.find_spec("onnx") is not None:
            variants.append(cls(ONNXRuntimeBackendConfig(quantization="int8_dynamic")))
            if (usable_cores() or 1) > 1:
                variants.append(cls(ONNXRuntimeBackendConfig(quantization="int8_dynamic", intra_op_num_threads=1)))
        return variants

    def precision_fallback(self) -> ONNXRuntimeBackend | None:
        """The same configuration without quantization, for an INT8 model the fidelity check rejected."""
        if self._config.quantization is None:
            return None
        return ONNXRuntimeBackend(dataclasses.replace(self._config, quantization=None))

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
                    model = quantize_int8_dynamic(exported, model, cache_dir)
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
            self._session = _Session(path, self._config, self._graph_spec)
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
