"""Running a unit of work under a time limit, abandoning it (cooperatively cancelled) when it overruns."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

GRACE_S = 1.0  # extra wait for a cancelled call to stop at its next measured call


def run_with_time_limit(fn: Callable[[threading.Event], Any], limit_s: float | None) -> tuple[bool, Any]:
    """Run ``fn(cancel)``; return ``(finished, value)``. Past ``limit_s`` the call is abandoned.

    Without a limit ``fn`` runs in the calling thread. With one it runs in a daemon thread that inherits
    the caller's grad mode; when the limit passes, ``cancel`` is set (measurements stop at their next
    call) and the thread is left behind. Exceptions from ``fn`` are re-raised here.
    """
    cancel = threading.Event()
    if limit_s is None:
        return True, fn(cancel)
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def target() -> None:
        try:
            with torch.set_grad_enabled(grad):
                box["value"] = fn(cancel)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="torch_tweak-candidate", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        cancel.set()
        thread.join(min(GRACE_S, limit_s))
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box.get("value")


