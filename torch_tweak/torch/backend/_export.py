"""Export helpers shared by backends that capture a graph with ``torch.export`` or tracing.

:class:`FlatForward` wraps a module so its forward takes the graph's input tensors positionally (in
:class:`GraphSpec` order) and returns its output tensors flattened (in ``GraphSpec.outputs`` order);
non-tensor arguments and ``None`` are bound from the recorded structure and keyword arguments are
passed by name. :func:`dynamic_shapes` derives ``torch.export`` dims from the graph's batch and dynamic
axes, and :func:`example_leaves` picks example inputs that avoid the 0/1 specialisation.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from torch_tweak.errors import ConversionError, UnsupportedInputError
from torch_tweak.torch.module.spec import GraphSpec, resize_batch
from torch_tweak.torch.module.tree import Sample, dtype_name, flatten, flatten_sample, unflatten_sample

logger = logging.getLogger(__name__)
_T = TypeVar("_T")
# Graphs (by module and dispatch key) whose export needed Dim.AUTO in this process: OpenVINO and ONNX Runtime
# export the same graph, and the failing first attempt costs seconds (2 s for the demo's encoder on 2 cores).
_NEEDS_AUTO_DIMS: weakref.WeakKeyDictionary[nn.Module, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()
# The last program exported from each module in this process, with what it was exported from: OpenVINO and ONNX
# Runtime convert the same program (torch.export of a BERT-base takes 4.3 s on 2 cores). The program holds the
# module's parameter tensors, not the module, so the entry goes when the module does.
_PROGRAMS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()


class CallLeaves:
    """A call's tensors in graph order, for runtimes that take flat inputs (OpenVINO, ONNX Runtime).

    A graph whose inputs are positional tensors only is served from ``args`` as they are (no walk of the call);
    any other call is flattened and must have the recorded structure, since the non-tensor values in it are
    constants of the compiled model.
    """

    def __init__(self, graph_spec: GraphSpec, model: str) -> None:
        self._n = len(graph_spec.inputs)
        self._structure = graph_spec.input_structure
        self._positional = flatten_sample((torch.empty(0),) * self._n, {})[1] == self._structure
        self._graph, self._model = graph_spec.name, model

    @property
    def single_positional(self) -> bool:
        """True when the graph's only input is the call's one positional tensor argument."""
        return self._positional and self._n == 1

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sequence[Any]:
        if self._positional and not kwargs and len(args) == self._n:
            return args
        leaves, structure = flatten_sample(args, kwargs)
        if structure != self._structure:
            raise UnsupportedInputError(
                f"The call does not match graph {self._graph!r} this {self._model} was built for (other arguments, or "
                f"non-tensor values different from the recorded ones, which are constants of the {self._model})."
            )
        return leaves


def leaf_mismatch(leaves: Sequence[Any], graph_spec: GraphSpec, model: str) -> UnsupportedInputError | None:
    """How a call's input leaves do not fit the graph the ``model`` (``"ONNX model"``) was built for: a leaf that is
    not a tensor, another dtype, or another size on a static axis (None when they fit)."""
    for t, spec in zip(leaves, graph_spec.inputs):
        if not isinstance(t, torch.Tensor):
            return UnsupportedInputError(f"{spec.locator}: expected a tensor, got {type(t).__name__}.")
        if dtype_name(t.dtype) != spec.dtype:
            return UnsupportedInputError(
                f"{spec.locator}: expected dtype {spec.dtype}, got {dtype_name(t.dtype)}; the {model} was built for "
                f"{spec.dtype} inputs. Cast the input, or tune with {dtype_name(t.dtype)} inputs."
            )
        if t.dim() != spec.rank or any(isinstance(size, int) and size != n for size, n in zip(spec.shape, t.shape)):
            return UnsupportedInputError(
                f"{spec.locator}: shape {list(t.shape)} does not fit the graph's shape {list(spec.shape)}: its static "
                f"axes were the same in every recorded call, and the {model} was built for that size. Tune with inputs "
                "of this shape too (then the axis becomes dynamic)."
            )
    return None


def short_path_serving(call: Callable[[tuple[Any, ...], dict[str, Any]], Any],
                       checked_serving: Callable[..., Callable[..., Any] | None]) -> Callable[..., Any]:
    """The serving function of a runtime's runner: its short path (``checked_serving(None, None, general)``, None
    where the graph does not allow one) or, else and for calls the short path cannot take, ``call(args, kwargs)``."""

    def general(*args: Any, **kwargs: Any) -> Any:
        return call(args, kwargs)

    return checked_serving(None, None, general) or general


class FlatForward(nn.Module):
    """Calls ``module`` with the structure of a graph from its input tensors given positionally."""

    def __init__(self, module: nn.Module, graph_spec: GraphSpec) -> None:
        super().__init__()
        self.module = module
        self._structure = graph_spec.input_structure
        self._num_outputs = len(graph_spec.outputs)

    def forward(self, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rebuild ``(args, kwargs)``, call the module by name, return its output tensors flattened."""
        args, kwargs = unflatten_sample(self._structure, list(leaves))
        outputs, _ = flatten(self.module(*args, **kwargs))
        if len(outputs) != self._num_outputs:
            raise ConversionError(
                f"The module returned {len(outputs)} tensors while converting, but {self._num_outputs} were "
                "recorded; its outputs must depend only on the input signature."
            )
        return tuple(outputs)


