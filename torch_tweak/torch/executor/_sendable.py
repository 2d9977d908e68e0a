"""Whether a tuning context can reach a spawned worker process: it pickles, and what it takes from ``__main__``
can be imported there. Checked before any worker starts, so a graph that cannot be sent is tuned in process
with a warning instead of failing in the worker."""

from __future__ import annotations

import sys
from typing import Any

from torch_tweak.errors import WorkerError
from torch_tweak.torch.executor._stream import ContextPickler


class _Discard:
    """A file that keeps nothing: pickling into it checks that an object pickles without holding its bytes."""

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes  # bytes, or a storage's memory (a PickleBuffer)


class _Check(ContextPickler):
    """Pickles into :class:`_Discard` as a worker is sent the context, and notes the classes and functions
    defined in ``__main__``."""

    def __init__(self) -> None:
        super().__init__(_Discard())
        self.from_main: set[str] = set()

    def persistent_id(self, obj: Any) -> None:
        kind = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
        if getattr(kind, "__module__", None) == "__main__":
            self.from_main.add(getattr(kind, "__qualname__", repr(kind)))
        return None


def check_sendable(context: Any) -> None:
    """Raise :class:`WorkerError` unless a spawned worker can unpickle ``context``: it pickles, and what it
    takes from ``__main__`` can be imported there (``__main__`` is a file, not a notebook or ``python -c``)."""
    checker = _Check()
    try:
        checker.dump(context)
    except Exception as exc:
        raise WorkerError(
            f"The module cannot be sent to a worker process: pickling it or its strategy failed ({type(exc).__name__}: "
            f"{exc}). Make the module and the strategy's settings picklable (a FidelityConfig metric, for one, must be "
            "a module-level function, not a lambda), or pass executor='inline' to tune it in this process."
        ) from exc
    main = sys.modules.get("__main__")
    if checker.from_main and getattr(main, "__file__", None) is None:
        raise WorkerError(
            f"The module cannot be sent to a worker process: {sorted(checker.from_main)} are defined in an "
            "interactive session (a notebook, a REPL or `python -c`), which a worker cannot import. Move them into "
            "a module or a script file, or pass executor='inline'."
        )
