"""OpenVINO: the graph exported (or traced), converted to an IR and compiled for an Intel CPU or GPU."""

from __future__ import annotations

import functools
import os
import queue
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from torch_tweak.errors import (
    CheckpointError,
    ConfigError,
    ConversionError,
    UnsupportedDeviceError,
    UnsupportedInputError,
)
from torch_tweak.torch.backend.backend import Backend, BackendConfig, BackendState
from torch_tweak.torch.backend.openvino.converter import (
    OV_MODEL_BIN_NAME,
    OV_MODEL_XML_NAME,
    convert,
    import_openvino,
)
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import TENSOR, Sample, dtype_name, flatten_sample, unflatten
from torch_tweak.torch.module.tree_json import spec_to_json
from torch_tweak.utils.permissions import secure_mkdir

PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")
_PRECISIONS = {"f32": "f32", "fp32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16",
               "f16": "f16", "fp16": "f16", "float16": "f16"}
_REPORTED = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}
MODEL_CACHE_DIR_NAME = "openvino_model_cache"
COPY_INPUT_MAX_BYTES = 128 * 1024


@dataclass
class OpenVINOBackendConfig(BackendConfig):
    """Configuration for OpenVINO backend.

    Attributes:
        use_dynamo: Use torch.export (True) or legacy trace conversion (False) in OVC.
        performance_hint: OpenVINO compile hint (LATENCY, THROUGHPUT, CUMULATIVE_THROUGHPUT).
        inference_precision: precision OpenVINO computes in: None (the device default, bf16 on CPUs with
            AMX/avx512_bf16), ``"f32"``, ``"bf16"`` or ``"f16"``.
    """

    use_dynamo: bool = True
    performance_hint: str = "LATENCY"
    inference_precision: str | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if not isinstance(self.use_dynamo, bool):
            raise ConfigError(f"{owner}.use_dynamo must be a bool, got {self.use_dynamo!r}.")
        hint = self.performance_hint.upper() if isinstance(self.performance_hint, str) else None
        if hint not in PERFORMANCE_HINTS:
            raise ConfigError(f"{owner}.performance_hint must be one of {list(PERFORMANCE_HINTS)}, got "
                              f"{self.performance_hint!r}.")
        self.performance_hint = hint
        if self.inference_precision is not None:
            key = self.inference_precision.lower() if isinstance(self.inference_precision, str) else None
            if key not in _PRECISIONS:
                raise ConfigError(f"{owner}.inference_precision must be None (device default), 'f32', 'bf16' or "
                                  f"'f16', got {self.inference_precision!r}.")
            self.inference_precision = _PRECISIONS[key]

    @classmethod
    def from_dict(cls, state_dict: dict[str, Any]) -> OpenVINOBackendConfig:
        """Convert dict to OpenVINOBackendConfig."""
        return super().from_dict(state_dict)  # type: ignore[return-value]


@functools.cache
def ov_core() -> Any:
    """The process-wide ``ov.Core`` (created on first use)."""
    return import_openvino().Core()


def _precision_name(value: Any) -> str:
    """An OpenVINO precision (``ov.Type`` or string) as reported by :attr:`Backend.executed_precision`."""
    name = value.to_string() if hasattr(value, "to_string") else str(value)
    return _REPORTED.get(name, name)


def ov_device_name(device: torch.device | None) -> str:
    """``cpu`` → ``CPU``, ``xpu:N`` → ``GPU.N``."""
    if device is None or device.type == "cpu":
        return "CPU"
    return f"GPU.{device.index or 0}"


