"""The call shapes a built candidate has already run, so that its measurement there needs no warm-up call.

Why: the fidelity check runs every recorded call, the largest batch's included, right before the candidate is
measured, and a measurement first runs an untimed warm-up call at each batch size (the first call at a shape pays for
OpenVINO's shape-specific kernels, ONNX Runtime's memory plan, allocations). After the check that warm-up repeats a
call the candidate has run at that shape already: for a BERT-base at batch 32 on 2 cores, 2.6-4.8 s per candidate,
about a tenth of its tuning. A shape counts as warm when its call took at least the warm-up's time limit
(``ProfilingConfig.warmup_max_s``): the warm-up would have been that one call, and a call that long does not notice
threads waking up after the pause between candidates. A non-finite guard added after the check runs the runtime
the check warmed. Releasing a backend's scratch buffers forgets its shapes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.backend.non_finite_guard import NonFiniteGuardBackend
from torch_tweak.torch.module.tree import flatten_sample

#: Per built backend: the seconds its slowest call took at each input shape key.
_RAN: weakref.WeakKeyDictionary[Backend, dict[tuple[Any, ...], float]] = weakref.WeakKeyDictionary()


def shape_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The shapes and dtypes of a call's tensors, in graph order."""
    leaves, _ = flatten_sample(args, kwargs)
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in leaves)


def note(backend: Backend, args: tuple[Any, ...], kwargs: dict[str, Any], seconds: float) -> None:
    """Remember that ``backend`` ran a call like this one and how long it took."""
    ran = _RAN.setdefault(backend, {})
    key = shape_key(args, kwargs)
    ran[key] = max(seconds, ran.get(key, 0.0))


def forget(backend: Backend) -> None:
    """``backend`` released its buffers: the next call at every shape allocates again."""
    _RAN.pop(backend, None)


def warm(backend: Backend, args: tuple[Any, ...], kwargs: dict[str, Any], at_least_s: float) -> bool:
    """True when ``backend`` (or, for a non-finite guard, the backend it guards) ran a call of these shapes that
    took ``at_least_s`` seconds or more."""
    key = shape_key(args, kwargs)
    ran = [backend, backend.inner] if isinstance(backend, NonFiniteGuardBackend) else [backend]
    return any(_RAN.get(b, {}).get(key, -1.0) >= at_least_s for b in ran)
