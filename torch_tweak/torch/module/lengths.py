"""Sequence axes seen at one length: one more eager call at a shorter length, so that they are tuned dynamic.

Why: a graph's spec calls an axis dynamic only when its size varied across the recorded calls. A text encoder tuned
on a few sentences of one length (or padded to one length) records its sequence axis at that size only; every
backend is then built for it, and a sentence of another length is refused as soon as the module's own weights are
released (``UnsupportedInputError``), although eager serves any length. An integer input (token ids, attention
masks, token type and position ids) whose axis after the first had the same size ``S >= 2`` in every recorded call
is most likely such a sequence axis. So before a graph is tuned, :func:`record_shorter_call` calls the module's
original forward once more, on its first stored call with every such axis cut to its first ``S // 2`` entries, and
stores that call and its eager outputs like any recorded one. The axis has then varied: backends export it
unbounded, and every candidate is checked at both lengths (the measurements stay on the first stored call, at the
recorded length).

Nothing changes when the module cannot run the shorter call (it raises, or returns another output structure): the
axis keeps its one size, as recorded. Not probed: language-model phase graphs (a KV cache or ``cache_position``
describes state the extra call would break), axis 0 (the batch), and floating-point inputs (their axes are
features, images, audio). Non-tensor arguments keep their recorded values. A module that runs the shorter call
but cannot be exported with the axis dynamic (a Python branch on the length) has its exported candidates fail at
export, a row each in the report saying why; ``tt.config.probe_sequence_lengths = False`` turns the probe off for
it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from torch_tweak.torch.module.dtypes import dtype_from_name
from torch_tweak.torch.module.recording import GraphRecorder
from torch_tweak.torch.module.spec import observe_shapes
from torch_tweak.torch.module.tree import flatten_sample, unflatten_sample

logger = logging.getLogger(__name__)


def constant_integer_axes(graph: GraphRecorder) -> dict[tuple[int, int], int]:
    """``{(input index, axis): size}`` of the integer inputs' axes after the first whose size was the same, and at
    least 2, in every recorded call of ``graph``."""
    shapes = graph.input_shapes()
    found: dict[tuple[int, int], int] = {}
    for i, name in enumerate(graph.input_dtypes()):
        dtype = dtype_from_name(name)
        if dtype.is_floating_point or dtype.is_complex:
            continue
        for axis in range(1, len(shapes[0][i]) if shapes else 0):
            sizes = {call[i][axis] for call in shapes}
            if len(sizes) == 1 and (size := next(iter(sizes))) >= 2:
                found[(i, axis)] = size
    return found


def record_shorter_call(graph: GraphRecorder, forward: Callable[..., Any], module_name: str) -> bool:
    """Record one call of ``forward`` with ``graph``'s :func:`constant_integer_axes` cut to half their length (see
    the module docstring); True if it was recorded. Runs once per graph."""
    if graph.lengths_probed:
        return False
    graph.lengths_probed = True
    axes = constant_integer_axes(graph) if graph.phase is None and graph.samples else {}
    if not axes:
        return False
    first = graph.samples[0]
    leaves, structure = flatten_sample(first.args, first.kwargs)
    cut = list(leaves)
    for (i, axis), size in axes.items():
        cut[i] = cut[i].narrow(axis, 0, size // 2).clone()
    args, kwargs = unflatten_sample(structure, cut)
    names = [spec.name for spec in graph.graph_spec().inputs]
    what = ", ".join(f"{names[i]} axis {axis}" for i, axis in axes)
    try:
        with torch.no_grad():
            outputs = forward(*args, **kwargs)
            graph.observe(first.batch_size, cut, structure, outputs)
    except Exception as exc:  # noqa: BLE001 - any failure means "this length is not for this module": keep it static
        logger.info("Module %s graph %s: %s had one length in every recorded call, and the module did not run at half "
                    "of it (%s: %s); they stay at their recorded length", module_name, graph.name, what,
                    type(exc).__name__, str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "")
        return False
    graph.add_sample(args, kwargs, outputs, first.batch_size, observe_shapes(cut), beyond_cap=True)
    logger.info("Module %s graph %s: %s had one length in every recorded call; recorded one more call at half that "
                "length, so they are tuned dynamic and any length serves (tt.config.probe_sequence_lengths = False "
                "keeps the recorded length)", module_name, graph.name, what)
    return True