class _Runner:
    """A compiled model with everything a call needs precomputed, and a pool of reusable infer requests.

    Inputs up to :data:`COPY_INPUT_MAX_BYTES` are copied into tensors bound once to a request (reshaped in
    place); larger ones are shared with OpenVINO without a copy. Binding a tensor costs more than copying a
    small input (5-7 µs per call at batch 1), and ``InferRequest.infer(inputs)`` adds Python wrapping that
    ``infer()`` on bound tensors avoids (benchmarks/openvino_overhead.py). Outputs are copied out before the
    request returns to the pool, as the next call on it overwrites its buffers. Under the THROUGHPUT hints a
    batch is split across parallel requests (one per stream), which a single request cannot use.
    """

    def __init__(self, compiled: Any, graph_spec: GraphSpec, device: torch.device | None, hint: str) -> None:
        self._compiled, self._spec = compiled, graph_spec
        self._structure, self._out_structure = graph_spec.input_structure, graph_spec.output_structure
        self._dtypes = tuple(s.torch_dtype for s in graph_spec.inputs)
        self._n = len(graph_spec.inputs)
        self._positional = self._structure == ("tuple", (("tuple", (TENSOR,) * self._n), ("dict", (), ())))
        produced = [torch.from_numpy(np.empty(0, p.get_element_type().to_dtype())).dtype for p in compiled.outputs]
        self._casts = [(i, s.torch_dtype) for i, (d, s) in enumerate(zip(produced, graph_spec.outputs, strict=True))
                       if d != s.torch_dtype]
        self._single = self._out_structure == TENSOR
        self._device = device if device is not None and device.type != "cpu" else None
        self._out_range = range(len(compiled.outputs))
        self._ov_tensor = import_openvino().Tensor
        self._pool: queue.SimpleQueue[tuple[Any, list[Any], list[bool]]] = queue.SimpleQueue()
        self._pool.put(self._new_request())
        one_axis = all(len(s.batch_multipliers) == 1 for s in (*graph_spec.inputs, *graph_spec.outputs))
        streams = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")) if hint != "LATENCY" else 1
        self._split = streams if one_axis and graph_spec.has_batch_axis() and streams > 1 else 1
        self._in_axes = [next(iter(s.batch_multipliers.items()), (0, 1)) for s in graph_spec.inputs]
        self._out_axes = [next(iter(s.batch_multipliers), 0) for s in graph_spec.outputs]
        self._min_chunk = max(1, (graph_spec.batch_range() or (1, 1))[0])

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves: Any = args
        if not (self._positional and not kwargs and len(args) == self._n):
            leaves, structure = flatten_sample(args, kwargs)
            if structure != self._structure:
                raise UnsupportedInputError(
                    f"The call does not match graph {self._spec.name!r} this OpenVINO model was built for (other "
                    "arguments, or non-tensor values different from the recorded ones, which are constants of the IR)."
                )
        try:
            arrays = [t.numpy() for t, dt in zip(leaves, self._dtypes, strict=False) if t.dtype is dt]
        except (RuntimeError, TypeError, AttributeError):  # autograd, non-CPU or non-tensor leaves
            arrays = self._slow_feed(leaves)
        if len(arrays) != self._n:
            raise self._input_error(leaves)
        chunks = self._chunks(arrays) if self._split > 1 else None
        try:
            outputs = self._run(arrays) if chunks is None else self._run_split(arrays, chunks)
        except RuntimeError as exc:
            raise self._input_error(leaves) from exc
        for i, dtype in self._casts:
            outputs[i] = outputs[i].to(dtype)
        if self._device is not None:
            outputs = [t.to(self._device) for t in outputs]
        return outputs[0] if self._single else unflatten(self._out_structure, outputs)

    def _acquire(self) -> tuple[Any, list[Any], list[bool]]:
        try:
            return self._pool.get_nowait()
        except queue.Empty:
            return self._new_request()

    def _new_request(self) -> tuple[Any, list[Any], list[bool]]:
        """An infer request, its own input tensors (small inputs are copied into them) and which are bound."""
        own = [self._ov_tensor(p.get_element_type(), list(s.min_shape))
               for p, s in zip(self._compiled.inputs, self._spec.inputs, strict=True)]
        return self._compiled.create_infer_request(), own, [False] * len(own)

    def _fill(self, entry: tuple[Any, list[Any], list[bool]], arrays: list[Any]) -> None:
        request, own, bound = entry
        for i, array in enumerate(arrays):
            if array.nbytes <= COPY_INPUT_MAX_BYTES:
                tensor = own[i]
                tensor.shape = array.shape
                np.copyto(tensor.data, array)
                if not bound[i]:
                    request.set_input_tensor(i, tensor)
                    bound[i] = True
            else:
                request.set_input_tensor(i, self._ov_tensor(np.ascontiguousarray(array), shared_memory=True))
                bound[i] = False

    def _run(self, arrays: list[Any]) -> list[torch.Tensor]:
        entry = self._acquire()
        try:
            self._fill(entry, arrays)
            entry[0].infer()
            return [torch.from_numpy(entry[0].get_output_tensor(i).data.copy()) for i in self._out_range]
        finally:
            self._pool.put(entry)

    def _chunks(self, arrays: list[Any]) -> list[int] | None:
        axis, k = self._in_axes[0]
        batch = arrays[0].shape[axis] // k
        count = min(self._split, batch // self._min_chunk)
        if count < 2:
            return None
        size, extra = divmod(batch, count)
        return [size + (i < extra) for i in range(count)]

    def _run_split(self, arrays: list[Any], chunks: list[int]) -> list[torch.Tensor]:
        """Run batch slices on parallel requests and concatenate the outputs along their batch axes."""
        started: list[tuple[Any, list[Any], list[bool]]] = []
        try:
            start = 0
            for size in chunks:
                entry = self._acquire()
                started.append(entry)
                self._fill(entry, [a[(slice(None),) * axis + (slice(k * start, k * (start + size)),)]
                                   for a, (axis, k) in zip(arrays, self._in_axes, strict=True)])
                entry[0].start_async()
                start += size
            for entry in started:
                entry[0].wait()
            return [torch.cat([torch.from_numpy(e[0].get_output_tensor(i).data) for e in started], self._out_axes[i])
                    for i in self._out_range]
        finally:
            for entry in started:
                try:
                    entry[0].wait()
                finally:
                    self._pool.put(entry)

    def _slow_feed(self, leaves: Any) -> list[Any]:
        feed = []
        for t, dtype in zip(leaves, self._dtypes, strict=False):
            if not isinstance(t, torch.Tensor) or t.dtype is not dtype:
                raise self._input_error(leaves)
            if dtype == torch.bfloat16:
                raise UnsupportedInputError("bfloat16 inputs cannot be passed to OpenVINO through numpy; tune the "
                                            "module with float32 inputs and set inference_precision='bf16'.")
            feed.append(t.detach().cpu().numpy())
        return feed

    def _input_error(self, leaves: Any) -> UnsupportedInputError:
        for t, spec in zip(leaves, self._spec.inputs, strict=False):
            if not isinstance(t, torch.Tensor):
                return UnsupportedInputError(f"{spec.locator}: expected a tensor, got {type(t).__name__}.")
            if dtype_name(t.dtype) != spec.dtype:
                return UnsupportedInputError(
                    f"{spec.locator}: expected dtype {spec.dtype}, got {dtype_name(t.dtype)}; the OpenVINO model was "
                    f"built for {spec.dtype} inputs. Cast the input, or tune with {dtype_name(t.dtype)} inputs."
                )
            if not spec.accepts(tuple(t.shape)):
                return UnsupportedInputError(
                    f"{spec.locator}: shape {list(t.shape)} is outside the tuned range (shape {list(spec.shape)}, "
                    f"min {list(spec.min_shape)}, max {list(spec.max_shape)}). Tune with inputs covering this shape."
                )
        return UnsupportedInputError(f"OpenVINO rejected the inputs of graph {self._spec.name!r}; see the cause.")


class OpenVINOBackend(Backend):
    """Runs inference via OpenVINO compiled models (Intel CPU/GPU)."""

    STATE_OV_MODEL_DIR = "ov_model_dir"

    def __init__(self, config: OpenVINOBackendConfig | None = None) -> None:
        """Initializes backend."""
        super().__init__()
        self._config = config or OpenVINOBackendConfig()
        self._ov_model_dir: Path | None = None
        self._ov_model_xml: Path | None = None
        self._graph_spec: GraphSpec | None = None
        self._output_object: Any = None
        self._compiled_model: Any = None
        self._runner: _Runner | None = None
        self._precision: str | None = None

    @property
    def executed_precision(self) -> str:
        """The precision the compiled model runs in, read back from OpenVINO (``fp32``, ``bf16``, ``fp16``)."""
        if self._precision is not None:
            return self._precision
        if self._config.inference_precision is not None:
            return _REPORTED[self._config.inference_precision]
        return _precision_name(ov_core().get_property(ov_device_name(self._device), "INFERENCE_PRECISION_HINT"))

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        import_openvino()
        self._check_device_available()
        self._graph_spec = graph_spec
        self._output_object = spec_to_json(graph_spec.output_structure)
        self._ov_model_dir = cache_dir / "openvino"
        self._ov_model_xml = convert(module, graph_spec, data, self._config.use_dynamo, self._ov_model_dir,
                                     self._config.to_dict())
        self._compile(building=True)
        return self

    def _activate(self) -> None:
        if self._runner is None:
            self._compile(building=False)

    def _deactivate(self) -> None:
        self._runner = None
        self._compiled_model = None

    def _deploy(self) -> None:
        self._deactivate()
        self._compile(building=False)

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return self._runner(args, kwargs)  # type: ignore[misc]

    def _check_device_available(self) -> str:
        name = ov_device_name(self._device)
        available = ov_core().available_devices
        if name not in available and not (name == "GPU.0" and "GPU" in available):
            raise UnsupportedDeviceError(
                f"OpenVINO device {name} (for torch device {self._device}) is not available; OpenVINO sees "
                f"{available}. Install the Intel GPU driver or use device='cpu'."
            )
        return name

    def _compile(self, building: bool) -> None:
        xml, graph_spec = self._ov_model_xml, self._graph_spec
        if xml is None or graph_spec is None:
            raise RuntimeError("Backend has not been properly initialized. Please call build() first.")
        _check_ir_files(xml.parent)
        device = self._check_device_available()
        config: dict[str, Any] = {"PERFORMANCE_HINT": self._config.performance_hint}
        if self._config.inference_precision is not None:
            config["INFERENCE_PRECISION_HINT"] = self._config.inference_precision
        if os.access(xml.parent.parent, os.W_OK):  # compiled blobs beside the IR folder, not inside the checkpoint
            config["CACHE_DIR"] = str(secure_mkdir(xml.parent.parent / MODEL_CACHE_DIR_NAME))
        try:
            compiled = ov_core().compile_model(str(xml), device, config)
            self._runner = _Runner(compiled, graph_spec, self._device, self._config.performance_hint)
        except Exception as exc:
            if building:
                raise ConversionError(f"OpenVINO could not compile the converted model for {device}: {exc}") from exc
            raise CheckpointError(
                f"Could not load the OpenVINO IR {xml} for {device}: {exc}. The IR is corrupt or incompatible with "
                "this OpenVINO version; tune the module again or restore the checkpoint."
            ) from exc
        self._compiled_model = compiled
        self._precision = _precision_name(compiled.get_property("INFERENCE_PRECISION_HINT"))
        self._logger.debug("Compiled %s for %s with %s; executes in %s.", xml, device, config, self._precision)

    def to_dict(self) -> dict[str, Any]:
        """Returns the state_dict of the backend (the IR folder as a ``Path``, copied by the checkpoint)."""
        if self._ov_model_dir is None or self._graph_spec is None:
            raise RuntimeError("Backend has not been properly initialized. Please call build() first.")
        return {
            self.STATE_TYPE: self.__class__.__name__,
            self.STATE_CONFIG: self._config.to_dict(),
            self.STATE_OV_MODEL_DIR: self._ov_model_dir,
            self.STATE_OUTPUT_OBJECT: self._output_object,
            self.STATE_GRAPH_SPEC: self._graph_spec.to_dict(),
            self.STATE_DEVICE: str(self._device) if self._device is not None else None,
        }

    @classmethod
    def from_dict(cls, module: nn.Module | None, state_dict: dict[str, Any]) -> OpenVINOBackend:
        """Creates a backend from a state_dict (``module`` is not needed: the IR holds the weights)."""
        if not isinstance(state_dict, dict) or state_dict.get(cls.STATE_TYPE) != cls.__name__:
            found = state_dict.get(cls.STATE_TYPE) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"Invalid state_dict type: {found}")
        config = OpenVINOBackendConfig.from_dict(state_dict[cls.STATE_CONFIG])
        backend = cls(config=config)
        if cls.STATE_OV_MODEL_DIR not in state_dict:
            raise ValueError("Checkpoint is missing OpenVINO model path (ov_model_dir).")
        backend._ov_model_dir = Path(state_dict[cls.STATE_OV_MODEL_DIR])
        _check_ir_files(backend._ov_model_dir)
        backend._ov_model_xml = backend._ov_model_dir / OV_MODEL_XML_NAME
        backend._output_object = state_dict.get(cls.STATE_OUTPUT_OBJECT)
        backend._graph_spec = GraphSpec.from_dict(state_dict[cls.STATE_GRAPH_SPEC])
        backend._set_device(state_dict.get(cls.STATE_DEVICE))
        backend.state = BackendState.CHECKPOINT_LOADED
        return backend


def _check_ir_files(ir_dir: Path) -> None:
    missing = [name for name in (OV_MODEL_XML_NAME, OV_MODEL_BIN_NAME) if not (ir_dir / name).is_file()]
    if missing:
        raise CheckpointError(
            f"The OpenVINO IR folder {ir_dir} lacks {', '.join(missing)}; the checkpoint is incomplete or the "
            "cache folder was cleaned. Tune the module again or restore the files."
        )
