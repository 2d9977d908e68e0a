"""The loop of a worker process started by :class:`~torch_tweak.torch.executor.process.ProcessExecutor`.

Messages arrive on the pipe as pickles written by the parent (the process that started this one), never read
from disk: ``("context", token)`` followed by the context as a stream (:mod:`._stream`), ``("drop", token)``,
``("run", token, fn, args)`` and ``("stop",)``.
Replies are ``("ready", info)``, ``("log", record)``, ``("done", value)`` and ``("error", text)``.
Log records at or above the parent's level are forwarded, so the caller's handlers see them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from torch_tweak.torch.executor._stream import receive_pickle
from torch_tweak.utils import priority


class _Unloadable:
    """A context that could not be unpickled here; every run against it reports why."""

    def __init__(self, text: str) -> None:
        self.text = text


class _Forward(logging.Handler):
    """Sends log records to the parent (message formatted here, arguments dropped: they may not pickle)."""

    def __init__(self, send: Any) -> None:
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = {"name": record.name, "levelno": record.levelno, "levelname": record.levelname,
                    "msg": record.getMessage(), "args": None, "pathname": record.pathname,
                    "lineno": record.lineno, "funcName": record.funcName, "created": record.created,
                    "exc_text": self.format(record).partition("\n")[2] if record.exc_info else None}
            self._send(("log", data))
        except Exception:  # noqa: BLE001 - logging must never break the work
            self.handleError(record)


def _leave() -> NoReturn:
    """Exit at once, without the interpreter's teardown. Every reply has been sent and every artifact written
    (a run finishes before it replies), so what teardown would do is unload torch, OpenVINO and the compilers:
    3.4 s on a 2-core EPYC after a tiny MLP's tune, which the parent's ``close`` waited for."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream: nothing to flush
            pass
    os._exit(0)


def _die_with_parent() -> None:
    """Linux: have the kernel kill this process when the one that started it dies (``PR_SET_PDEATHSIG``): a
    background build is of no use then, and it must not stay behind, stopped or compiling."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request: nobody is left to wait for the work
        os._exit(0)


def _main_script_last() -> None:
    """Move the caller's main script (imported here as ``__mp_main__``) to the end of ``sys.modules``.

    pickle names an object that has no ``__module__`` (``torch.contiguous_format``) after the first module in
    ``sys.modules`` that reaches it, skipping ``__main__`` but not ``__mp_main__``. A spawned process imports the
    script first, so the tensor metadata in Inductor's cache keys pickled as ``__mp_main__.torch.contiguous_format``
    here and as ``torch._utils.torch.contiguous_format`` in the caller: no graph compiled here was ever found by the
    caller's rebuild of the chosen candidate (a BERT-base: 60 s compiled again instead of 20 s). Last in the
    order, the script is reached only when no other module names the object, and both processes name torch's own
    module, imported in the same order by the same script."""
    script = sys.modules.pop("__mp_main__", None)
    if script is not None:
        sys.modules["__mp_main__"] = script


def main(conn: Connection, num_threads: int, log_level: int, background: bool = False) -> None:
    """Serve the parent until it says stop or goes away. A ``background`` worker (builds ahead of their turn,
    ``executor/background.py``) leads a process group of its own, which the measuring processes pause while they
    time calls, and builds at the lowest priority, so that it takes only the cores the other work leaves idle."""
    import multiprocessing

    _main_script_last()

    if background:
        os.setpgid(0, 0)  # its compiler's helper processes join this group: one signal pauses them all
        priority.lower()  # measuring there restores it (utils/priority.py)
        _die_with_parent()

    # A spawned process inherits "spawn" as its default start method. Libraries that start helper processes
    # (OpenVINO's telemetry starts one per event) would then start a whole interpreter that imports the caller's
    # main script each time, stealing the cores from the measurements (measured: 7x slower small convolutions
    # while OpenVINO converted). Restore the platform's default, as in any other process.
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    import torch

    torch.set_num_threads(num_threads)
    lock = threading.Lock()

    def send(message: Any) -> None:
        blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with lock:
            conn.send_bytes(blob)

    root = logging.getLogger()  # this process is ours: its root logger forwards to the parent's handlers
    root.handlers[:] = [_Forward(send)]
    root.setLevel(log_level)
    send(("ready", {"pid": os.getpid(), "host": socket.gethostname()}))
    contexts: dict[int, Any] = {}
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        except Exception:  # noqa: BLE001 - only a run message can fail to load (contexts load below)
            send(("error", f"the worker could not load the work it was sent: {traceback.format_exc()}"))
            continue
        kind = message[0]
        if kind == "stop":
            _leave()
        if kind == "drop":
            contexts.pop(message[1], None)
        elif kind == "context":
            try:
                contexts[message[1]] = receive_pickle(conn)
            except Exception:  # noqa: BLE001 - reported with the first run against it
                contexts[message[1]] = _Unloadable(traceback.format_exc())
        elif kind == "run":
            _, token, fn, args = message
            context = contexts.get(token, _Unloadable("it was never sent"))  # None is a context like any other
            if isinstance(context, _Unloadable):
                send(("error", f"the worker could not load the tuning context: {context.text}"))
                continue
            try:
                value = fn(context, *args)
            except BaseException:  # noqa: BLE001 - any escape is reported, the worker stays usable
                send(("error", traceback.format_exc()))
                continue
            send(("done", value))
