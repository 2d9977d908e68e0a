"""Running a compiled OpenVINO model: precomputed input mapping and a thread-safe pool of infer requests."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torch_tweak.errors import (
    UnsupportedInputError,
)
from torch_tweak.torch.backend._export import CallLeaves, leaf_mismatch, short_path_serving
from torch_tweak.torch.backend.openvino.converter import (
    import_openvino,
)
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import TENSOR, unflatten

COPY_INPUT_MAX_BYTES = 128 * 1024


class Runner:
    """A compiled model with everything a call needs precomputed, and a pool of reusable infer requests.

    Inputs up to :data:`COPY_INPUT_MAX_BYTES` are copied into tensors bound once to a request (reshaped in
    place); larger ones are shared with OpenVINO without a copy. Binding a tensor costs more than copying a
    small input (5-7 µs per call at batch 1), and ``InferRequest.infer(inputs)`` adds Python wrapping that
    ``infer()`` on bound tensors avoids (benchmarks/openvino_overhead.py). Outputs are copied out before the
    request returns to the pool, as the next call on it overwrites its buffers. Under the THROUGHPUT hints a
    batch is split across parallel requests (one per stream), which a single request cannot use.
    """

    def __init__(self, compiled: Any, graph_spec: GraphSpec, device: torch.device | None, hint: str) -> None:
        self._compiled, self._spec = compiled, graph_spec
        self._out_structure = graph_spec.output_structure
        self._dtypes = tuple(s.torch_dtype for s in graph_spec.inputs)
        self._n = len(graph_spec.inputs)
        self._leaves = CallLeaves(graph_spec, "OpenVINO model")
        produced = [torch.from_numpy(np.empty(0, p.get_element_type().to_dtype())).dtype for p in compiled.outputs]
        self._casts = [(i, s.torch_dtype) for i, (d, s) in enumerate(zip(produced, graph_spec.outputs, strict=True))
                       if d != s.torch_dtype]
        self._single = self._out_structure == TENSOR
        self._device = device if device is not None and device.type != "cpu" else None
        self._out_range = range(len(compiled.outputs))
        self._ov_tensor = import_openvino().Tensor
        self._pool: queue.SimpleQueue[tuple[Any, list[Any], list[bool]]] = queue.SimpleQueue()
        self._pool.put(self._new_request())
        one_axis = all(len(s.batch_multipliers) == 1 for s in (*graph_spec.inputs, *graph_spec.outputs))
        streams = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")) if hint != "LATENCY" else 1
        self._split = streams if one_axis and graph_spec.has_batch_axis() and streams > 1 else 1
        self._in_axes = [next(iter(s.batch_multipliers.items()), (0, 1)) for s in graph_spec.inputs]
        self._out_axes = [next(iter(s.batch_multipliers), 0) for s in graph_spec.outputs]
        self._min_chunk = max(1, (graph_spec.batch_range() or (1, 1))[0])

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = self._leaves(args, kwargs)
        try:
            arrays = [t.numpy() for t, dt in zip(leaves, self._dtypes, strict=False) if t.dtype is dt]
        except (RuntimeError, TypeError, AttributeError):  # autograd, non-CPU or non-tensor leaves
            arrays = self._slow_feed(leaves)
        if len(arrays) != self._n:
            raise self._input_error(leaves)
        chunks = self._chunks(arrays) if self._split > 1 else None
        try:
            outputs = self._run(arrays) if chunks is None else self._run_split(arrays, chunks)
        except RuntimeError as exc:
            raise self._input_error(leaves) from exc
        for i, dtype in self._casts:
            outputs[i] = outputs[i].to(dtype)
        if self._device is not None:
            outputs = [t.to(self._device) for t in outputs]
        return outputs[0] if self._single else unflatten(self._out_structure, outputs)

    def serving(self) -> Callable[..., Any]:
        """``self(args, kwargs)`` as a function of the call. A graph of one positional tensor and one output that
        needs no cast or move, run on one request, skips the general mapping; any other call takes the general path."""
        return short_path_serving(self.__call__, self.checked_serving)

    def checked_serving(self, array_ok: Callable[[Any], bool] | None, refused: Callable[..., Any] | None,
                        other: Callable[..., Any]) -> Callable[..., Any] | None:
        """The short path of :meth:`serving` (None where it does not apply), which first asks ``array_ok`` (when
        given) about the call's array and hands a call it refuses to ``refused(args, kwargs)``; calls the short path
        cannot take go to ``other``."""
        if not (self._leaves.single_positional and self._single and not self._casts and self._device is None
                and self._split == 1):
            return None
        dtype, run = self._dtypes[0], self._run

        def serve(*args: Any, **kwargs: Any) -> Any:
            if kwargs or len(args) != 1:
                return other(*args, **kwargs)
            try:
                array = args[0].numpy() if args[0].dtype is dtype else None
            except (RuntimeError, TypeError, AttributeError):
                array = None
            if array is None:
                return other(*args, **kwargs)
            if array_ok is not None and not array_ok(array):
                return refused(args, kwargs)  # type: ignore[misc]
            try:
                return run([array])[0]
            except RuntimeError as exc:
                raise self._input_error(args) from exc

        return serve

    def _acquire(self) -> tuple[Any, list[Any], list[bool]]:
        try:
            return self._pool.get_nowait()
        except queue.Empty:
            return self._new_request()

    def _new_request(self) -> tuple[Any, list[Any], list[bool]]:
        """An infer request, its own input tensors (small inputs are copied into them) and which are bound."""
        own = [self._ov_tensor(p.get_element_type(), list(s.min_shape))
               for p, s in zip(self._compiled.inputs, self._spec.inputs, strict=True)]
        return self._compiled.create_infer_request(), own, [False] * len(own)

    def _fill(self, entry: tuple[Any, list[Any], list[bool]], arrays: list[Any]) -> None:
        request, own, bound = entry
        for i, array in enumerate(arrays):
            if array.nbytes <= COPY_INPUT_MAX_BYTES:
                tensor = own[i]
                tensor.shape = array.shape
                np.copyto(tensor.data, array)
                if not bound[i]:
                    request.set_input_tensor(i, tensor)
                    bound[i] = True
            else:
                request.set_input_tensor(i, self._ov_tensor(np.ascontiguousarray(array), shared_memory=True))
                bound[i] = False

    def _run(self, arrays: list[Any]) -> list[torch.Tensor]:
        entry = self._acquire()
        try:
            self._fill(entry, arrays)
            entry[0].infer()
            return [torch.from_numpy(entry[0].get_output_tensor(i).data.copy()) for i in self._out_range]
        finally:
            self._pool.put(entry)

    def _chunks(self, arrays: list[Any]) -> list[int] | None:
        axis, k = self._in_axes[0]
        batch = arrays[0].shape[axis] // k
        count = min(self._split, batch // self._min_chunk)
        if count < 2:
            return None
        size, extra = divmod(batch, count)
        return [size + (i < extra) for i in range(count)]

    def _run_split(self, arrays: list[Any], chunks: list[int]) -> list[torch.Tensor]:
        """Run batch slices on parallel requests and concatenate the outputs along their batch axes."""
        started: list[tuple[Any, list[Any], list[bool]]] = []
        try:
            start = 0
            for size in chunks:
                entry = self._acquire()
                started.append(entry)
                self._fill(entry, [a[(slice(None),) * axis + (slice(k * start, k * (start + size)),)]
                                   for a, (axis, k) in zip(arrays, self._in_axes, strict=True)])
                entry[0].start_async()
                start += size
            for entry in started:
                entry[0].wait()
            # numpy joins the slices on this thread: torch.cat of a large output wakes the OpenMP pool, whose threads
            # then spin while the next call's OpenVINO threads want the same cores (3-4 % of a BERT-base batch of 8).
            return [torch.from_numpy(np.concatenate([e[0].get_output_tensor(i).data for e in started], self._out_axes[i]))
                    for i in self._out_range]
        finally:
            for entry in started:
                try:
                    entry[0].wait()
                finally:
                    self._pool.put(entry)

    def _slow_feed(self, leaves: Any) -> list[Any]:
        feed = []
        for t, dtype in zip(leaves, self._dtypes, strict=False):
            if not isinstance(t, torch.Tensor) or t.dtype is not dtype:
                raise self._input_error(leaves)
            if dtype == torch.bfloat16:
                raise UnsupportedInputError("bfloat16 inputs cannot be passed to OpenVINO through numpy; tune the "
                                            "module with float32 inputs and set inference_precision='bf16'.")
            feed.append(t.detach().cpu().numpy())
        return feed

    def _input_error(self, leaves: Any) -> UnsupportedInputError:
        mismatch = leaf_mismatch(leaves, self._spec, "OpenVINO model")
        if mismatch is not None:
            return mismatch
        return UnsupportedInputError(f"OpenVINO rejected the inputs of graph {self._spec.name!r}; see the cause.")
