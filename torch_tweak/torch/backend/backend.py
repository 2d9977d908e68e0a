"""The Backend contract: state machine and the methods every backend implements (configuration:
:mod:`.backend_config`, re-exported here).

State machine::

    INIT ──build()──▶ ACTIVE ◀──activate()── INACTIVE
                        │ ▲                     ▲
                        │ └─────activate()──────┤
                        └──────deactivate()─────┘
    from_dict() ──▶ CHECKPOINT_LOADED ──deploy(device)──▶ DEPLOYED
                        └──activate()──▶ ACTIVE

``infer`` works in ACTIVE and DEPLOYED only. A custom backend subclasses :class:`Backend` and implements
``_build``, ``_activate``, ``_deactivate``, ``_deploy``, ``_infer``, ``to_dict`` and ``from_dict``
(``key`` and ``describe`` derive from the backend's config by default).
"""

from __future__ import annotations

import enum
import gc
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from torch_tweak.errors import BackendStateError, UnsupportedDeviceError
from torch_tweak.torch._device import normalize_device_string
from torch_tweak.torch.backend.backend_config import BackendConfig
from torch_tweak.torch.module.serving import note_state_change
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample
from torch_tweak.utils.permissions import secure_mkdir
from torch_tweak.utils.trace import annotate

__all__ = ["QUANTIZED_PRECISIONS", "Backend", "BackendConfig", "BackendState", "Sample"]

#: Executed precisions that are quantized (see :attr:`Backend.quantized`).
QUANTIZED_PRECISIONS = frozenset({"int8", "int4", "fp8"})


class BackendState(enum.Enum):
    """Lifecycle states of a backend."""

    INIT = "init"
    ACTIVE = "active"
    INACTIVE = "inactive"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    DEPLOYED = "deployed"


