"""Global settings, ``tt.config``.

Every ``TORCH_TWEAK_*`` environment variable is read here, once, when the module is imported:

=============================  ==========================================  ====================
variable                       setting                                     default
=============================  ==========================================  ====================
``TORCH_TWEAK_CACHE_DIR``      ``config.cache_dir``                        ``~/.cache/torch_tweak``
``TORCH_TWEAK_DEVICE``         ``config.default_device``                   ``cpu``
``TORCH_TWEAK_STRICT_MODE``    ``config.strict_mode``                      true
``TORCH_TWEAK_PROGRESS``       ``config.progress`` (true/false/auto)       auto (a TTY)
``TORCH_TWEAK_CONSOLE_OUTPUT`` ``config.console_output``                   false
``TORCH_TWEAK_SYSTEM_MONITOR`` ``config.system_monitor``                   false
``TORCH_TWEAK_INSPECT_DEBUG``  ``config.inspect_debug``                    false
=============================  ==========================================  ====================

The last three and the settings ``min_num_samples`` and ``enable_hf_integrations`` exist for code written
for the reference Torch Tweak (``docs/migrating.md``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from torch_tweak.errors import ConfigError
from torch_tweak.utils.validate import check_bool, check_int

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
UNKNOWN_SIGNATURE_POLICIES = ("error", "passthrough")
DEVICES_AFTER_TUNING = ("release", "meta", "cpu")
EXECUTORS = ("process", "inline")  # the names torch_tweak.torch.executor.resolve_executor knows


def _env_bool(name: str, default: bool | None) -> bool | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip().lower() in ("", "auto"):
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off.")


def _default_cache_dir() -> Path:
    raw = os.environ.get("TORCH_TWEAK_CACHE_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "torch_tweak"


@dataclass
class TorchTweakConfig:
    """Process-wide settings; change them through the ``tt.config`` instance.

    Attributes:
        cache_dir: root of build artifacts and build logs (``<cache_dir>/<module>/<graph>/<backend key>``).
        default_device: device used by ``tt.tune`` when ``device`` is None.
        strict_mode: non-tensor argument values take part in graph identity (``scale=1.0`` and
            ``scale=2.0`` are different graphs). With False only the structure and tensor ranks count.
        max_num_samples_stored: recorded input samples (with their eager outputs) kept per graph; they
            feed builds, the fidelity check and profiling, and are never written to disk.
        max_num_calibration_samples: further recorded calls kept per graph when its strategy has a quantized
            candidate or judges by a task metric: written to the tuning work folder (never held in RAM) and
            deleted when tuning ends; three quarters calibrate quantized candidates, the other quarter is held
            out for the fidelity check of every candidate (see :mod:`torch_tweak.torch.module.sample_store`).
            0 records no extra call.
        max_num_batches_after_first_size: batches ``tt.tune`` runs at each batch size after the first of
            ``batch_sizes`` (when its ``max_num_batches_per_batch_size`` is None). The first size runs every
            item; later sizes run the same items again, so one batch shows their shapes, batch axes and eager
            outputs (each batch size, up to ``max_num_samples_stored`` of them, keeps an in-memory sample that
            every candidate is judged on), and more would only repeat the model's eager time: on a ResNet-50,
            64 items at batch sizes 1, 2, 8 and 32 are 256 eager inferences where 106 show the same. None:
            every item at every size.
        device_after_tuning: what happens to a wrapped module's own weights when no chosen backend needs them:
            ``"release"`` frees their memory while every parameter keeps its device, dtype and shape (so
            ``model.device``/``pipe.dtype`` answer as before tuning; using the values raises
            ``ReleasedWeightError``), ``"meta"`` or ``"cpu"`` move them there (``"meta"`` also changes what
            ``model.device`` reports), None keeps them.
        on_unknown_signature: what a tuned module does with inputs that match no tuned graph:
            ``"error"`` raises :class:`SignatureMismatchError`, ``"passthrough"`` runs the original
            module (only possible while its weights are still in memory).
        progress: live progress display during ``tt.tune``; None means "when stderr is a terminal".
        cache_size_limit_gb: after each ``tt.tune`` and ``tt.load`` the least recently used build folders, stored
            results and OpenVINO models compiled at load are deleted until torch_tweak's part of the cache folder is
            at most this size (None: no limit).
        probe_sequence_lengths: before a graph is tuned, an integer input's axis (after the first) that had one
            length in every recorded call (token ids of sentences of one length) gets one more eager call at half
            that length, so that the axis is tuned dynamic and the tuned module serves any length eager serves
            (:mod:`torch_tweak.torch.module.lengths`). False keeps such axes at their recorded length.
        lazy_recording: when ``tt.tune`` runs a ``tt.Module`` directly (its outputs go nowhere), a call whose output
            shapes an earlier run of the same module, weights and code recorded is kept without running it; its eager
            outputs are computed only if a check reads them (:mod:`torch_tweak.torch.module.known_shapes`). Tuning
            the same model again then records in a fraction of its eager time. False runs every call.
        llm_phase_detection: calls of a language model (a ``cache_position`` argument or a KV cache
            passed as ``past_key_values``/``cache``) are split into a prefill and a decode graph.
        console_output: a backend build's output goes to the console as well as to its ``build.log``
            (output written by native code straight to the file descriptors then reaches the console only).
        system_monitor: log the process's peak memory and CPU time after each module is tuned at INFO
            instead of DEBUG.
        inspect_debug: ``tt.inspect`` logs every module it visits and the executed tree at DEBUG.
        min_num_samples: accepted for reference compatibility (at least 1); torch_tweak tunes with the calls
            the dataset produces and does not use it.
        enable_hf_integrations: register Hugging Face container types (static KV caches) and detect LLM
            prefill/decode phases; False turns both off (the same switch as ``llm_phase_detection`` for phases).
        executor: where ``tt.tune`` builds, checks and measures candidates when its ``executor`` argument is None:
            ``"process"`` (a worker process, so a crashing, runaway or hanging candidate becomes a report row) or
            ``"inline"`` (this process, for debugging). Environment variable ``TORCH_TWEAK_EXECUTOR``.
    """

    cache_dir: Path = field(default_factory=_default_cache_dir)
    default_device: str = field(default_factory=lambda: os.environ.get("TORCH_TWEAK_DEVICE", "cpu"))
    strict_mode: bool = field(default_factory=lambda: bool(_env_bool("TORCH_TWEAK_STRICT_MODE", True)))
    max_num_samples_stored: int = 4
    max_num_calibration_samples: int = 128
    max_num_batches_after_first_size: int | None = 1
    device_after_tuning: str | None = "release"
    on_unknown_signature: str = "error"
    progress: bool | None = field(default_factory=lambda: _env_bool("TORCH_TWEAK_PROGRESS", None))
    probe_sequence_lengths: bool = True
    llm_phase_detection: bool = True
    lazy_recording: bool = True
    cache_size_limit_gb: float | None = 20.0
    console_output: bool = field(default_factory=lambda: bool(_env_bool("TORCH_TWEAK_CONSOLE_OUTPUT", False)))
    system_monitor: bool = field(default_factory=lambda: bool(_env_bool("TORCH_TWEAK_SYSTEM_MONITOR", False)))
    inspect_debug: bool = field(default_factory=lambda: bool(_env_bool("TORCH_TWEAK_INSPECT_DEBUG", False)))
    min_num_samples: int = 100
    enable_hf_integrations: bool = True
    executor: str = field(default_factory=lambda: os.environ.get("TORCH_TWEAK_EXECUTOR", "process"))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in {f.name for f in fields(self)}:
            raise ConfigError(f"tt.config has no setting {name!r}; known settings: {sorted(f.name for f in fields(self))}.")
        object.__setattr__(self, name, _validate(name, value))

    def reset(self) -> None:
        """Restore every setting to its default (environment variables are not re-read)."""
        for f in fields(self):
            value = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            setattr(self, f.name, value)


def _validate(name: str, value: Any) -> Any:
    if name == "cache_dir":
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"tt.config.cache_dir must be a path, got {type(value).__name__}.")
        return Path(value).expanduser()
    if name in ("strict_mode", "llm_phase_detection", "console_output", "system_monitor", "inspect_debug",
                "enable_hf_integrations", "probe_sequence_lengths", "lazy_recording"):
        return check_bool(value, f"tt.config.{name}")
    if name == "progress":
        return check_bool(value, "tt.config.progress (None: automatic)", allow_none=True)
    if name == "cache_size_limit_gb":
        ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
                               and value != float("inf"))
        if not ok:
            raise ConfigError(f"tt.config.cache_size_limit_gb must be a positive number of GB or None, got {value!r}.")
        return value
    if name == "max_num_samples_stored":
        return check_int(value, "tt.config.max_num_samples_stored", minimum=1)
    if name == "min_num_samples":
        return check_int(value, "tt.config.min_num_samples", minimum=1)
    if name == "max_num_batches_after_first_size":
        return check_int(value, "tt.config.max_num_batches_after_first_size", minimum=1, allow_none=True)
    if name == "max_num_calibration_samples":
        return check_int(value, "tt.config.max_num_calibration_samples", minimum=0)
    if name == "default_device":
        from torch_tweak.torch._device import normalize_device_string

        return normalize_device_string(value)
    if name == "device_after_tuning":
        if value is not None and value not in DEVICES_AFTER_TUNING:
            raise ConfigError(f"tt.config.device_after_tuning must be one of {DEVICES_AFTER_TUNING} or None, got "
                              f"{value!r}. 'release' frees the weights' memory and keeps their device and dtype.")
        return value
    if name == "executor":
        if value not in EXECUTORS:
            raise ConfigError(f"tt.config.executor must be one of {EXECUTORS}, got {value!r} (for another executor, "
                              "pass it to tt.tune(executor=...)).")
        return value
    if name == "on_unknown_signature":
        if value not in UNKNOWN_SIGNATURE_POLICIES:
            raise ConfigError(
                f"tt.config.on_unknown_signature must be one of {UNKNOWN_SIGNATURE_POLICIES}, got {value!r}."
            )
        return value
    return value


config = TorchTweakConfig()


def torch_tweak_cache_dir() -> Path:
    """The cache folder (``tt.config.cache_dir``); the reference Torch Tweak's name for it."""
    return config.cache_dir
