"""Execution graphs: what a wrapped module receives and returns for one input signature.

A *graph* is one distinct signature of calls to a module (structure, tensor ranks and, in strict
mode, non-tensor values). For each graph, :class:`GraphSpec` lists a :class:`TensorSpec` per input and
output tensor. Axes are classified from the shapes observed while recording:

* a **batch axis** (``"batchN"``, N = axis index) has size ``k * batch_size`` in every observation,
  for one integer ``k``, across at least two batch sizes;
* a **dynamic axis** (``"dimN"``) changes size in any other way;
* every other axis is **static** and keeps its integer size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_tweak.errors import ConfigError, UnsupportedInputError
from torch_tweak.torch.module.tree import (
    Sample,
    Spec,
    dispatch_key,
    dtype_from_name,
    dtype_name,
    flatten_sample,
    unflatten,
    unflatten_sample,
)
from torch_tweak.torch.module.tree_json import spec_from_json, spec_to_json
from torch_tweak.utils.table import format_table

Shape = tuple[int, ...]
Observation = tuple["int | None", tuple[Shape, ...]]


@dataclass
class TensorSpec:
    """Shape, range and dtype of one input or output tensor of a graph.

    Attributes:
        name: identifier-like name (``args_0``, ``kwargs_input_ids``, ``outputs_logits``).
        locator: where the tensor sits in the call (``args[0]``, ``kwargs['input_ids']``).
        shape: per axis an ``int`` (static) or ``"batchN"`` / ``"dimN"`` (symbolic).
        min_shape: smallest size seen per axis.
        max_shape: largest size seen (or allowed) per axis.
        dtype: dtype name such as ``"float32"``.
        batch_multipliers: for each batch axis, the integer ``k`` with ``size = k * batch_size``.
    """

    name: str
    locator: str
    shape: tuple[int | str, ...]
    min_shape: Shape
    max_shape: Shape
    dtype: str
    batch_multipliers: dict[int, int] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """Number of axes."""
        return len(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return dtype_from_name(self.dtype)

    def has_batch_axis(self) -> bool:
        """True if any axis scales with the batch size."""
        return bool(self.batch_multipliers)

    def dynamic_axes(self) -> list[int]:
        """Axes that vary independently of the batch size."""
        return [i for i, s in enumerate(self.shape) if isinstance(s, str) and s.startswith("dim")]

    def accepts(self, shape: Sequence[int]) -> bool:
        """True if ``shape`` has this rank, equal static sizes and symbolic sizes within range."""
        if len(shape) != self.rank:
            return False
        for size, spec, lo, hi in zip(shape, self.shape, self.min_shape, self.max_shape):
            if isinstance(spec, int):
                if size != spec:
                    return False
            elif not lo <= size <= hi:
                return False
        return True

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "name": self.name,
            "locator": self.locator,
            "shape": list(self.shape),
            "min_shape": list(self.min_shape),
            "max_shape": list(self.max_shape),
            "dtype": self.dtype,
            "batch_multipliers": {str(k): v for k, v in self.batch_multipliers.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSpec:
        """Inverse of :meth:`to_dict`, validating every field."""
        try:
            shape = tuple(s if isinstance(s, str) else int(s) for s in data["shape"])
            spec = cls(
                name=str(data["name"]),
                locator=str(data["locator"]),
                shape=shape,
                min_shape=tuple(int(s) for s in data["min_shape"]),
                max_shape=tuple(int(s) for s in data["max_shape"]),
                dtype=str(data["dtype"]),
                batch_multipliers={int(k): int(v) for k, v in data.get("batch_multipliers", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedInputError(f"Malformed tensor spec: {data!r:.200}") from exc
        if not (len(spec.shape) == len(spec.min_shape) == len(spec.max_shape)):
            raise UnsupportedInputError(f"Tensor spec {spec.name!r} has inconsistent ranks.")
        dtype_from_name(spec.dtype)
        return spec


def infer_tensor_specs(
    names: Sequence[str], locators: Sequence[str], dtypes: Sequence[str], observations: Sequence[Observation]
) -> list[TensorSpec]:
    """Classify every axis of every tensor from the observed ``(batch_size, shapes)`` pairs."""
    specs = []
    for i, (name, locator, dtype) in enumerate(zip(names, locators, dtypes)):
        seen = [(bs, shapes[i]) for bs, shapes in observations]
        rank = len(seen[0][1])
        symbolic: list[int | str] = []
        multipliers: dict[int, int] = {}
        for axis in range(rank):
            sizes = [s[axis] for _, s in seen]
            if len(set(sizes)) == 1:
                symbolic.append(sizes[0])
                continue
            k = _batch_multiplier([(bs, s[axis]) for bs, s in seen])
            if k is not None:
                symbolic.append(f"batch{axis}")
                multipliers[axis] = k
            else:
                symbolic.append(f"dim{axis}")
        mins = tuple(min(s[a] for _, s in seen) for a in range(rank))
        maxs = tuple(max(s[a] for _, s in seen) for a in range(rank))
        specs.append(TensorSpec(name, locator, tuple(symbolic), mins, maxs, dtype, multipliers))
    return specs


def _batch_multiplier(pairs: list[tuple[int | None, int]]) -> int | None:
    batch_sizes = {bs for bs, _ in pairs}
    if None in batch_sizes or len(batch_sizes) < 2:
        return None
    ratios = {size // bs if size % bs == 0 else None for bs, size in pairs}  # type: ignore[operator]
    if len(ratios) == 1:
        (k,) = ratios
        if k is not None and k >= 1:
            return k
    return None


@dataclass
class GraphSpec:
    """One execution graph of a module: its input and output tensors and the call structure.

    Attributes:
        name: graph name, unique within its module (``"0"``, ``"1"``, ...).
        inputs: a spec per input tensor, in flatten order (positional, then keyword arguments sorted).
        outputs: a spec per output tensor, in flatten order.
        input_structure: structure of ``(args, kwargs)`` with non-tensor values (see ``tree``).
        output_structure: structure of the module's output.
        strict: whether non-tensor values take part in this graph's identity.
    """

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    input_structure: Spec
    output_structure: Spec
    strict: bool = True
    phase: str | None = None

    def key(self) -> tuple[Any, ...]:
        """The dispatch key of calls that belong to this graph (the same :func:`dispatch_key` as ``graph_key``)."""
        return dispatch_key(self.input_structure, [t.rank for t in self.inputs], self.strict, self.phase)

    def has_batch_axis(self) -> bool:
        """True if every input tensor has a batch axis (so the graph can be run at other batch sizes)."""
        return bool(self.inputs) and all(t.has_batch_axis() for t in self.inputs)

    def batch_range(self) -> tuple[int, int] | None:
        """The (min, max) logical batch size the graph was seen or extended to, or None without batch axes."""
        lows, highs = [], []
        for spec in self.inputs:
            for axis, k in spec.batch_multipliers.items():
                lows.append(spec.min_shape[axis] // k)
                highs.append(spec.max_shape[axis] // k)
        if not lows:
            return None
        return max(lows), min(highs)

    def with_max_batch_size(self, batch_size: int) -> GraphSpec:
        """Return a copy whose batch axes (inputs and outputs) accept batches up to ``batch_size``."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}.")

        def widen(spec: TensorSpec) -> TensorSpec:
            maxs = list(spec.max_shape)
            for axis, k in spec.batch_multipliers.items():
                maxs[axis] = max(maxs[axis], k * batch_size)
            return TensorSpec(spec.name, spec.locator, spec.shape, spec.min_shape, tuple(maxs), spec.dtype,
                              dict(spec.batch_multipliers))

        return GraphSpec(self.name, [widen(s) for s in self.inputs], [widen(s) for s in self.outputs],
                         self.input_structure, self.output_structure, self.strict, self.phase)

    def example_inputs(self, batch_size: int | None = None, device: str | torch.device = "cpu") -> Sample:
        """Synthesize inputs matching this graph (no recorded data needed).

        Batch axes get ``k * batch_size`` (default: the smallest batch seen), dynamic axes their smallest
        size. Floating tensors are drawn from a fixed-seed normal distribution, integer and bool tensors
        are ones (valid token ids and attention masks).
        """
        generator = torch.Generator().manual_seed(0)
        leaves = []
        for spec in self.inputs:
            shape = list(spec.min_shape)
            if batch_size is not None:
                for axis, k in spec.batch_multipliers.items():
                    shape[axis] = k * batch_size
            dtype = spec.torch_dtype
            if dtype.is_floating_point or dtype.is_complex:
                leaf = torch.randn(shape, generator=generator).to(dtype)
            else:
                leaf = torch.ones(shape, dtype=dtype)
            leaves.append(leaf.to(device))
        return unflatten_sample(self.input_structure, leaves)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (types named as ``module:QualName``)."""
        return {
            "name": self.name,
            "strict": self.strict,
            "phase": self.phase,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "input_structure": spec_to_json(self.input_structure),
            "output_structure": spec_to_json(self.output_structure),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphSpec:
        """Inverse of :meth:`to_dict`; never imports a module named in ``data``."""
        if not isinstance(data, dict):
            raise UnsupportedInputError(f"A graph spec must be a dict, got {type(data).__name__}.")
        try:
            return cls(
                name=str(data["name"]),
                inputs=[TensorSpec.from_dict(t) for t in data["inputs"]],
                outputs=[TensorSpec.from_dict(t) for t in data["outputs"]],
                input_structure=spec_from_json(data["input_structure"]),
                output_structure=spec_from_json(data["output_structure"]),
                strict=bool(data.get("strict", True)),
                phase=_phase(data.get("phase")),
            )
        except (KeyError, TypeError) as exc:
            raise UnsupportedInputError(f"Malformed graph spec: missing or invalid field ({exc}).") from exc

    def describe(self) -> str:
        """A table of inputs and outputs: locator, name, symbolic shape, min, max, dtype."""
        headers = ["", "locator", "name", "shape", "min", "max", "dtype"]
        rows = [
            [side, t.locator, t.name, _fmt(t.shape), _fmt(t.min_shape), _fmt(t.max_shape), t.dtype]
            for side, specs in (("input", self.inputs), ("output", self.outputs))
            for t in specs
        ]
        phase = f" ({self.phase} phase)" if self.phase else ""
        return format_table(headers, rows, title=f"Graph {self.name}{phase}")

    def __str__(self) -> str:
        return self.describe()


def _phase(value: Any) -> str | None:
    if value is None or value in ("prefill", "decode"):
        return value
    raise UnsupportedInputError(f"Unknown graph phase {value!r}; expected 'prefill', 'decode' or null.")


def _fmt(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def resize_batch(sample: Sample, graph_spec: GraphSpec, batch_size: int) -> Sample:
    """Return ``sample`` with every batch axis resized to ``k * batch_size``.

    Longer axes are cut, shorter ones are filled by cycling through the existing items, so the data
    stays realistic. Raises :class:`ConfigError` for a graph without a batch axis.
    """
    if not graph_spec.has_batch_axis():
        raise ConfigError(f"Graph {graph_spec.name!r} has no batch axis; its batch size cannot be changed.")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}.")
    leaves, structure = flatten_sample(*sample)
    if len(leaves) != len(graph_spec.inputs):
        raise UnsupportedInputError(
            f"The sample has {len(leaves)} tensors but graph {graph_spec.name!r} expects {len(graph_spec.inputs)}."
        )
    resized = []
    for leaf, spec in zip(leaves, graph_spec.inputs):
        for axis, k in spec.batch_multipliers.items():
            target, current = k * batch_size, leaf.shape[axis]
            if target != current:
                index = torch.arange(target, device=leaf.device) % current
                leaf = leaf.index_select(axis, index)
        resized.append(leaf)
    return unflatten_sample(structure, resized)


def observe_shapes(leaves: Sequence[torch.Tensor]) -> tuple[Shape, ...]:
    """The shapes of ``leaves`` as tuples of ints."""
    return tuple(tuple(t.shape) for t in leaves)


def dtypes_of(leaves: Sequence[torch.Tensor]) -> list[str]:
    """The dtype names of ``leaves``."""
    return [dtype_name(t.dtype) for t in leaves]


__all__ = ["GraphSpec", "TensorSpec", "infer_tensor_specs", "resize_batch", "unflatten"]