class Backend(ABC):
    """A way to run one graph of a module: built from the module, then asked to infer.

    Class attributes:
        requires_original_module: True if inference needs the wrapped module's own weights in memory.
        runtime: the runtime whose threads run inference (``torch``, ``openvino``).
    """

    STATE_TYPE: ClassVar[str] = "type"
    STATE_CONFIG: ClassVar[str] = "config"
    STATE_DEVICE: ClassVar[str] = "device"
    STATE_GRAPH_SPEC: ClassVar[str] = "graph_spec"
    STATE_OUTPUT_OBJECT: ClassVar[str] = "output_object"

    _devices: ClassVar[tuple[str, ...]] = ("cpu", "xpu")
    requires_original_module: ClassVar[bool] = False
    #: True if the artifacts are native code that runs as soon as they are loaded (AOTInductor packages hold a
    #: shared object): checkpoints carrying them load only with ``trust_native_code=True`` or a valid signature.
    native_code: ClassVar[bool] = False
    #: Keys of :meth:`to_dict` whose values are artifact paths (``pathlib.Path``). A checkpoint stores them as
    #: archive members and refuses a manifest in which one of them is anything else (e.g. a path on disk).
    artifact_keys: ClassVar[tuple[str, ...]] = ()
    #: Keys of ``artifact_keys`` whose artifacts are native code the backend can do without (the Inductor and
    #: TorchAO warm-load packages: without them it compiles). ``tt.load`` extracts and passes them to
    #: ``from_dict`` only when native code is trusted; otherwise their values are None.
    optional_native_keys: ClassVar[tuple[str, ...]] = ()
    #: The config class whose ``from_dict`` reads ``to_dict()["config"]`` (lets ``verify`` check it unloaded).
    config_class: ClassVar[type[BackendConfig] | None] = None
    #: The runtime whose threads run inference. Calls alternating between runtimes slow each other
    #: (their thread pools compete for the cores), so strategies combine backends of different runtimes
    #: only after measuring them on mixed calls (``tune_strategy/mixed_routes.py``).
    runtime: ClassVar[str] = "torch"
    #: True if building again with the same module, graph and config reuses what the earlier build left (an
    #: OpenVINO IR, an ONNX model) or costs nothing (eager), rather than compiling again. A candidate measured in a
    #: worker is built again in the tuning process to serve; strategies route a batch-size range to one that
    #: compiles again only for a gain larger than measurement noise (``tune_strategy/routing.py``).
    rebuilds_from_files: ClassVar[bool] = False

    def __init__(self) -> None:
        self.state = BackendState.INIT
        self._device: torch.device | None = None
        self._logger = logging.getLogger(self.__class__.__module__)

    @property
    def state(self) -> BackendState:
        """The backend's place in the state machine."""
        return self._state

    @state.setter
    def state(self, value: BackendState) -> None:
        self._state = value
        note_state_change()  # tuned modules make their serving functions again (module/serving.py)

    # properties -------------------------------------------------------------------------------

    def compiles_ahead(self) -> bool:
        """True if a build compiles for tens of seconds into an on-disk cache another process's same build reuses
        (Inductor's) and times nothing: a process executor builds it ahead in a background worker (``ahead.py``)."""
        return False

    def reactivates_quickly(self) -> bool:
        """True if :meth:`activate` after :meth:`deactivate` loads the artifact from its files in about a second: a
        waiting candidate is then deactivated, not kept in memory. Default: :attr:`rebuilds_from_files`."""
        return type(self).rebuilds_from_files

    def outputs_key(self) -> str | None:
        """A key shared by the configurations of this backend that compute the same outputs from the same artifact
        and differ only in how calls are scheduled (:attr:`BackendConfig.scheduling_settings`, e.g. OpenVINO's
        performance hint); None when it has no such settings. A strategy judges the first of them on every recorded
        call and the others on a confirming call (:meth:`TuneStrategy.try_backend`)."""
        config = getattr(self, "_config", None)
        key = config.outputs_key() if isinstance(config, BackendConfig) else None
        return f"{self.__class__.__name__}_{key}" if key is not None else None

    def int8_layer_calls(self, layer: nn.Linear, activation: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any]] | None:
        """Two calls of ``layer`` on ``activation`` as this configuration would run it, in float and quantized as its
        build quantizes the module, which a strategy times against each other to skip a quantized candidate that
        cannot be faster here (``tune_strategy/stand_ins.py``); None (the default): no such probe."""
        return None

    @property
    def name(self) -> str:
        """Name of a backend."""
        return self.__class__.__name__

    @property
    def device(self) -> torch.device | None:
        """The device of the backend."""
        return self._device

    @property
    def is_active(self) -> bool:
        """True if the backend is active (ready for inference)."""
        return self.state in (BackendState.ACTIVE, BackendState.DEPLOYED)

    @property
    def executed_precision(self) -> str:
        """The numeric precision inference actually runs in (``fp32``, ``bf16``, ``fp16``, ``int8``...)."""
        return "fp32"

    @property
    def quantized(self) -> bool:
        """True when the backend computes with quantized weights or activations, known before it is built (by default:
        its :attr:`executed_precision` is in :data:`QUANTIZED_PRECISIONS`; a backend whose precision is known only
        once built reads its config). Tuning then records more calls: the check sees inputs calibration did not."""
        return self.executed_precision in QUANTIZED_PRECISIONS

    @property
    def needs_calibration(self) -> bool:
        """True when ``build`` calibrates on the ``data`` it receives (static quantization): strategies then pass
        the calibration share of the recorded calls, and judge the backend on calls it was not calibrated on."""
        return False

    def precision_fallback(self) -> Backend | None:
        """An unbuilt copy that computes in higher precision, for a strategy to try when this backend's
        outputs fail the fidelity check at reduced precision; None when there is no such variant."""
        return None

    def every_core_twin(self) -> Backend | None:
        """An unbuilt copy on the runtime's default threads when this configuration limits them, else None."""
        return None

    # state machine ----------------------------------------------------------------------------

    def build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], device: torch.device,
              cache_dir: Path) -> Backend:
        """Build the model with the given arguments.

        Building a backend should be idempotent i.e. do not cause side effects. A model is not necessarily pure
        functional and can have an internal state (like kv cache for LLMs). That is why build can call a sample of
        inputs at most once so that subsequent calls have exact same state as the first call for the given sample.

        After building, the backend should be activated.
        """
        if self.state == BackendState.INIT:
            try:
                self._assert_device(device)
                self._set_device(device)
                cache_dir = secure_mkdir(cache_dir)
                config = getattr(self, "_config", None)
                if isinstance(config, BackendConfig):
                    config.to_json(cache_dir / "config.json")
                ready_backend = self._build(module, graph_spec, data, cache_dir)
                self.state = BackendState.ACTIVE
                return ready_backend
            except Exception as e:
                self._logger.warning("Failed to build backend(%s): %s", self.__class__.__name__, e)
                self._logger.debug("Build failure of %s", self.__class__.__name__, exc_info=True)
                raise e
        else:
            raise BackendStateError(f"Backend {self.name} build should be called only once")

    @annotate(domain="Torch Tweak")
    def activate(self) -> None:
        """Activates backend: after it, the backend is ready to do inference."""
        if self.state == BackendState.INIT:
            raise BackendStateError(f"Cannot activate backend {self.name}, backend should be built first")
        if self.state == BackendState.DEPLOYED:
            raise BackendStateError(f"Cannot activate backend {self.name}, backend is already deployed")

        if self.state == BackendState.INACTIVE or self.state == BackendState.CHECKPOINT_LOADED:
            self._activate()
            self.state = BackendState.ACTIVE

    def deactivate(self) -> None:
        """Deactivates backend: after it, the backend cannot be used to do inference."""
        if self.state == BackendState.INIT:
            raise BackendStateError(f"Cannot deactivate backend {self.name}, backend should be built first")
        if self.state == BackendState.DEPLOYED:
            raise BackendStateError(f"Cannot deactivate backend {self.name}, backend is already deployed")
        if self.state == BackendState.CHECKPOINT_LOADED:
            raise BackendStateError(f"Cannot deactivate backend {self.name}, backend has already been deployed")

        if self.state == BackendState.ACTIVE:
            self._deactivate()
            self._clean_memory()
            self.state = BackendState.INACTIVE

    def release(self) -> None:
        """Deactivate if this backend was built in this process and is active; otherwise do nothing (a backend
        loaded from a checkpoint stays deployed: the contract has no way back from DEPLOYED)."""
        if self.state is BackendState.ACTIVE:
            self.deactivate()

    def ensure_active(self) -> None:
        """Activate after :meth:`deactivate` or after loading; do nothing when the backend already serves."""
        if self.state in (BackendState.INACTIVE, BackendState.CHECKPOINT_LOADED):
            self.activate()

    def deploy(self, device: torch.device | str | None) -> None:
        """Deploys the backend.

        After deploying, the backend is ready to do inference. Backend cannot be deactivated anymore.

        Args:
            device: The device to deploy the backend on (None keeps the device stored in the checkpoint).
        """
        if self.state != BackendState.CHECKPOINT_LOADED:
            raise BackendStateError(f"Cannot deploy backend {self.name}, backend should be loaded from a checkpoint")

        self._set_device(device)
        self._deploy()
        self.state = BackendState.DEPLOYED

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        """Run inference with the module's call arguments; returns what the module returns."""
        if self.state != BackendState.ACTIVE and self.state != BackendState.DEPLOYED:
            raise BackendStateError(f"Cannot run inference, backend {self.name} should be activated first")

        return self._infer(*args, **kwargs)

    def serving(self) -> Callable[..., Any]:
        """A function that answers calls as :meth:`infer` does for as long as this backend keeps its state, with the
        checks ``infer`` repeats on every call done once now (``module/serving.py`` says why). Outside ACTIVE and
        DEPLOYED it is :meth:`infer` itself, which raises :class:`BackendStateError`."""
        return self._serving() if self.is_active else self.infer

    def _serving(self) -> Callable[..., Any]:
        """The serving function of an active backend: ``_infer`` unless a backend has a shorter path."""
        return self._infer

    def checked_serving(self, array_ok: Callable[[Any], bool], refused: Callable[..., Any],
                        other: Callable[..., Any]) -> Callable[..., Any] | None:
        """For the non-finite guard: a serving function that gives a one-tensor call's numpy view to ``array_ok``, hands
        a refused call to ``refused(args, kwargs)``, any other to ``other``; None (default): no view taken anyway."""
        return None

    # description and serialization ------------------------------------------------------------

    @classmethod
    def default_variants(cls) -> list[Backend]:
        """Unbuilt instances a strategy tries when it is given no candidates (by default, the default config)."""
        return [cls()]

    def components(self) -> list[Backend]:
        """This backend and the backends it delegates to (a router's routes), for checks that need all."""
        return [self]

    def release_scratch(self) -> None:
        """Free what the runtime keeps between calls for the largest inputs it has seen (activation buffers; the next
        call allocates again), so that the tuning process does not keep every checked size's buffers of every
        candidate that serves. By default there is nothing to free."""
        return None

    def unsafe_settings(self) -> list[str]:
        """Settings of it and its components a checkpoint must not carry (:meth:`BackendConfig.unsafe_settings`)."""
        found: list[str] = []
        for backend in self.components():
            config = getattr(backend, "_config", None)
            if isinstance(config, BackendConfig):
                found.extend(config.unsafe_settings())
        return found

    def key(self) -> str:
        """Returns the key of the backend: class name and a stable hash of the config's JSON."""
        config = getattr(self, "_config", None)
        if config is None:
            return self.__class__.__name__
        return f"{self.__class__.__name__}_{config.key()}"

    def describe(self) -> str:
        """Returns the description of the backend, e.g. ``OpenVINOBackend(performance_hint=THROUGHPUT)``."""
        config = getattr(self, "_config", None)
        return f"{self.__class__.__name__}({config.describe() if config is not None else ''})"

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """Returns the state_dict of the backend."""

    @classmethod
    @abstractmethod
    def from_dict(cls, module: nn.Module | None, state_dict: dict[str, Any]) -> Backend:
        """Creates a backend from a state_dict, in state CHECKPOINT_LOADED."""

    def _common_state(self) -> dict[str, Any]:
        """``type``, ``config``, ``graph_spec`` and ``device`` of a built backend, for :meth:`to_dict`."""
        graph_spec = getattr(self, "_graph_spec", None)
        config = getattr(self, "_config", None)
        if graph_spec is None or config is None:
            raise RuntimeError("Backend has not been properly initialized. Please call build() first.")
        return {
            self.STATE_TYPE: self.__class__.__name__,
            self.STATE_CONFIG: config.to_dict(),
            self.STATE_GRAPH_SPEC: graph_spec.to_dict(),
            self.STATE_DEVICE: str(self._device) if self._device is not None else None,
        }

    @classmethod
    def _from_common_state(
        cls, state_dict: dict[str, Any], config_class: type[BackendConfig], module: nn.Module | None = None,
        module_needed_because: str | None = None,
    ) -> Any:
        """Check ``type`` (and ``module`` when needed), then create the backend with its config, graph spec and
        device, in state CHECKPOINT_LOADED; the caller restores what is specific to it."""
        if state_dict.get(cls.STATE_TYPE) != cls.__name__:
            raise ValueError(f"Invalid state_dict type: {state_dict.get(cls.STATE_TYPE)}")
        if module_needed_because is not None and module is None:
            raise ValueError(f"{cls.__name__}.from_dict needs the original module: {module_needed_because}.")
        backend = cls(config=config_class.from_dict(state_dict[cls.STATE_CONFIG]))  # type: ignore[call-arg]
        backend._graph_spec = GraphSpec.from_dict(state_dict[cls.STATE_GRAPH_SPEC])
        backend._set_device(state_dict.get(cls.STATE_DEVICE))
        backend.state = BackendState.CHECKPOINT_LOADED
        return backend

    # implementation hooks ---------------------------------------------------------------------

    @abstractmethod
    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        """Build for ``self.device``; return ``self`` ready for inference."""

    @abstractmethod
    def _activate(self) -> None:
        """Make a built or loaded backend ready for inference."""

    @abstractmethod
    def _deactivate(self) -> None:
        """Release what inference needs; :meth:`_activate` must be able to restore it."""

    @abstractmethod
    def _deploy(self) -> None:
        """Make a backend loaded from a checkpoint ready for inference on ``self.device``."""

    @abstractmethod
    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        """Run one call."""

    # helpers ------------------------------------------------------------------------------------

    def _assert_device(self, device: torch.device | str) -> None:
        device_type = torch.device(normalize_device_string(device)).type
        if device_type not in self._devices:
            raise UnsupportedDeviceError(f"Backend {self.name} does not support device {str(device)!r}; supported "
                                         f"device types: {list(self._devices)}.")

    def _set_device(self, device: torch.device | str | None) -> None:
        if device is None:
            return
        self._device = torch.device(normalize_device_string(device))

    def _clean_memory(self) -> None:
        """Free memory after deactivation. Never resets compiler state other backends rely on."""
        gc.collect()
        if self._device is not None and self._device.type == "xpu":
            torch.xpu.empty_cache()
