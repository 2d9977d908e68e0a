"""Serving functions: the shortest path from a tuned module's call to the runtime that answers it.

A tuned call used to pass through the dispatcher, then ``Backend.infer`` of a batch router, of a non-finite
guard and of the backend (each checking its state, each a Python frame), then the runtime's general wrapper. On
a small model that was a third of the call: 14 µs of 43 µs at batch 1 of a 3-layer MLP served by ONNX Runtime
(Sapphire Rapids, 2 cores; ``benchmarks/dispatch.py`` measures the path), where a user's own ``session.run`` pays none of it.

So each backend offers ``serving()``: one function that answers calls as its ``infer`` does for as long as its
state does not change, with the checks done once when it is made (a router's function holds its routes'
functions, a guard's its inner backend's). The dispatcher keeps one per tuned graph and makes them again after
any backend changes state: every state change counts in :data:`changes`, and a dispatcher whose functions were
made at another count makes them again before serving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class _Changes:
    """A counter of backend state changes (one object, so readers need no ``global``)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


changes = _Changes()


def note_state_change() -> None:
    """Count a backend state change: serving functions made before it are made again before the next call."""
    changes.count += 1


def serving_function(backend: Any) -> Callable[..., Any]:
    """``backend.serving()``, or its ``infer`` for an object that offers no serving function."""
    serving = getattr(backend, "serving", None)
    return serving() if callable(serving) else backend.infer
