"""OpenVINO: the graph exported (or traced), converted to an IR and compiled for an Intel CPU or GPU."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from torch_tweak.errors import (
    CheckpointError,
    ConfigError,
    ConversionError,
    UnsupportedDeviceError,
)
from torch_tweak.torch.backend.backend import Backend, BackendConfig, BackendState
from torch_tweak.torch.backend.openvino.converter import (
    OV_MODEL_BIN_NAME,
    OV_MODEL_XML_NAME,
    convert,
    import_openvino,
)
from torch_tweak.torch.backend.openvino.layer_probe import int8_layer_pair
from torch_tweak.torch.backend.openvino.quantize import (
    INT8,
    INT8_WEIGHTS,
    QUANTIZATION_MODES,
    calibration_digest,
    import_nncf,
    nncf_available,
    quantize_model,
)
from torch_tweak.torch.backend.openvino.runner import Runner
from torch_tweak.torch.cache import cache_folder
from torch_tweak.torch.cache_limit import OPENVINO_BLOBS
from torch_tweak.torch.environment import usable_cores
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample
from torch_tweak.torch.module.tree_json import spec_to_json
from torch_tweak.utils.permissions import secure_mkdir
from torch_tweak.utils.validate import check_bool, check_choice, check_int

PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")
_PRECISIONS = {"f32": "f32", "fp32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16",
               "f16": "f16", "fp16": "f16", "float16": "f16"}
_REPORTED = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}
IR_DIR_NAME = "openvino"
#: Config fields applied when compiling an IR, not when converting it.
_COMPILE_SETTINGS = ("performance_hint", "inference_precision", "num_threads")
logger = logging.getLogger(__name__)


@dataclass
class OpenVINOBackendConfig(BackendConfig):
    """Configuration for OpenVINO backend.

    Attributes:
        use_dynamo: Use torch.export (True) or legacy trace conversion (False) in OVC.
        performance_hint: OpenVINO compile hint (LATENCY, THROUGHPUT, CUMULATIVE_THROUGHPUT).
        inference_precision: precision OpenVINO computes in: None (the device default, bf16 on CPUs with
            AMX/avx512_bf16), ``"f32"``, ``"bf16"`` or ``"f16"``.
        quantization: None (the converted float model), ``"int8"`` (weights and activations, calibrated with
            NNCF on the graph's recorded samples) or ``"int8_weights"`` (int8 weights only, NNCF weight
            compression, LATENCY hint only, activations stay in float: run-time activation quantization is
            turned off); see :mod:`~torch_tweak.torch.backend.openvino.quantize`. Building
            needs ``nncf``; loading a checkpoint does not. Other operations compute in ``inference_precision``.
        num_threads: threads the CPU plugin runs the model on (``INFERENCE_NUM_THREADS``); None leaves it to the
            plugin (every core under LATENCY). CPU only: on ``xpu`` such a configuration fails to build.
    """

    #: Hints and thread counts compile the same IR, in the same precision, into other streams and threads.
    scheduling_settings: ClassVar[tuple[str, ...]] = ("performance_hint", "num_threads")

    use_dynamo: bool = True
    performance_hint: str = "LATENCY"
    inference_precision: str | None = None
    quantization: str | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_bool(self.use_dynamo, f"{owner}.use_dynamo")
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
        check_choice(self.quantization, f"{owner}.quantization", QUANTIZATION_MODES, allow_none=True)
        if self.quantization == INT8_WEIGHTS and hint != "LATENCY":
            raise ConfigError(
                f"{owner}.quantization='int8_weights' needs performance_hint='LATENCY', got {hint!r}: OpenVINO "
                "2026.4's CPU plugin computes int8-compressed weights wrongly, at random per compilation, when it runs "
                "several streams, so a model that passed the fidelity check could load broken. Use "
                "performance_hint='LATENCY', or quantization='int8' (activations too), which streams run correctly."
            )
        check_int(self.num_threads, f"{owner}.num_threads", minimum=1, allow_none=True)

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


class OpenVINOBackend(Backend):
    """Runs inference via OpenVINO compiled models (Intel CPU/GPU)."""

    STATE_OV_MODEL_DIR = "ov_model_dir"
    runtime = "openvino"
    rebuilds_from_files = True  # the saved IR is reused (fingerprint.json)
    artifact_keys = (STATE_OV_MODEL_DIR,)
    config_class = OpenVINOBackendConfig

    def __init__(self, config: OpenVINOBackendConfig | None = None) -> None:
        """Initializes backend."""
        super().__init__()
        self._config = config or OpenVINOBackendConfig()
        self._ov_model_dir: Path | None = None
        self._ov_model_xml: Path | None = None
        self._graph_spec: GraphSpec | None = None
        self._output_object: Any = None
        self._compiled_model: Any = None
        self._runner: Runner | None = None
        self._precision: str | None = None
        self._built_here = False  # the IR is this process's build (its blobs beside it), not a checkpoint's

    @property
    def executed_precision(self) -> str:
        """The precision the compiled model runs in, read back from OpenVINO (``fp32``, ``bf16``, ``fp16``);
        ``int8`` for a quantized model (its other operations run in the device's or the configured precision)."""
        if self._config.quantization is not None:
            return "int8"
        if self._precision is not None:
            return self._precision
        if self._config.inference_precision is not None:
            return _REPORTED[self._config.inference_precision]
        return _precision_name(ov_core().get_property(ov_device_name(self._device), "INFERENCE_PRECISION_HINT"))

    @property
    def quantized(self) -> bool:
        """True for ``quantization="int8"`` and ``"int8_weights"`` (read from the config: the float precision is
        known only once compiled)."""
        return self._config.quantization is not None

    @property
    def needs_calibration(self) -> bool:
        """True for ``quantization="int8"``: NNCF calibrates activation scales on the ``data`` given to ``build``."""
        return self._config.quantization == INT8

    @classmethod
    def default_variants(cls) -> list[Backend]:
        """LATENCY and THROUGHPUT hints (one request using every core; parallel streams for large batches) in the
        device's precision, then, when NNCF is installed, both with int8 quantization. On a 2-core Xeon with AMX,
        int8 LATENCY beat bf16 at batch 1 (ResNet-50 1.9x, BERT-base 1.2x) and int8 THROUGHPUT at batch 32 (1.6x,
        1.4x); weight-only int8 was slower than bf16, so it is not a default. The int8 candidates start from the
        float candidates' IR and share one calibrated IR, so NNCF runs once per graph; the fidelity check decides
        per model whether int8 is faithful enough.

        Where this process may use more than one core, LATENCY on one thread (``num_threads=1``) too: on a small
        graph a call is mostly the threads' hand-offs between operations. An MLP 256-512-256 on 2 cores of a Sapphire
        Rapids Xeon (bf16) took 33 µs per call at batch 32 on one thread against 46 µs on two (26 against 31 µs at
        batch 1, 66 against 75 µs at batch 128); a 2-layer BERT of width 128 at sequence 64, 0.30 against 0.36 ms at
        batch 1 but 1.35x longer at batch 8; the demo's small CNN in int8, 51 against 67 µs at batch 1 and level at
        batch 4. So int8 LATENCY gets a one-thread twin too. Measurement decides, and where every-core calls take
        long the rule in :mod:`~torch_tweak.torch.tune_strategy.stand_ins` skips them."""
        hints, several = ("LATENCY", "THROUGHPUT"), (usable_cores() or 1) > 1
        variants: list[Backend] = [cls(OpenVINOBackendConfig(performance_hint=hint)) for hint in hints]
        variants += [cls(OpenVINOBackendConfig(num_threads=1))] if several else []
        if nncf_available():
            variants += [cls(OpenVINOBackendConfig(performance_hint=hint, quantization=INT8)) for hint in hints]
            variants += [cls(OpenVINOBackendConfig(quantization=INT8, num_threads=1))] if several else []
        return variants

    def every_core_twin(self) -> OpenVINOBackend | None:
        """The same configuration with ``num_threads=None`` (the plugin's threads) when this one limits them."""
        if self._config.num_threads is None:
            return None
        return OpenVINOBackend(dataclasses.replace(self._config, num_threads=None))

    def precision_fallback(self) -> OpenVINOBackend | None:
        """The same configuration with ``inference_precision="f32"`` when the precision was left to the device
        (bf16 on CPUs with AMX/avx512_bf16), else None. None for a quantized configuration: its error comes from
        int8, and the float configurations are candidates of their own."""
        if self._config.inference_precision is not None or self._config.quantization is not None:
            return None
        return OpenVINOBackend(dataclasses.replace(self._config, inference_precision="f32"))

    def int8_layer_calls(self, layer: nn.Linear, activation: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any]] | None:
        """For ``quantization="int8"``: ``layer`` on ``activation`` compiled by OpenVINO in this configuration's
        precision, and its NNCF int8 copy (:mod:`.layer_probe`); None for the other configurations."""
        if self._config.quantization != INT8:
            return None
        config = {"PERFORMANCE_HINT": "LATENCY"}
        if self._config.inference_precision is not None:
            config["INFERENCE_PRECISION_HINT"] = self._config.inference_precision
        return int8_layer_pair(ov_core(), layer, activation, ov_device_name(self._device), config)

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        import_openvino()
        self._check_device_available()
        self._graph_spec = graph_spec
        self._output_object = spec_to_json(graph_spec.output_structure)
        self._ov_model_dir = cache_dir / IR_DIR_NAME
        # what the IR depends on: not the compile-time settings, so LATENCY and THROUGHPUT candidates share one IR
        ir_settings = {k: v for k, v in self._config.to_dict().items() if k not in _COMPILE_SETTINGS}
        transform, mode, base = None, self._config.quantization, None
        if mode is not None:
            base = {**ir_settings, "quantization": None}  # the float IR quantization starts from
            ir_settings["nncf"] = import_nncf().__version__  # before converting: fail fast without NNCF
            ir_settings["target_device"] = target = ov_device_name(self._device)
            if mode == INT8:  # other calibration samples, other scales: never reuse an IR calibrated on others
                ir_settings["calibration"] = calibration_digest(graph_spec, data)
            transform = functools.partial(quantize_model, mode=mode, graph_spec=graph_spec, data=data,
                                          target_device=target)
        siblings = cache_dir.parent.glob(f"{type(self).__name__}_*")  # the other candidates of this graph
        shared = sorted(p / IR_DIR_NAME for p in siblings if p != cache_dir)
        self._ov_model_xml = convert(module, graph_spec, data, self._config.use_dynamo, self._ov_model_dir,
                                     ir_settings, transform, shared, base)
        self._built_here = True
        self._compile(building=True)
        return self

    def _activate(self) -> None:
        if self._runner is None:
            self._compile(building=False)

    def _deactivate(self) -> None:
        self._runner = None
        self._compiled_model = None

    def release_scratch(self) -> None:
        """``CompiledModel.release_memory()``: its intermediate buffers (on a ResNet-50, 320 MB of 985 MB after calls at
        batch 1 and 32 of a LATENCY and a THROUGHPUT model; the next call at a size allocates again)."""
        if self._compiled_model is not None and hasattr(self._compiled_model, "release_memory"):
            self._compiled_model.release_memory()

    def _deploy(self) -> None:
        self._deactivate()
        self._compile(building=False)

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        return self._runner(args, kwargs)  # type: ignore[misc]

    def _serving(self) -> Callable[..., Any]:
        return self._runner.serving()  # type: ignore[union-attr]

    def checked_serving(self, array_ok: Callable[[Any], bool], refused: Callable[..., Any],
                        other: Callable[..., Any]) -> Callable[..., Any] | None:
        """The runner's short path with ``array_ok`` asked first (see :meth:`Backend.checked_serving`)."""
        if not self.is_active or self._runner is None:
            return None
        return self._runner.checked_serving(array_ok, refused, other)

    def _check_device_available(self) -> str:
        name = ov_device_name(self._device)
        if self._config.num_threads is not None and name != "CPU":
            raise UnsupportedDeviceError(
                f"{self.describe()} sets the threads of OpenVINO's CPU plugin, so it runs on cpu only, not on "
                f"{self._device}; leave num_threads at None for xpu devices."
            )
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
        if self._config.num_threads is not None:
            config["INFERENCE_NUM_THREADS"] = self._config.num_threads
        if self._config.quantization == "int8_weights":
            # On CPUs with VNNI/AMX the plugin otherwise quantizes the activations of compressed-weight layers to
            # int8 at run time (groups of 32), which one outlier channel ruins: weights-only must mean weights only.
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = "0"
        cache = _model_cache_dir(xml, self._built_here)
        if cache is not None:
            config["CACHE_DIR"] = str(cache)
        try:
            # compiled from the read model, not its path: OpenVINO keys a path's cached blob by the path, and each
            # tt.load extracts to a new folder, so every load would miss and add a model-sized blob to the cache
            core = ov_core()
            compiled = core.compile_model(core.read_model(str(xml)), device, config)
            self._runner = Runner(compiled, graph_spec, self._device, self._config.performance_hint)
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


def _model_cache_dir(xml: Path, own_build: bool) -> Path | None:
    """Where OpenVINO keeps compiled blobs: beside the IR folder of this process's build (also when it is activated
    again after a strategy set it aside), and in torch_tweak's own cache for an IR from a checkpoint, never inside
    the extracted checkpoint (whose members a stranger chose). None when there is no writable place (compiling then
    takes longer)."""
    try:
        return secure_mkdir(xml.parent.parent / OPENVINO_BLOBS) if own_build else cache_folder(OPENVINO_BLOBS)
    except (ConfigError, OSError) as exc:
        logger.debug("No OpenVINO model cache for %s: %s", xml, exc)
        return None


def _check_ir_files(ir_dir: Path) -> None:
    missing = [name for name in (OV_MODEL_XML_NAME, OV_MODEL_BIN_NAME) if not (ir_dir / name).is_file()]
    if missing:
        raise CheckpointError(
            f"The OpenVINO IR folder {ir_dir} lacks {', '.join(missing)}; the checkpoint is incomplete or the "
            "cache folder was cleaned. Tune the module again or restore the files."
        )