def _sample_batch(leaves: list[torch.Tensor], graph_spec: GraphSpec) -> int | None:
    for leaf, spec in zip(leaves, graph_spec.inputs, strict=False):
        for axis, k in spec.batch_multipliers.items():
            return leaf.shape[axis] // k
    return None


def example_leaves(graph_spec: GraphSpec, data: Sequence[Sample]) -> list[torch.Tensor]:
    """Input tensors to export/trace with: batch >= 2 and dynamic sizes >= 2 where possible (0/1 specialisation).

    ``data`` is read once, one call at a time (it may load each call from disk)."""
    samples: Sequence[Sample] = data if len(data) else [graph_spec.example_inputs(None)]

    def score(sample: Sample) -> tuple[int, int]:
        leaves, _ = flatten_sample(*sample)
        small_dims = sum(leaf.shape[a] < 2 for leaf, s in zip(leaves, graph_spec.inputs, strict=False) for a in s.dynamic_axes())
        return small_dims, -(_sample_batch(leaves, graph_spec) or 0)

    sample = min(samples, key=score)
    bounds = graph_spec.batch_range()
    leaves, _ = flatten_sample(*sample)
    if bounds is not None and graph_spec.has_batch_axis():
        batch = _sample_batch(leaves, graph_spec) or 0
        if batch < 2 <= bounds[1]:
            leaves, _ = flatten_sample(*resize_batch(sample, graph_spec, max(2, bounds[0])))
    if len(leaves) != len(graph_spec.inputs):
        raise ConversionError(
            f"The example call has {len(leaves)} tensors but graph {graph_spec.name!r} expects {len(graph_spec.inputs)}."
        )
    return [leaf.detach() for leaf in leaves]


def dynamic_shapes(graph_spec: GraphSpec, auto_dims: bool = False, inferred: bool = False) -> tuple[Any, ...]:
    """``torch.export`` dynamic shapes for :class:`FlatForward`: one shared batch Dim, one Dim per dynamic axis.

    The dims are unbounded above (any size >= 1): the recorded range tells which axes vary, never which sizes a
    tuned model may serve, since eager serves them all. With ``auto_dims`` the dynamic (non-batch) axes use
    ``Dim.AUTO``, letting ``torch.export`` find relations between them (e.g. the sequence axis of ids and mask).
    With ``inferred``, for graphs converted to runtimes that keep no range (OpenVINO, ONNX Runtime), a dynamic axis
    never recorded at size 1 uses ``Dim.DYNAMIC``: export infers its relations and range (a Hugging Face encoder's
    sequence axis: equal to its mask's, at most 512), which independent dims make it refuse, so the first attempt
    passes (a BERT-base exports once instead of failing after 4-5 s on 2 cores); a specialized axis still fails.
    Its lower bound becomes 2, which those runtimes do not keep.
    """
    from torch.export import Dim

    bounds = graph_spec.batch_range()
    batch = Dim("batch", min=1) if bounds is not None and bounds[1] > bounds[0] else None
    per_leaf: list[dict[int, Any] | None] = []
    for spec in graph_spec.inputs:
        axes: dict[int, Any] = {}
        if batch is not None:
            for axis, k in spec.batch_multipliers.items():
                axes[axis] = batch if k == 1 else k * batch
        for axis in spec.dynamic_axes():
            if auto_dims:
                axes[axis] = Dim.AUTO
            elif inferred and spec.min_shape[axis] > 1:
                axes[axis] = Dim.DYNAMIC
            else:
                axes[axis] = Dim(f"{spec.name}_dim{axis}", min=1)
        per_leaf.append(axes or None)
    return (tuple(per_leaf),)


