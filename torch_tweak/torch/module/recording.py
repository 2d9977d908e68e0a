"""Recording: turn observed calls into graphs (GraphSpec) with a few stored samples and eager outputs.

A graph may also keep more of its calls on disk (a :class:`~torch_tweak.torch.module.sample_store.SampleStore`,
given by ``stores`` when its strategy calibrates or judges on held-out calls); those are the calls that are not
among the in-memory samples. A call whose output shapes an earlier run recorded may be kept without running it
(:mod:`~torch_tweak.torch.module.known_shapes`); its eager outputs are computed when first read
(:meth:`RecordedSample.fill`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module.known_shapes import KnownShapes, ShapeMap, Shapes
from torch_tweak.torch.module.sample_store import SampleStore, eager_reference
from torch_tweak.torch.module.spec import GraphSpec, Observation, dtypes_of, infer_tensor_specs, observe_shapes
from torch_tweak.torch.module.tree import (
    Sample,
    Spec,
    flatten,
    flatten_sample,
    leaf_paths,
    map_tensors,
    sample_leaf_paths,
    signature,
    tensor_names,
)


@dataclass
class RecordedSample:
    """One stored call of a graph: its inputs (copied before the forward ran) and the eager outputs (None while
    ``pending``: recording did not run the call; :meth:`fill` computes them)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: Any
    batch_size: int | None
    pending: bool = False

    @property
    def sample(self) -> Sample:
        """``(args, kwargs)`` as backends take them."""
        return self.args, self.kwargs

    def fill(self, forward: Callable[..., Any]) -> None:
        """Compute the eager outputs of a pending call with ``forward`` (the module's own), on a copy of the inputs."""
        if self.pending:
            self.outputs = eager_reference(forward, self.args, self.kwargs)
            self.pending = False


