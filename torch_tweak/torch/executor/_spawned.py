"""A spawned worker process and the pipe to it: what the process executor and its background builds share.

The worker runs ``_worker.main``; this side sends it work and reads its replies (log records are handed to this
process's loggers on the way), and reads its resident memory from ``/proc`` for the memory limits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import time
from typing import Any

from torch_tweak.errors import WorkerError
from torch_tweak.torch.executor import _worker
from torch_tweak.torch.executor.base import WORKER_ENV

POLL_S = 0.05
START_TIMEOUT_S = 300.0


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None


def resident_bytes(pid: int) -> int | None:
    """The process's resident memory (``VmRSS``), or None where ``/proc`` does not tell."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown exit"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class Worker:
    """One spawned worker and the pipe to it."""

    def __init__(self, num_threads: int, background: bool = False) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe(duplex=True)
        level = logging.getLogger("torch_tweak").getEffectiveLevel()
        self.process = context.Process(target=_worker.main, args=(child, num_threads, level, background),
                                       name="torch_tweak-worker", daemon=False)
        self.contexts: set[int] = set()
        os.environ[WORKER_ENV] = "1"  # inherited by the worker: tt.tune refuses to run while it imports main
        try:
            self.process.start()
        finally:
            os.environ.pop(WORKER_ENV, None)
        child.close()
        self.name = f"pid {self.process.pid}"
        if not background:  # a background worker's "ready" is read with its first reply (nobody waits for it)
            self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            message = self.receive(POLL_S)
            if message is None:
                if not self.process.is_alive():
                    break
                continue
            if message[0] == "ready":
                self.name = f"pid {message[1]['pid']} on {message[1]['host']}"
                return
        code = self.process.exitcode
        self.kill()
        raise WorkerError(
            f"The torch_tweak worker process did not start ({describe_exit(code)}). A worker imports the main script "
            "again; a script that calls tt.tune at import time must do so under `if __name__ == '__main__':`. "
            "Pass executor='inline' to tune in this process instead."
        )

    def receive(self, timeout: float) -> tuple[Any, ...] | None:
        """The next reply (log records are passed to this process's loggers), or None after ``timeout``."""
        while True:
            try:
                if not self.conn.poll(timeout):
                    return None
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return None
            if message[0] != "log":
                return message
            record = logging.makeLogRecord(message[1])
            record.msg = f"[worker {self.name}] {record.msg}"
            logging.getLogger(record.name).handle(record)
            timeout = 0  # a log record is not the reply: look at what else has arrived

    def send(self, message: tuple[Any, ...]) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.send(("stop",))
        except OSError:
            pass
        self.process.join(5)
        self.kill()