def export_with_dims(module: nn.Module, graph_spec: GraphSpec, export: Callable[[bool], _T], what: str) -> _T:
    """``export(auto_dims)`` with independent dims first and ``Dim.AUTO`` when that fails on a graph with dynamic
    axes (the last error propagates). A graph of ``module`` that needed ``Dim.AUTO`` once in this process starts
    with it."""
    known = _NEEDS_AUTO_DIMS.get(module, set())
    key = graph_spec.key()
    if key not in known:
        try:
            return export(False)
        except Exception as first:
            if not any(s.dynamic_axes() for s in graph_spec.inputs):
                raise
            logger.info("%s with independent dynamic dims failed (%s); retrying with Dim.AUTO.", what, first)
    result = export(True)
    _NEEDS_AUTO_DIMS.setdefault(module, set()).add(key)
    return result


def export_program(module: nn.Module, graph_spec: GraphSpec, leaves: tuple[torch.Tensor, ...]) -> Any:
    """``torch.export`` of ``module``'s graph (through :class:`FlatForward`, every batch and dynamic axis unbounded:
    :func:`dynamic_shapes`, :func:`export_with_dims`) on ``leaves``; the same graph exported from the same inputs
    before in this process is not exported again. Call it with ``module`` pristine and grad off. Exceptions from
    ``torch.export`` propagate."""
    key = (graph_spec.key(), tuple((tuple(leaf.shape), leaf.dtype) for leaf in leaves))
    known = _PROGRAMS.get(module)
    if known is not None and known[0] == key:
        logger.debug("Reusing this process's torch.export of graph %r.", graph_spec.name)
        return known[1]
    wrapper = FlatForward(module, graph_spec).eval()

    def export(auto_dims: bool) -> Any:
        return torch.export.export(wrapper, leaves, dynamic_shapes=dynamic_shapes(graph_spec, auto_dims, True))

    program = export_with_dims(module, graph_spec, export, "torch.export")
    check_served_sizes(program, graph_spec)
    _PROGRAMS[module] = (key, program)
    return program


def check_served_sizes(program: Any, graph_spec: GraphSpec) -> None:
    """Raise :class:`ConversionError` when ``program`` (a ``torch.export`` of ``graph_spec``'s :class:`FlatForward`)
    does not take every recorded size of a batch or dynamic axis: ``Dim.AUTO`` let export fix the axis to the example's
    size, or bound it where the module branches on it (``if ids.shape[1] > 6``). Such a program computes the other
    sizes wrongly or refuses them, and the fidelity check would reject it with an error that does not say why."""
    nodes = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    ranges = program.range_constraints
    for name, spec in zip(program.graph_signature.user_inputs, graph_spec.inputs, strict=False):
        value = nodes[name].meta.get("val") if name in nodes else None
        if value is None:
            continue
        for axis in [*spec.batch_multipliers, *spec.dynamic_axes()]:
            size, low, high = value.shape[axis], spec.min_shape[axis], spec.max_shape[axis]
            if isinstance(size, int):
                taken = (size, size)
            elif (bounds := ranges.get(size.node.expr)) is not None:  # a product (k * batch) has no range of its own
                taken = (int(bounds.lower), _finite(bounds.upper))
            else:
                continue
            if low < taken[0] or (taken[1] is not None and high > taken[1]):
                hint = (" Every recorded call of this integer input may have had one length, and "
                        "tt.config.probe_sequence_lengths added a call at half of it: set it to False to tune this "
                        "graph at the recorded length only." if not spec.torch_dtype.is_floating_point else "")
                raise ConversionError(
                    f"torch.export could not keep axis {axis} of input {spec.name!r} dynamic over the recorded sizes "
                    f"{low}..{high}: the exported program takes {_sizes(taken)} only (the module's code branches on "
                    f"that size, or fixes it), so no single program serves every recorded call.{hint}")


def _finite(bound: Any) -> int | None:
    """An export range's upper bound as an int, None when unbounded."""
    try:
        return int(bound) if getattr(bound, "is_finite", True) else None
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def _sizes(taken: tuple[int, int | None]) -> str:
    low, high = taken
    return f"size {low}" if low == high else f"sizes {low}..{high if high is not None else 'any'}"
