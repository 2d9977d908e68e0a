"""Argument checks shared by every config and public function: one wording, one place.

Each check returns the value (so ``self.x = check_int(...)`` reads naturally) or raises
:class:`~torch_tweak.errors.ConfigError` naming the setting, what it must be and what it got. ``bool`` is
never accepted as an integer or a number (``True`` is not a batch size).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

from torch_tweak.errors import ConfigError

T = TypeVar("T")


def check_bool(value: Any, what: str, *, allow_none: bool = False) -> Any:
    """``value`` if it is True or False (or None when allowed)."""
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    expected = "None, True or False" if allow_none else "True or False"
    raise ConfigError(f"{what} must be {expected}, got {value!r}.")


def check_int(value: Any, what: str, *, minimum: int | None = None, maximum: int | None = None,
              allow_none: bool = False) -> Any:
    """``value`` if it is an integer in ``[minimum, maximum]`` (or None when allowed)."""
    if allow_none and value is None:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum) \
            and (maximum is None or value <= maximum):
        return value
    raise ConfigError(f"{what} must be {_describe('an integer', minimum, maximum, allow_none)}, got {value!r}.")


def check_number(value: Any, what: str, *, minimum: float | None = None, maximum: float | None = None,
                 allow_none: bool = False) -> Any:
    """``value`` if it is a finite number in ``[minimum, maximum]`` (or None when allowed)."""
    if allow_none and value is None:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value
    raise ConfigError(f"{what} must be {_describe('a number', minimum, maximum, allow_none)}, got {value!r}.")


def check_positive(value: Any, what: str, *, allow_zero: bool) -> float:
    """``value`` as a float if it is a finite number > 0 (or 0, with ``allow_zero``)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{what} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}.")
    return float(value)


def check_choice(value: T, what: str, choices: Iterable[T], *, allow_none: bool = False) -> T:
    """``value`` if it is one of ``choices`` (or None when allowed)."""
    options = list(choices)
    if (allow_none and value is None) or value in options:
        return value
    listed = ", ".join(repr(c) for c in options)
    raise ConfigError(f"{what} must be {'None or ' if allow_none else ''}one of {listed}, got {value!r}.")


def _describe(kind: str, minimum: float | None, maximum: float | None, allow_none: bool) -> str:
    if minimum is not None and maximum is not None:
        text = f"{kind} in [{minimum}, {maximum}]"
    elif minimum is not None:
        text = f"{kind} >= {minimum}"
    elif maximum is not None:
        text = f"{kind} <= {maximum}"
    else:
        text = kind
    return f"None or {text}" if allow_none else text
