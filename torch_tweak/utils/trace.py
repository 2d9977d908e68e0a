"""Trace annotations (Intel ITT ranges) that cost nothing when no ITT binding is present.

``annotate`` picks its implementation once, when a function is decorated: the ``ittapi`` package if
it is importable, else ``torch.profiler.itt`` when torch is already imported and was built with ITT,
else the function is returned unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def _range_functions() -> tuple[Callable[[str], Any], Callable[[], Any]] | None:
    """Return (push, pop) functions of an ITT binding, or None when there is none."""
    if importlib.util.find_spec("ittapi") is not None:
        import ittapi

        domain = ittapi.domain("Torch Tweak")
        stack: list[Any] = []

        def push(label: str) -> None:
            task = ittapi.task(label, domain=domain)
            task.begin()
            stack.append(task)

        def pop() -> None:
            if stack:
                stack.pop().end()

        return push, pop
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            from torch.profiler import itt

            if itt.is_available():
                return itt.range_push, itt.range_pop
        except Exception:  # noqa: BLE001 - a broken optional profiler must not break the library
            return None
    return None


def annotate(message: str | None = None, domain: str | None = None) -> Callable[[F], F]:
    """Decorate a function so each call is an ITT range labelled ``"<domain>/<message>"``.

    Args:
        message: range label; defaults to the function's qualified name.
        domain: prefix of the label, e.g. ``"Torch Tweak"``.
    """

    def decorator(func: F) -> F:
        functions = _range_functions()
        if functions is None:
            return func
        push, pop = functions
        label = message or func.__qualname__
        if domain:
            label = f"{domain}/{label}"

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            push(label)
            try:
                return func(*args, **kwargs)
            finally:
                pop()

        return wrapper  # type: ignore[return-value]

    return decorator
