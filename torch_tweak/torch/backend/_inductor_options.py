"""Inductor options: which a config may name, and which a checkpoint may carry (the inert allowlist).

Shared by the Inductor and Inductor AOT backends (and so by the warm-load packages), in a module of its own so
that none of them imports another for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch_tweak.errors import ConfigError


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


def _int_in(low: int, high: int, allow_none: bool = False) -> Callable[[Any], bool]:
    return lambda value: (value is None and allow_none) or (type(value) is int and low <= value <= high)


def _gemm_backends(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and set(value.upper().split(",")) <= {"ATEN", "CPP", "TRITON"}


#: Inductor options a checkpoint may carry, with the values allowed. They change what code Inductor
#: generates, never which programs it runs or which files and folders it reads or writes (unlike
#: ``cpp.cxx``, ``cpp.*_flags``, ``debug_dir``, ``trace.*`` or cache folders, which are refused).
INERT_INDUCTOR_OPTIONS: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(("freezing", "max_autotune", "max_autotune_gemm", "max_autotune_pointwise", "epilogue_fusion",
                     "pattern_matcher", "aggressive_fusion", "coordinate_descent_tuning", "shape_padding",
                     "layout_optimization", "keep_output_stride", "cpp.weight_prepack", "cpp.dynamic_threads"), _flag),
    "cpp.simdlen": _int_in(1, 4096, allow_none=True),
    "cpp.threads": _int_in(-1, 4096),
    "max_autotune_gemm_backends": _gemm_backends,
}


def unsafe_inductor_options(options: dict[str, Any] | None) -> list[str]:
    """The ``options`` that are not in :data:`INERT_INDUCTOR_OPTIONS` or have a value it does not allow."""
    found = []
    for key, value in (options or {}).items():
        check = INERT_INDUCTOR_OPTIONS.get(key)
        if check is None:
            found.append(f"Inductor option {key!r} is not on the list of inert options")
        elif not check(value):
            found.append(f"Inductor option {key!r} has the value {value!r:.60}, which is not allowed in a checkpoint")
    return found


def validate_inductor_options(options: Any, owner: str) -> dict[str, Any]:
    """Check that ``options`` is a dict of known Inductor options with JSON-able values."""
    import torch._inductor

    if not isinstance(options, dict):
        raise ConfigError(f"{owner}.options must be a dict of Inductor options, got {type(options).__name__}.")
    known = set(torch._inductor.list_options())
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        raise ConfigError(
            f"{owner}.options has unknown Inductor option(s) {unknown}; see torch._inductor.list_options()."
        )
    for key, value in options.items():
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ConfigError(f"{owner}.options[{key!r}] must be a bool, number, string or None, got {value!r}.")
    return dict(options)


def times_kernels(mode: str | None, options: dict[str, Any] | None) -> bool:
    """Whether a compile with this mode or these options (or Inductor's process-wide config) times kernels to
    choose among them (autotuning): such a compile must have the cores to itself, so it is not built ahead in a
    background process whose timings the other work would skew."""
    from torch._inductor import config as inductor

    keys = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise", "coordinate_descent_tuning")
    if any(bool(getattr(inductor, key, False)) for key in keys):
        return True
    return "autotune" in (mode or "") or any(bool((options or {}).get(key)) for key in keys)

