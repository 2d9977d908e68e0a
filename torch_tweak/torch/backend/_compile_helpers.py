"""What the backends that compile from PyTorch share: build errors, warm-up inputs and calls, recompile watch.

Warm-up synthesizes calls from a graph spec so that every compile happens before the user's first call: at
build (tuning) and when a backend restored from a checkpoint compiles at ``deploy``. Its first call has batch
and dynamic sizes >= 2 and is marked dynamic, so Dynamo compiles one graph for every size (sizes 0 and 1
specialise, and get their own call); a size never seen then does not recompile. When Dynamo's recompile limit
is reached anyway, it falls back to eager for new shapes; :func:`watch_recompile_limit` says so in
torch_tweak's log.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torch_tweak.errors import BuildError, UnsupportedInputError
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, flatten_sample, unflatten_sample

logger = logging.getLogger(__name__)

BUILD_LOG_NAME = "build.log"
_MAX_CAUSE_CHARS = 600


# shared helpers -----------------------------------------------------------------------------------


def build_failure(
    what: str, exc: BaseException, cache_dir: Path | None, hint: str = "", error_cls: type[BuildError] = BuildError
) -> BuildError:
    """A :class:`BuildError` saying what failed, the cause, how to fix it and where the compiler log is."""
    cause = str(exc).strip() or repr(exc)
    if len(cause) > _MAX_CAUSE_CHARS:
        cause = cause[:_MAX_CAUSE_CHARS] + " ..."
    message = f"{what}: {type(exc).__name__}: {cause}"
    if hint:
        message += f"\n{hint}"
    log_path = None
    if cache_dir is not None:
        log_path = str(Path(cache_dir) / BUILD_LOG_NAME)
        message += f"\nCompiler output of this build: {log_path}"
    return error_cls(message, log_path=log_path)


def clone_sample(sample: Sample) -> Sample:
    """A copy of ``sample`` whose tensors are cloned (a module may modify its inputs in place)."""
    leaves, structure = flatten_sample(*sample)
    try:
        return unflatten_sample(structure, [t.clone() for t in leaves])
    except UnsupportedInputError:  # objects that cannot be rebuilt from tensors (e.g. a KV cache)
        return copy.deepcopy(sample)


def example_batch_sizes(graph_spec: GraphSpec) -> list[int | None]:
    """Batch sizes to synthesize warm-up inputs at: one >= 2 (for dynamic shapes), the smallest, the largest."""
    batch_range = graph_spec.batch_range()
    if batch_range is None:
        return [None]
    lo, hi = batch_range
    sizes = [min(max(lo, 2), hi), lo, hi]
    return list(dict.fromkeys(sizes))


def _with_dynamic_sizes(sample: Sample, graph_spec: GraphSpec, pick: Callable[[int, int], int]) -> Sample:
    """``sample`` with each dynamic (non-batch) axis resized to ``pick(smallest, largest size seen)``."""
    leaves, structure = flatten_sample(*sample)
    if len(leaves) != len(graph_spec.inputs) or not any(s.dynamic_axes() for s in graph_spec.inputs):
        return sample
    generator = torch.Generator().manual_seed(0)
    resized = []
    for leaf, spec in zip(leaves, graph_spec.inputs, strict=True):
        shape = list(leaf.shape)
        for axis in spec.dynamic_axes():
            shape[axis] = pick(spec.min_shape[axis], spec.max_shape[axis])
        if shape == list(leaf.shape):
            resized.append(leaf)
        elif leaf.dtype.is_floating_point:
            resized.append(torch.randn(shape, generator=generator).to(leaf.dtype).to(leaf.device))
        else:
            resized.append(torch.ones(shape, dtype=leaf.dtype, device=leaf.device))
    return unflatten_sample(structure, resized)


def warm_up_inputs(graph_spec: GraphSpec, device: torch.device) -> list[Sample]:
    """Synthesized calls covering every batch size and sequence bucket tuning saw, with one compile each.

    Batch sizes come from :func:`example_batch_sizes`; each dynamic axis takes a size >= 2 within its recorded
    range, its smallest and its largest. The first call (to be marked dynamic) has sizes >= 2 where the range
    allows, so Dynamo compiles one graph that serves all of them; sizes 0 and 1 specialise, so each combination
    of them seen at tuning gets its own call (and graph) now rather than at a user's first request.
    """
    picks: list[Callable[[int, int], int]] = [lambda lo, hi: min(max(lo, 2), hi), lambda lo, hi: lo,
                                              lambda lo, hi: hi]
    calls: list[Sample] = []
    seen: set[tuple[Any, ...]] = set()
    for batch in example_batch_sizes(graph_spec):
        base = graph_spec.example_inputs(batch, device=device)
        for pick in picks:
            call = _with_dynamic_sizes(base, graph_spec, pick)
            shapes = tuple(tuple(leaf.shape) for leaf in flatten_sample(*call)[0])
            if shapes not in seen:
                seen.add(shapes)
                calls.append(call)
    return calls


class _RecompileLimitWatch(logging.Filter):
    """Repeats Dynamo's "hit config.recompile_limit" warning in torch_tweak's log, saying what it means here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
            logger.warning(
                "A compiled graph reached Dynamo's recompile limit (%s): from now on Dynamo runs that forward eagerly "
                "for input shapes it has no graph for (slower, same results). The graph's batch and dynamic axes are "
                "marked dynamic when it is compiled, so another size changed; tune with inputs that show that "
                "variation, or raise torch._dynamo.config.recompile_limit.", record.getMessage().splitlines()[0])
        return True


