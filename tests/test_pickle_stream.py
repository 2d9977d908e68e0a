"""The tuning context travels to a worker as a stream of chunks (torch_tweak/torch/executor/_stream.py)."""

from __future__ import annotations

import pickle
from collections import deque

import pytest
import torch

from torch_tweak.torch.executor._stream import CHUNK, receive_pickle, send_pickle


class _Pipe:
    """Both ends of a connection in one object: what one end sends, the other receives, in order."""

    def __init__(self) -> None:
        self.messages: deque[bytes] = deque()
        self.sizes: list[int] = []

    def send_bytes(self, data) -> None:
        self.messages.append(bytes(data))
        self.sizes.append(memoryview(data).nbytes)

    def recv_bytes(self) -> bytes:
        if not self.messages:
            raise EOFError
        return self.messages.popleft()


def test_a_context_arrives_whole_and_no_message_holds_more_than_a_chunk_or_one_tensor() -> None:
    big = torch.randn(1024, 1024)  # 4 MB: torch pickles a tensor's bytes whole
    context = {"weights": big, "small": [torch.randn(3) for _ in range(2000)], "text": "a\nb", "n": 7}
    pipe = _Pipe()
    send_pickle(pipe, context)
    assert pipe.sizes[-1] == 0 and len(pipe.sizes) > 3  # several chunks, then the end
    whole = len(pickle.dumps(context, protocol=pickle.HIGHEST_PROTOCOL))
    assert max(pipe.sizes) < whole and max(pipe.sizes) <= max(2 * CHUNK, big.numel() * 4 + CHUNK)
    received = receive_pickle(pipe)
    assert torch.equal(received["weights"], big) and received["text"] == "a\nb" and received["n"] == 7
    assert all(torch.equal(a, b) for a, b in zip(received["small"], context["small"], strict=True))
    assert not pipe.messages  # the end marker was read too


def test_a_stream_that_cannot_be_unpickled_is_read_to_its_end_so_the_next_message_is_whole() -> None:
    pipe = _Pipe()
    pipe.send_bytes(b"\x80\x05not a pickle at all" + b"x" * 100)
    pipe.send_bytes(b"")
    pipe.send_bytes(b"next message")
    with pytest.raises(Exception):  # noqa: B017 - any unpickling error
        receive_pickle(pipe)
    assert pipe.recv_bytes() == b"next message"


def test_a_value_that_does_not_pickle_still_ends_its_stream() -> None:
    pipe = _Pipe()
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        send_pickle(pipe, {"ok": 1, "lambda": lambda: None})
    assert pipe.sizes[-1] == 0
    with pytest.raises(Exception):  # noqa: B017 - the stream is cut short
        receive_pickle(pipe)
    assert not pipe.messages


def test_storages_travel_as_their_own_memory_and_keep_dtype_views_and_sharing_within_a_tensor() -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    values = {"view": base[1:, ::2], "half": torch.randn(5).half(), "bool": torch.tensor([True, False]),
              "empty": torch.empty(0), "int": torch.arange(7)}
    pipe = _Pipe()
    send_pickle(pipe, values)
    received = receive_pickle(pipe)
    for name, value in values.items():
        assert received[name].dtype == value.dtype and torch.equal(received[name], value), name
    assert received["view"].stride() == values["view"].stride()
    received["int"][0] = 100  # the storage is writable memory of its own
    assert values["int"][0] == 0
