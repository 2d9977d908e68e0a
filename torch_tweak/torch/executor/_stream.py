"""A pickle streamed over a ``multiprocessing`` connection in chunks, so neither end holds a second copy of it.

A tuning context holds the module's weights. Pickling it to bytes, then pickling those bytes into a message,
had the caller hold the weights three times at once (a BERT-base's 440 MB: the tuning process rose from 880
to 1,682 MB while a worker started), and the worker several times while it unpickled. torch pickles a CPU storage as
the bytes of a ``torch.save`` of it, which the pickler's memo then keeps until the end: a second copy of every
weight even when the pickle goes nowhere. :class:`ContextPickler` writes a CPU storage's memory as it is instead
(a protocol-5 ``PickleBuffer``, no copy), and the worker wraps the bytearray it receives without copying it again.
Streamed, the caller holds one chunk besides the module, and the worker one copy of the weights.

The stream is a run of ``send_bytes`` messages ending with an empty one. Only pickles written by this process
for a worker it started travel this way; nothing read from disk is unpickled.
"""

from __future__ import annotations

import pickle
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import torch

CHUNK = 1 << 20  # small writes are gathered into messages of about this size; larger ones go out whole


def storage_from_buffer(buffer: bytearray, dtype: torch.dtype) -> torch.storage.TypedStorage:
    """A storage over ``buffer``'s memory (the bytearray a ``PickleBuffer`` unpickles to), without a copy."""
    raw = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    return torch.storage.TypedStorage(wrap_storage=raw.untyped_storage(), dtype=dtype, _internal=True)


class ContextPickler(pickle.Pickler):
    """Protocol 5, with CPU storages written from their own memory (see the module docstring)."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=5)

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.storage.TypedStorage) or obj._untyped_storage.device.type != "cpu":
            return NotImplemented
        untyped = obj._untyped_storage  # the public accessors warn that TypedStorage is deprecated
        memory = torch.empty(0, dtype=torch.uint8).set_(untyped, 0, (untyped.nbytes(),), (1,))
        return storage_from_buffer, (pickle.PickleBuffer(memory.numpy()), obj.dtype)


class _Writer:
    """The file a Pickler writes to: gathers small writes, sends each chunk as one message."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._pending = bytearray()

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size >= CHUNK:
            self.flush()
            self._conn.send_bytes(data)
        elif size:
            self._pending += data
            if len(self._pending) >= CHUNK:
                self.flush()
        return size

    def flush(self) -> None:
        if self._pending:
            self._conn.send_bytes(self._pending)
            self._pending = bytearray()


class _Reader:
    """The file an Unpickler reads from: the stream's messages, in order, up to the empty one."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._chunks: deque[memoryview] = deque()
        self.ended = False

    def _next(self) -> bool:
        if self.ended:
            return False
        chunk = self._conn.recv_bytes()
        if not chunk:
            self.ended = True
            return False
        self._chunks.append(memoryview(chunk))
        return True

    def read(self, size: int = -1) -> bytes:
        parts: list[memoryview] = []
        wanted = size if size >= 0 else float("inf")
        while wanted > 0 and (self._chunks or self._next()):
            head = self._chunks[0]
            if len(head) <= wanted:
                parts.append(self._chunks.popleft())
                wanted -= len(head)
            else:
                take = int(wanted)
                parts.append(head[:take])
                self._chunks[0] = head[take:]
                wanted = 0
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)

    def readline(self) -> bytes:
        line = bytearray()
        while self._chunks or self._next():
            head = self._chunks[0]
            end = bytes(head).find(b"\n")
            if end < 0:
                line += self._chunks.popleft()
                continue
            line += head[:end + 1]
            self._chunks[0] = head[end + 1:]
            break
        return bytes(line)

    def drain(self) -> None:
        """Read what is left of the stream (after an unpickling error), so the next message is a whole one."""
        self._chunks.clear()
        while self._next():
            self._chunks.clear()


def send_pickle(conn: Connection, value: Any) -> None:
    """Pickle ``value`` into ``conn`` as a stream of chunks (see the module docstring)."""
    writer = _Writer(conn)
    try:
        ContextPickler(writer).dump(value)
        writer.flush()
    finally:
        conn.send_bytes(b"")  # the end, also after a failed pickling: the reader then fails on a short stream


def receive_pickle(conn: Connection) -> Any:
    """Unpickle a stream written by :func:`send_pickle`; the whole stream is consumed even when this raises."""
    reader = _Reader(conn)
    try:
        return pickle.Unpickler(reader).load()
    finally:
        reader.drain()
