"""NonFiniteGuardBackend: a fast backend for finite inputs, the module's own code for NaN and inf.

The product rule is that a tuned module propagates NaN and inf as eager does: invalid input must not come
back as plausible output. Some backends break it in a few ops only (OpenVINO's CPU plugin maps NaN to a
finite value in ReLU, Clamp, MaxPool and ReduceMax at every precision; TorchAO's int8 activation scales
turn an all-+inf row into +inf where eager gives NaN), which the fidelity probes catch. Rewriting the
graph costs more than the backend gains, and such inputs are rare, so a strategy keeps the backend and
wraps it in this guard: a call whose floating-point input tensors are all finite goes to the inner
backend, any other call runs the wrapped module's original forward and gets exactly eager's result.

The per-call test must be cheap, and must not wake torch's thread pool between calls of another runtime.
Measured on 2 cores of a shared Xeon (AVX-512), per input tensor, for 1x256 / 32x3x32x32 / 32x3x224x224
floats: ``torch.isfinite(t).all()`` 24 µs / 0.7 ms / 41 ms (it writes a bool tensor, then reduces it);
``t.sum()`` (non-finite exactly when an element is, or when finite values overflow) 5 µs / 14 µs / 2.2 ms
on one thread, but 6 µs / 0.36 ms / 20 ms on two, and next to OpenVINO calls it added 12 ms to a 5 ms
call because torch's and OpenVINO's worker threads compete for the cores; numpy's single-threaded
``isfinite(a).all()`` (exact) 6 µs / 36-53 µs / 3.8-4.1 ms and +0.6 ms next to OpenVINO. Between OpenVINO
calls even a small tensor's ``t.sum().item()`` costs 13-16 µs (1x16 to 32x256 floats, AMD EPYC, 2 cores)
against 6-8 µs for numpy's ``add.reduce``; and the dot product of a float32 tensor with itself (one BLAS call,
NaN and inf survive it since no two squares cancel) costs 1.6-1.8 µs there against 2.9-3.7 µs for
``add.reduce`` (1x256 and 32x256 floats next to OpenVINO LATENCY calls, Sapphire Rapids, 2 cores). So CPU
tensors numpy can view (float16/32/64) are checked by numpy below :data:`_INLINE` elements (float32/64 by their
dot product, float16 by a float32 sum) and by ``isfinite`` above; the rest (bfloat16, other devices) are summed
by torch, which reduces fewer than :data:`_INLINE` elements on the calling thread. A backend that feeds its runtime a
numpy view of a one-tensor call anyway (OpenVINO's runner) checks that view instead
(:meth:`~torch_tweak.torch.backend.backend.Backend.checked_serving`): on an MLP 256-512-256 served by OpenVINO on one
thread at batch 32 the guard then added 2.4 µs to a 33 µs call instead of 4.3 µs (Sapphire Rapids, 2 cores).

Like :class:`~torch_tweak.torch.backend.batch_router.BatchRouterBackend` it is assembled from an already
built backend, never built from a template, and its checkpoint state nests the inner backend's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from torch_tweak.errors import BackendStateError, ConfigError
from torch_tweak.torch.backend.backend import Backend, BackendState
from torch_tweak.torch.backend.registry import resolve_backend
from torch_tweak.torch.module.forward import original_forward
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, flatten_sample, qualified_name
from torch_tweak.utils.hashing import hash_string
from torch_tweak.utils.validate import check_bool

logger = logging.getLogger(__name__)

INNER = "inner"
REASON = "reason"
_MAX_REASON = 600
_Tensor = torch.Tensor
_INLINE = 32768  # torch reduces fewer elements on the calling thread (at::internal::GRAIN_SIZE): no pool wakes up
_NUMPY = (torch.float32, torch.float64, torch.float16)  # dtypes numpy can view without a copy
_WIDEN = (torch.float16, torch.bfloat16)  # summed in float32 so that a large finite input does not overflow
_vdot = np.vdot  # flattens by itself: 1.1-1.4 µs against 1.3-1.9 µs for reshape(-1) and dot (1x16, 32x256 floats)


def all_finite(tensors: Sequence[Any]) -> bool:
    """False if a floating-point tensor of ``tensors`` holds NaN or inf (for a tensor summed, also when finite
    values overflow the sum or the sum of squares, beyond 1e19 in float32: such a call only runs eager)."""
    for t in tensors:
        if not isinstance(t, _Tensor) or not t.is_floating_point():
            continue
        if t.is_cpu and t.dtype in _NUMPY and type(t) is _Tensor:
            if not array_finite((t.detach() if t.requires_grad else t).numpy()):
                return False
        elif not math.isfinite((t.sum(dtype=torch.float32) if t.dtype in _WIDEN else t.sum()).item()):
            return False
    return True


def array_finite(array: np.ndarray) -> bool:
    """:func:`all_finite` for one numpy array: True for a non-float one (a backend's view of a call's input)."""
    if array.dtype.kind != "f":
        return True
    if array.size >= _INLINE:
        return bool(np.isfinite(array).all())
    if array.dtype.itemsize >= 4:  # float32/64: one BLAS call
        return math.isfinite(_vdot(array, array))
    return math.isfinite(np.add.reduce(array, axis=None, dtype=np.float32))


def call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sequence[Any]:
    """The input tensors of a call: its arguments when they are plain tensors (no walk), else its leaves."""
    for value in args:
        if type(value) is not _Tensor:
            return flatten_sample(args, kwargs)[0]
    if not kwargs:
        return args
    for value in kwargs.values():
        if type(value) is not _Tensor:
            return flatten_sample(args, kwargs)[0]
    return [*args, *kwargs.values()]


class NonFiniteGuardBackend(Backend):
    """Serves finite calls with ``inner`` and calls with NaN/inf inputs with the module's original forward.

    Args:
        inner: a backend built for ``graph_spec`` (active) or loaded from a checkpoint.
        module: the wrapped module whose original forward serves non-finite calls (its weights stay in memory).
        graph_spec: the graph ``inner`` serves.
        reason: why the guard is needed (the fidelity probe that ``inner`` failed), shown when a call is diverted.
        quiet: never log diverted calls (for a strategy's proof run, whose diverted calls are expected).

    Attributes:
        diverted_calls: how many calls this instance sent to the module's original forward.
    """

    requires_original_module = True

    def __init__(self, inner: Backend, module: nn.Module, graph_spec: GraphSpec, reason: str | None = None, *,
                 quiet: bool = False) -> None:
        super().__init__()
        if not isinstance(inner, Backend) or isinstance(inner, NonFiniteGuardBackend):
            raise ConfigError(f"NonFiniteGuardBackend wraps one backend that is not itself guarded, got {inner!r:.80}.")
        if not isinstance(module, nn.Module):
            raise ConfigError(f"NonFiniteGuardBackend needs the wrapped nn.Module to serve NaN/inf calls, got "
                              f"{type(module).__name__}.")
        if inner.state not in (BackendState.ACTIVE, BackendState.CHECKPOINT_LOADED):
            raise BackendStateError(f"NonFiniteGuardBackend needs a built and active backend, or one loaded from a "
                                    f"checkpoint; {inner.describe()} is {inner.state.value}.")
        self._inner = inner
        self._module = module
        self._forward = original_forward(module)
        self._graph_spec = graph_spec
        self.reason = None if reason is None else str(reason)[:_MAX_REASON]
        self.diverted_calls = 0
        self._quiet = check_bool(quiet, "NonFiniteGuardBackend quiet")
        self.state = inner.state
        self._device = inner.device
        self._devices = inner._devices  # type: ignore[misc]
        self.runtime = inner.runtime  # type: ignore[misc]  # the inner backend serves every finite call

    @property
    def inner(self) -> Backend:
        """The backend that serves finite calls."""
        return self._inner

    @property
    def executed_precision(self) -> str:
        """The inner backend's precision (the rare diverted call runs the module's own precision)."""
        return self._inner.executed_precision

    def components(self) -> list[Backend]:
        """The guard and the inner backend's components."""
        return [self, *self._inner.components()]

    def reactivates_quickly(self) -> bool:
        """The inner backend's (the guard itself holds nothing to load)."""
        return self._inner.reactivates_quickly()

    def key(self) -> str:
        """Class name and a hash of the inner backend's key."""
        return f"{self.__class__.__name__}_{hash_string(self._inner.key())}"

    def describe(self) -> str:
        """``OpenVINOBackend() + non-finite guard``."""
        return f"{self._inner.describe()} + non-finite guard"

    # state machine: the inner backend's ---------------------------------------------------------------

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        raise BackendStateError("NonFiniteGuardBackend is assembled by a strategy around a backend it has already "
                                "built; pass that backend to NonFiniteGuardBackend(inner, module, graph_spec).")

    def _activate(self) -> None:
        self._inner.activate()

    def _deactivate(self) -> None:
        self._inner.deactivate()

    def _deploy(self) -> None:
        self._inner.deploy(self._device)
        self._device = self._inner.device
        if self._device is not None:
            self._module.to(self._device)  # diverted calls run the module where the inputs are

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        if all_finite(call_tensors(args, kwargs)):
            return self._inner.infer(*args, **kwargs)
        return self._divert(args, kwargs)

    def _serving(self) -> Callable[..., Any]:
        inner, divert = self._inner.serving(), self._divert

        def serve(*args: Any, **kwargs: Any) -> Any:
            if all_finite(call_tensors(args, kwargs)):
                return inner(*args, **kwargs)
            return divert(args, kwargs)

        # a backend that views a one-tensor call as a numpy array checks that view (2 µs of a 35 µs OpenVINO call)
        return self._inner.checked_serving(array_finite, divert, serve) or serve

    def _divert(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.diverted_calls == 0 and not self._quiet:
            logger.warning(
                "Graph %s: a call has NaN or inf in its floating-point inputs, so it runs the module's original code "
                "instead of %s, which does not propagate NaN/inf as eager does%s. "
                "Such calls are served this way from now on without further warnings.",
                self._graph_spec.name, self._inner.describe(), f" ({self.reason})" if self.reason else "",
            )
        self.diverted_calls += 1
        with torch.no_grad():
            return self._forward(*args, **kwargs)

    # checkpoint ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Type, graph spec, device, reason and the inner backend's type, class and state."""
        inner = self._inner
        return {
            self.STATE_TYPE: self.__class__.__name__,
            self.STATE_GRAPH_SPEC: self._graph_spec.to_dict(),
            self.STATE_DEVICE: str(self._device) if self._device is not None else None,
            REASON: self.reason,
            INNER: {"backend_type": type(inner).__name__, "backend_class": qualified_name(type(inner)),
                    "state": inner.to_dict()},
        }

    @classmethod
    def from_dict(cls, module: nn.Module | None, state_dict: dict[str, Any]) -> NonFiniteGuardBackend:
        """Recreate the inner backend with its own ``from_dict`` (state CHECKPOINT_LOADED) around ``module``."""
        if state_dict.get(cls.STATE_TYPE) != cls.__name__:
            raise ValueError(f"Invalid state_dict type: {state_dict.get(cls.STATE_TYPE)}")
        if module is None:
            raise ValueError(f"{cls.__name__}.from_dict needs the original module: calls with NaN/inf run its forward.")
        entry = state_dict.get(INNER)
        type_name = entry.get("backend_type") if isinstance(entry, dict) else None
        class_name = entry.get("backend_class") if isinstance(entry, dict) else None
        if not isinstance(type_name, str) or not isinstance(class_name, str) or type_name == cls.__name__ \
                or not isinstance(entry.get("state"), dict):  # type: ignore[union-attr]
            raise ValueError(f"{cls.__name__} state names no usable inner backend (type, class and state).")
        reason = state_dict.get(REASON)
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"{cls.__name__} state has a reason that is not a string.")
        inner_cls = resolve_backend(type_name, class_name, f"{cls.__name__} inner backend")
        inner = inner_cls.from_dict(module, entry["state"])  # type: ignore[index]
        backend = cls(inner, module, GraphSpec.from_dict(state_dict[cls.STATE_GRAPH_SPEC]), reason)
        backend._set_device(state_dict.get(cls.STATE_DEVICE))
        return backend