class GraphRecorder:
    """Accumulates the calls of one graph (one input signature) of a module."""

    def __init__(self, name: str, key: tuple[Any, ...], strict: bool, max_samples: int,
                 phase: str | None = None) -> None:
        self.name = name if phase is None else f"{name}-{phase}"
        self.phase = phase
        self.key = key
        self.strict = strict
        self.max_samples = max_samples
        self.samples: list[RecordedSample] = []
        self.store: SampleStore | None = None  # more calls on disk, when the graph's strategy wants them
        self.num_calls = 0
        self._input_structure: Spec | None = None
        self._output_structure: Spec | None = None
        self._input_dtypes: list[str] = []
        self._output_dtypes: list[str] = []
        self._input_obs: dict[Observation, None] = {}
        self._output_obs: dict[Observation, None] = {}
        self._sample_shapes: list[tuple[Any, ...]] = []  # input shapes of each sample, in order
        self.shape_map: ShapeMap = {}  # input shapes -> output shapes (None: they differed), see known_shapes.py
        self.lengths_probed = False  # see module/lengths.py

    def wants_sample(self, input_shapes: tuple[Any, ...], batch_size: int | None = None) -> bool:
        """True if a call with these input shapes should be stored: new shapes, below the cap, or at a batch size
        no sample has yet when another batch size has two (:meth:`_replaceable`)."""
        if input_shapes in self._sample_shapes:
            return False
        return len(self.samples) < self.max_samples or self._replaceable(batch_size) is not None

    def _replaceable(self, batch_size: int | None) -> int | None:
        """The sample a call at a new ``batch_size`` replaces once the cap is reached: the latest one of a batch size
        that has two or more. Every batch size is judged on its own sample before a batch size gets a second shape
        (text of 64 lengths at batch size 1 would otherwise fill the cap, and the calls at batch size 2 would be
        judged only where the store holds one of them out)."""
        sizes = [sample.batch_size for sample in self.samples]
        if batch_size in sizes:
            return None
        return next((i for i in reversed(range(len(sizes))) if sizes.count(sizes[i]) >= 2), None)

    def observe(
        self,
        batch_size: int | None,
        input_leaves: list[torch.Tensor],
        input_structure: Spec,
        outputs: Any,
    ) -> None:
        """Record the shapes of one call's inputs and outputs."""
        output_leaves, output_structure = flatten(outputs)
        if self._input_structure is None:
            self._input_structure = input_structure
            self._output_structure = output_structure
            self._input_dtypes = dtypes_of(input_leaves)
            self._output_dtypes = dtypes_of(output_leaves)
        elif len(output_leaves) != len(self._output_dtypes) or _ranks(output_leaves) != self._output_ranks():
            raise UnsupportedInputError(
                f"Graph {self.name}: the module returned a different output structure for inputs of the same "
                "signature; torch_tweak needs a module whose output structure depends only on its input signature."
            )
        self.observe_known(batch_size, observe_shapes(input_leaves), observe_shapes(output_leaves))

    def observe_known(self, batch_size: int | None, input_shapes: Shapes, output_shapes: Shapes) -> None:
        """Record the shapes of one call (:meth:`observe` of a call run; for one not run, the shapes known for it)."""
        self.num_calls += 1
        self._input_obs[(batch_size, input_shapes)] = None
        self._output_obs[(batch_size, output_shapes)] = None
        seen = self.shape_map.setdefault(input_shapes, output_shapes)
        if seen is not None and seen != output_shapes:
            self.shape_map[input_shapes] = None

    def add_sample(self, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any, batch_size: int | None,
                   input_shapes: tuple[Any, ...], beyond_cap: bool = False, pending: bool = False) -> None:
        """Store a copied call with a detached copy of its eager outputs (``beyond_cap``: even when the graph holds
        ``max_samples`` already; ``pending``: the call was not run, ``outputs`` is None)."""
        reference = None if pending else map_tensors(outputs, lambda t: t.detach().clone())
        if len(self.samples) >= self.max_samples and not beyond_cap:
            index = self._replaceable(batch_size)
            if index is None:
                return
            del self.samples[index]
            del self._sample_shapes[index]
        self.samples.append(RecordedSample(args, kwargs, reference, batch_size, pending))
        self._sample_shapes.append(input_shapes)

    def input_shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        """The input tensors' shapes of every distinct recorded call."""
        return [shapes for _, shapes in self._input_obs]

    def input_dtypes(self) -> list[str]:
        """The input tensors' dtype names, in flatten order."""
        return list(self._input_dtypes)

    def _output_ranks(self) -> tuple[int, ...]:
        first = next(iter(self._output_obs))
        return tuple(len(s) for s in first[1])

    def graph_spec(self) -> GraphSpec:
        """The graph as seen so far."""
        if self._input_structure is None or self._output_structure is None:
            raise UnsupportedInputError(f"Graph {self.name} has recorded no call.")
        in_paths = sample_leaf_paths(self._input_structure)
        out_paths = leaf_paths(self._output_structure, "outputs")
        inputs = infer_tensor_specs(tensor_names(in_paths), in_paths, self._input_dtypes, list(self._input_obs))
        outputs = infer_tensor_specs(tensor_names(out_paths), out_paths, self._output_dtypes, list(self._output_obs))
        return GraphSpec(self.name, inputs, outputs, self._input_structure, self._output_structure, self.strict,
                         self.phase)


def _ranks(leaves: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.dim() for t in leaves)


_PHASE_KWARGS = ("cache_position", "past_key_values", "cache")


def llm_phase(kwargs: dict[str, Any]) -> str | None:
    """``"prefill"`` or ``"decode"`` for a language-model call, None for other calls.

    A call is an LLM step when it passes ``cache_position`` (prefill when it starts at 0) or a KV cache
    object with ``get_seq_length()`` as ``past_key_values``/``cache`` (prefill when the cache is empty).
    """
    position = kwargs.get("cache_position")
    if isinstance(position, torch.Tensor) and position.numel():
        return "prefill" if int(position.reshape(-1)[0]) == 0 else "decode"
    for name in ("past_key_values", "cache"):
        cache = kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length"):
            return "prefill" if int(cache.get_seq_length()) == 0 else "decode"
    return None


def graph_key(args: tuple[Any, ...], kwargs: dict[str, Any], strict: bool, phases: bool) -> tuple[Any, ...]:
    """The graph a call belongs to: its :func:`signature` (dispatch key), with the LLM phase when ``phases`` is on."""
    phase = llm_phase(kwargs) if phases and kwargs and any(name in kwargs for name in _PHASE_KWARGS) else None
    return signature(args, kwargs, strict, phase)


