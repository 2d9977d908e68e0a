"""Output shapes an earlier run recorded: tuning a model again records it without running most of its calls.

Why: tuning the same model again reuses every stored result (``tune_strategy/result_cache.py``), yet recording ran
the module eagerly over the whole dataset at every batch size before any result could be looked up: 21.7 s of a
BERT-base's 26 s second run on a 2-core EPYC. What recording needs from a call is its output shapes (they are part of
the graph spec, and so of every result key); its outputs matter only for a call kept as a sample or a held-out call,
and only once a check reads them.

So a run writes, per graph, which input shapes gave which output shapes to ``<cache>/recordings/<key>.json`` (shapes
only, no values), and a later run skips the forward of a call whose output shapes are there when nothing needs its
outputs now: the module is the function ``tt.tune`` runs (its outputs go nowhere), no other ``tt.Module`` ran
inside it, and the graph has run a call for real in this run. A skipped call is still kept (as a sample or on
disk); its eager outputs are computed the first time a check reads them (:meth:`GraphTask.judged_calls`), which a
run that reuses every result does for the smallest sample alone.

The key covers the module's weights (:func:`~torch_tweak.torch.module.digest.weights_digest`), the source files of
every class in it and the torch and torch_tweak versions: a change to any of them reads another file (no file: every
call runs). A graph that gave two output shapes for the same input shapes (shapes that depend on values) is not
written; a real call that disagrees with the file turns it off for the rest of the run and deletes it (the next run
records every call).
``tt.config.lazy_recording = False`` runs every call.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak import __version__
from torch_tweak.torch.module.digest import weights_digest
from torch_tweak.utils.json_file import write_json_atomic

logger = logging.getLogger(__name__)

FORMAT = 1
Shapes = tuple[tuple[int, ...], ...]
ShapeMap = dict[Shapes, "Shapes | None"]
"""Input shapes of a graph's calls -> their output shapes (None: calls with these input shapes differed)."""


class KnownShapes:
    """The output shapes one module's earlier run recorded (see the module docstring)."""

    def __init__(self, path: Path | None, graphs: dict[str, dict[str, Shapes]] | None = None) -> None:
        self.path = path
        self.graphs = graphs or {}
        self.off: str | None = None if path is not None else "the module cannot be identified"

    @classmethod
    def open(cls, folder: Path, module: nn.Module) -> KnownShapes:
        """The file of ``module`` in ``folder`` (empty when there is none or it cannot be read)."""
        key = module_key(module)
        return cls(None) if key is None else cls.load(folder / f"{key}.json")

    @classmethod
    def load(cls, path: Path) -> KnownShapes:
        """The shapes in ``path`` (none when it does not exist; a warning when it cannot be read)."""
        try:
            graphs = _parse(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            return cls(path)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            logger.warning("Ignoring the recorded shapes in %s (%s); every call is run.", path, exc)
            return cls(path)
        logger.debug("Output shapes of %d graph(s) known from an earlier run (%s)", len(graphs), path)
        return cls(path, graphs)

    def output_shapes(self, graph_key: tuple[Any, ...], input_shapes: Shapes) -> Shapes | None:
        """The output shapes of a call of graph ``graph_key`` with ``input_shapes``, or None (unknown, or off)."""
        if self.off is not None:
            return None
        return self.graphs.get(_graph_id(graph_key), {}).get(_shapes_id(input_shapes))

    def confirm(self, graph_key: tuple[Any, ...], input_shapes: Shapes, output_shapes: Shapes | None) -> None:
        """A call that ran for real: if the file says otherwise about it, stop using the file."""
        known = self.output_shapes(graph_key, input_shapes)
        if known is not None and known != output_shapes:
            self.off = f"a call gave output shapes {output_shapes}, the earlier run {known}"
            logger.warning("Recorded output shapes in %s no longer hold (%s): every further call is run, and the "
                           "file is deleted so that the next run records every call. Calls recorded before this one "
                           "from the file may show wrong output sizes in this run's graph spec; set "
                           "tt.config.lazy_recording = False for a module whose output shapes depend on its values.",
                           self.path, self.off)
            if self.path is not None:
                self.path.unlink(missing_ok=True)

    def save(self, graphs: dict[tuple[Any, ...], ShapeMap]) -> None:
        """Write the shape maps of this run's graphs (those whose shapes depend on values are left out); nothing once
        a real call contradicted the file."""
        if self.path is None or self.off is not None:
            return
        doc: dict[str, Any] = {"format": FORMAT, "graphs": {}}
        for key, shape_map in graphs.items():
            if shape_map and all(out is not None for out in shape_map.values()):
                doc["graphs"][_graph_id(key)] = [[list(map(list, i)), list(map(list, o))] for i, o in shape_map.items()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, doc)
        except (OSError, TypeError, ValueError) as exc:
            logger.warning("Could not keep the recorded output shapes in %s: %s", self.path, exc)


def module_key(module: nn.Module) -> str | None:
    """What the shapes of ``module`` depend on, hashed; None when its weights cannot be hashed or a class in it has
    no source file."""
    weights = weights_digest(module)
    if weights is None:
        return None
    digest = hashlib.sha256(f"{FORMAT};{weights};{torch.__version__};{__version__};".encode())
    try:
        files = sorted({inspect.getsourcefile(type(m)) or "" for m in module.modules()})
        for name in files:
            digest.update(name.encode() + b"\0" + Path(name).read_bytes())
    except (OSError, TypeError):  # a class defined interactively or in native code
        return None
    return digest.hexdigest()


def _graph_id(graph_key: tuple[Any, ...]) -> str:
    return hashlib.sha256(repr(graph_key).encode()).hexdigest()[:32]


def _shapes_id(shapes: Shapes) -> str:
    return json.dumps([list(s) for s in shapes])


def _parse(doc: Any) -> dict[str, dict[str, Shapes]]:
    """The file's graphs as ``{graph id: {input shapes id: output shapes}}``; ValueError if it is malformed."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("graphs"), dict):
        raise ValueError("not a recorded-shapes file of this version")
    graphs: dict[str, dict[str, Shapes]] = {}
    for graph, pairs in doc["graphs"].items():
        entries: dict[str, Shapes] = {}
        for inputs, outputs in pairs:
            entries[_shapes_id(_shapes(inputs))] = _shapes(outputs)
        graphs[str(graph)] = entries
    return graphs


def _shapes(value: Any) -> Shapes:
    if not isinstance(value, list) or not all(isinstance(s, list) for s in value):
        raise ValueError(f"a shape list was expected, got {type(value).__name__}")
    shapes = tuple(tuple(s) for s in value)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for s in shapes for n in s):
        raise ValueError("a shape holds something other than sizes")
    return shapes