_WATCH = _RecompileLimitWatch()


def watch_recompile_limit() -> None:
    """Make a fall back to eager at Dynamo's recompile limit visible in torch_tweak's log (installed once)."""
    dynamo_logger = logging.getLogger("torch._dynamo.convert_frame")
    if _WATCH not in dynamo_logger.filters:
        dynamo_logger.addFilter(_WATCH)


def mark_symbolic_axes(sample: Sample, graph_spec: GraphSpec) -> None:
    """Hint Dynamo that the graph's batch and dynamic axes vary, so the first compile is dynamic on them."""
    leaves, _ = flatten_sample(*sample)
    if len(leaves) != len(graph_spec.inputs):
        return
    for leaf, spec in zip(leaves, graph_spec.inputs, strict=True):
        for axis, size in enumerate(spec.shape):
            if isinstance(size, str):
                torch._dynamo.maybe_mark_dynamic(leaf, axis)


def distinct_calls(earlier: list[Sample], data: list[Sample]) -> list[Sample]:
    """The samples of ``data`` whose :func:`_guarded` key no earlier call (``earlier``, then ``data``) had.

    A second call with the same tensor shapes, strides, dtypes and devices and the same non-tensor values runs
    the graph the first one compiled, so warming it up only costs a call (a slow candidate's recorded calls
    took minutes: a BERT-base quantized by TorchAO ran 3.7 s per call, 19 recorded calls of one shape).
    """
    seen = {key for call in earlier if (key := _guarded(call)) is not None}
    kept = []
    for sample in data:
        key = _guarded(sample)
        if key is None or key not in seen:
            kept.append(sample)
            if key is not None:
                seen.add(key)
    return kept


def _guarded(sample: Sample) -> tuple[Any, ...] | None:
    """What Dynamo's guards check of a call's inputs: the call's structure with its non-tensor values, and each
    tensor's shape, strides, dtype, device and ``requires_grad`` (None: the structure cannot be compared)."""
    leaves, structure = flatten_sample(*sample)
    try:
        hash(structure)
    except TypeError:
        return None
    return structure, tuple((tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) for t in leaves)


def warm_up(
    fn: Callable[..., Any],
    graph_spec: GraphSpec,
    data: list[Sample],
    device: torch.device | None,
    context: Callable[[], Any],
    mark_dynamic: bool,
) -> None:
    """Run ``fn`` on synthesized inputs (first one marked dynamic if asked) and once on each recorded sample
    that differs from every earlier call in what a compiled graph's guards check (:func:`_guarded`)."""
    device = device or torch.device("cpu")
    try:
        examples = warm_up_inputs(graph_spec, device)
    except UnsupportedInputError:
        examples = []  # the inputs hold objects that cannot be synthesized (e.g. a KV cache): recorded calls only
    calls = [*examples, *(clone_sample(s) for s in distinct_calls(examples, data))]
    if mark_dynamic and calls:
        mark_symbolic_axes(calls[0], graph_spec)
    with torch.no_grad(), context():
        for args, kwargs in calls:
            fn(*args, **kwargs)
