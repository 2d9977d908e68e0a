"""The onnxruntime session of :class:`~torch_tweak.torch.backend.onnxruntime.ONNXRuntimeBackend`: how a call's tensors
become the session's feeds and its outputs the module's output structure, on a short path for the common small model.

``onnxruntime`` is imported when a session is created, never when this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torch_tweak.errors import BuildError, UnsupportedInputError
from torch_tweak.torch.backend._export import CallLeaves, leaf_mismatch, short_path_serving
from torch_tweak.torch.backend._onnx import require
from torch_tweak.torch.environment import usable_cores
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import TENSOR, unflatten

OPTIMIZATION_LEVELS = {"all": "ORT_ENABLE_ALL", "extended": "ORT_ENABLE_EXTENDED", "basic": "ORT_ENABLE_BASIC",
                       "disabled": "ORT_DISABLE_ALL"}
EXECUTION_MODES = {"sequential": "ORT_SEQUENTIAL", "parallel": "ORT_PARALLEL"}
_ONNX_TYPES = {"float": torch.float32, "double": torch.float64, "float16": torch.float16, "int64": torch.int64,
               "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


def import_onnxruntime() -> Any:
    """Import and return ``onnxruntime``, or raise :class:`BackendUnavailableError`."""
    require("onnxruntime", what="to run ONNX models")
    import onnxruntime

    return onnxruntime


class OnnxSession:
    """An ``InferenceSession`` with the mapping from a call's tensors to its inputs and back to the output structure."""

    def __init__(self, path: Path, spec: GraphSpec, *, optimization_level: str, execution_mode: str,
                 threads: int | None) -> None:
        ort = import_onnxruntime()
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization_level])
        options.execution_mode = getattr(ort.ExecutionMode, EXECUTION_MODES[execution_mode])
        options.intra_op_num_threads = threads or usable_cores() or 1
        options.log_severity_level = 3  # errors only: unused-initializer notes are not the user's concern
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.threads = options.intra_op_num_threads
        self._spec = spec
        index = {s.name: i for i, s in enumerate(spec.inputs)}
        names = [i.name for i in self.session.get_inputs()]
        outputs = self.session.get_outputs()
        if any(n not in index for n in names) or len(outputs) != len(spec.outputs):
            raise BuildError(
                f"The ONNX model has inputs {names} and {len(outputs)} outputs, but graph {spec.name!r} has inputs "
                f"{list(index)} and {len(spec.outputs)} outputs; the model was not exported for this graph."
            )
        self._feeds = [(name, index[name]) for name in names]  # an input the module ignores may have been dropped
        self._dtypes = [s.torch_dtype for s in spec.inputs]
        self._out_structure = spec.output_structure
        self._leaves = CallLeaves(spec, "ONNX model")
        self._single = self._out_structure == TENSOR
        produced = [_ONNX_TYPES.get(o.type.removeprefix("tensor(").removesuffix(")")) for o in outputs]
        self._casts = [(i, s.torch_dtype) for i, (d, s) in enumerate(zip(produced, spec.outputs)) if d != s.torch_dtype]
        self._output_names = [o.name for o in outputs]
        # InferenceSession.run checks feeds, ownership and graph capture in Python before calling its binding (3-5
        # µs of a 10 µs call on a tiny MLP); the feeds built here always pass those checks, so call the binding.
        binding = getattr(self.session, "_sess", None)
        self._run = binding.run if callable(getattr(binding, "run", None)) else self.session.run
        # one RunOptions for all calls (a run only reads it): None builds one per call, 0.6-0.8 µs of a 14 µs call
        self._options = ort.RunOptions()

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = self._leaves(args, kwargs)
        try:
            feed = {name: leaves[i].numpy() for name, i in self._feeds}
        except (RuntimeError, TypeError, AttributeError):  # autograd, non-CPU, non-tensor leaves
            feed = self._slow_feed(leaves)
        try:
            arrays = self._run(self._output_names, feed, self._options)
        except Exception as exc:  # onnxruntime's own exception types, none of them a builtin it documents
            raise self._input_error(leaves, exc) from exc
        outputs = [torch.from_numpy(a) for a in arrays]
        for i, dtype in self._casts:
            outputs[i] = outputs[i].to(dtype)
        return outputs[0] if self._single else unflatten(self._out_structure, outputs)

    def serving(self) -> Callable[..., Any]:
        """``self(args, kwargs)`` as a function of the call. A graph of one positional tensor and one output that
        needs no cast (the common small model) goes straight to the binding; any other call takes the general path."""
        return short_path_serving(self.__call__, self.checked_serving)

    def checked_serving(self, array_ok: Callable[[Any], bool] | None, refused: Callable[..., Any] | None,
                        other: Callable[..., Any]) -> Callable[..., Any] | None:
        """The short path of :meth:`serving` (None where the graph does not allow it), which first asks ``array_ok``
        (when given) about the call's numpy view and hands a call it refuses to ``refused(args, kwargs)``; calls the
        short path cannot take go to ``other``. The non-finite guard checks the view the session is fed: next to
        onnxruntime's spinning threads a second view and the guard's general walk cost an MLP 256-512-256 at batch
        32 more than a tenth of its 95 µs int8 call (AVX2 EPYC, 2 cores)."""
        if not (self._leaves.single_positional and len(self._feeds) == 1 and self._single and not self._casts):
            return None
        name, run, names, from_numpy, options = (self._feeds[0][0], self._run, self._output_names, torch.from_numpy,
                                                 self._options)

        def serve(*args: Any, **kwargs: Any) -> Any:
            if kwargs or len(args) != 1:
                return other(*args, **kwargs)
            try:
                array = args[0].numpy()
            except (RuntimeError, TypeError, AttributeError):
                return other(*args, **kwargs)
            if array_ok is not None and not array_ok(array):
                return refused(args, kwargs)  # type: ignore[misc]
            try:
                return from_numpy(run(names, {name: array}, options)[0])
            except Exception as exc:  # as in __call__
                raise self._input_error(args, exc) from exc

        return serve

    def _slow_feed(self, leaves: Any) -> dict[str, Any]:
        feed = {}
        for name, i in self._feeds:
            t = leaves[i] if i < len(leaves) else None
            if not isinstance(t, torch.Tensor) or t.dtype is not self._dtypes[i]:
                raise self._input_error(leaves, None)
            feed[name] = t.numpy(force=True)
        return feed

    def _input_error(self, leaves: Any, exc: BaseException | None) -> UnsupportedInputError:
        mismatch = leaf_mismatch(leaves, self._spec, "ONNX model")
        if mismatch is not None:
            return mismatch
        cause = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else "see the cause"
        return UnsupportedInputError(f"ONNX Runtime rejected the inputs of graph {self._spec.name!r}: {cause[:500]}")