StoreFactory = Callable[[int, str], SampleStore | None]
"""``stores(index, name)``: the on-disk store of a new graph (creation index and name), or None for none."""


class Recorder:
    """All graphs of one module, in the order they were first seen."""

    def __init__(self, strict: bool, max_samples: int, phases: bool = True, stores: StoreFactory | None = None,
                 known: KnownShapes | None = None) -> None:
        self.strict = strict
        self.max_samples = max_samples
        self.phases = phases
        self.stores = stores
        self.known = known
        self.graphs: dict[tuple[Any, ...], GraphRecorder] = {}

    def record_call(
        self,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch_size: int | None,
        lazy: bool = False,
    ) -> Any:
        """Run ``forward`` once, recording the call; returns the real outputs. ``lazy`` (nobody uses the outputs):
        a call whose output shapes :attr:`known` has is kept without running it, once its graph ran one call;
        returns None then."""
        key = graph_key(args, kwargs, self.strict, self.phases)
        graph = self.graphs.get(key)
        if graph is None:
            phase = key[-1][1] if key[-1][:1] == ("phase",) else None
            graph = GraphRecorder(str(len(self.graphs)), key, self.strict, self.max_samples, phase)
            if self.stores is not None:
                graph.store = self.stores(len(self.graphs), graph.name)
            self.graphs[key] = graph
        input_leaves, input_structure = flatten_sample(args, kwargs)
        input_shapes = observe_shapes(input_leaves)
        known = self.known.output_shapes(key, input_shapes) if lazy and self.known and graph.num_calls else None
        stored: Sample | None = None
        spilled: list[torch.Tensor] | None = None
        if graph.wants_sample(input_shapes, batch_size):
            try:
                stored = copy.deepcopy((tuple(args), dict(kwargs)))
            except Exception as exc:
                raise UnsupportedInputError(
                    f"Could not copy the inputs of a recorded call ({exc}). Inputs must be deep-copyable; run "
                    "tuning under torch.no_grad() so tensors do not carry autograd history."
                ) from exc
        elif graph.store is not None and graph.store.wants_call():
            spilled = graph.store.capture(input_leaves)
            known = known if graph.store.takes_pending() else None  # its first call shows the output structure
        if known is not None:
            graph.observe_known(batch_size, input_shapes, known)
            if stored is not None:
                graph.add_sample(stored[0], stored[1], None, batch_size, input_shapes, pending=True)
            elif spilled is not None and graph.store is not None:
                graph.store.add(spilled, [str(t.device) for t in input_leaves], input_structure, None, batch_size,
                                pending=True)
            return None
        outputs = forward(*args, **kwargs)
        graph.observe(batch_size, input_leaves, input_structure, outputs)
        if self.known is not None:
            self.known.confirm(key, input_shapes, graph.shape_map[input_shapes])
        if stored is not None:
            graph.add_sample(stored[0], stored[1], outputs, batch_size, input_shapes)
        elif spilled is not None and graph.store is not None:
            graph.store.add(spilled, [str(t.device) for t in input_leaves], input_structure, outputs, batch_size)
        return outputs

    def graph_specs(self) -> list[GraphSpec]:
        """Every recorded graph's spec, in creation order."""
        return [g.graph_spec() for g in self.graphs.values()]


def record(
    forward: Callable[..., Any],
    calls: Iterable[tuple[int | None, Sample]],
    strict: bool = True,
    max_samples: int = 4,
) -> list[tuple[GraphSpec, list[RecordedSample]]]:
    """Record ``forward`` over ``(batch_size, (args, kwargs))`` calls; return each graph with its samples.

    A building block for tests and tools; ``tt.tune`` records through ``tt.Module`` instead.
    """
    recorder = Recorder(strict, max_samples)
    with torch.no_grad():
        for batch_size, (args, kwargs) in calls:
            recorder.record_call(forward, tuple(args), dict(kwargs), batch_size)
    return [(g.graph_spec(), g.samples) for g in recorder.graphs.values()]
