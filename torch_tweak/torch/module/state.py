"""The state of a ``tt.Module``, in one private object, and the small API that tuning and checkpoints use.

A ``tt.Module`` forwards attribute access to the module it wraps, so it carries one attribute of its own
(``_tt``, a :class:`ModuleInternals`) and nothing else: names added to the proxy would hide the wrapped
module's. Code outside ``torch_tweak/torch/module/`` reaches the state through :func:`internals` and its
methods only (``recorded_graphs``, ``probe_sequence_lengths``, ``mark_tuned``, ``mark_passthrough``, ``offload_weights``,
``snapshot``), never by assigning fields, so every transition keeps the fields consistent (the dispatch
table, the key settings, the recorder) and a failed ``tt.load`` can put everything back.
"""

from __future__ import annotations

import copy
import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import TuningError
from torch_tweak.torch.module import released
from torch_tweak.torch.module.forward import is_intercepted
from torch_tweak.torch.module.known_shapes import KnownShapes
from torch_tweak.torch.module.lengths import record_shorter_call
from torch_tweak.torch.module.recording import GraphRecorder, Recorder, StoreFactory
from torch_tweak.torch.module.serving import changes, serving_function
from torch_tweak.torch.module.spec import GraphSpec

logger = logging.getLogger(__name__)


class ModuleState(str, enum.Enum):
    """States of a ``tt.Module``."""

    INIT = "init"
    RECORDING = "recording"
    TUNED = "tuned"
    PASSTHROUGH = "passthrough"


@dataclass(frozen=True)
class TunedGraph:
    """One tuned graph: its spec, its dispatch key and the backend that serves it."""

    spec: GraphSpec
    key: tuple[Any, ...]
    backend: Any


class ModuleInternals:
    """Everything a ``tt.Module`` knows besides the wrapped module's own attributes."""

    def __init__(self, module: nn.Module, name: str, strategy: Any, strategies: Any, original: Callable[..., Any]):
        self.module = module
        self.name = name
        self.strategy = strategy
        self.strategies = strategies
        self.original = original
        self.interceptor: Callable[..., Any] | None = None  # the forward installed on ``module`` (set by tt.Module)
        self.status = ModuleState.INIT
        self.recorder: Recorder | None = None
        self.session_id: int | None = None
        self.graphs: list[TunedGraph] = []
        self.routes: dict[tuple[Any, ...], Any] = {}  # key → backend, derived from ``graphs`` for dispatch
        self.serving: dict[tuple[Any, ...], Callable[..., Any]] = {}  # key → serving function (see refresh_serving)
        self.serving_count = -1  # the backend state changes counted when ``serving`` was made
        self.serving_by_rank: dict[int, Callable[..., Any]] = {}  # calls of one positional tensor, by its rank
        self.offloaded = False
        self.phases = False
        self.strict_key = True
        self.checkpoint: Any = None  # keeps the folder a checkpoint was extracted to alive while backends use it
        self.unservable_logged: set[int] = set()  # backends whose refused calls were already logged
        self.tls = threading.local()

    # tuning ------------------------------------------------------------------------------------

    def recorded_graphs(self) -> list[GraphRecorder]:
        """The graphs recorded in the current tuning session; TuningError if there are none."""
        recorder = self.recorder
        if self.status is not ModuleState.RECORDING or recorder is None or not recorder.graphs:
            raise TuningError(
                f"Module {self.name!r} recorded nothing, so it cannot be tuned: tt.tune records the calls a module "
                "receives while func runs over the dataset. Check that func calls this module."
            )
        return list(recorder.graphs.values())

    def probe_sequence_lengths(self) -> None:
        """Record one more call per graph with its integer inputs' one-length axes cut to half (see
        :mod:`~torch_tweak.torch.module.lengths`); once per graph and tuning session."""
        if self.status is ModuleState.RECORDING and self.recorder is not None:
            for graph in self.recorder.graphs.values():
                record_shorter_call(graph, self.original, self.name)

    def remember_shapes(self) -> None:
        """Keep what this session's recording saw of each graph's output shapes for a later run, if it may skip calls
        (:mod:`~torch_tweak.torch.module.known_shapes`)."""
        recorder = self.recorder
        if self.status is ModuleState.RECORDING and recorder is not None and recorder.known is not None:
            recorder.known.save({key: graph.shape_map for key, graph in recorder.graphs.items()})

    def graph_count(self) -> int:
        """How many graphs the current tuning session recorded (0 if none)."""
        recorder = self.recorder
        return len(recorder.graphs) if self.status is ModuleState.RECORDING and recorder is not None else 0

    def start_recording(self, session_id: int, strict: bool, max_samples: int, phases: bool,
                        stores: StoreFactory | None = None, known: KnownShapes | None = None) -> Recorder:
        """A new recorder for the tuning session ``session_id`` (RECORDING); ``stores`` gives a graph the on-disk
        store of its extra calls (see :mod:`~torch_tweak.torch.module.sample_store`), ``known`` the output shapes
        an earlier run recorded (:mod:`~torch_tweak.torch.module.known_shapes`)."""
        self.recorder = Recorder(strict, max_samples, phases, stores, known)
        self.session_id = session_id
        self.status = ModuleState.RECORDING
        return self.recorder

    def mark_tuned(self, graphs: list[TunedGraph], checkpoint: Any = None) -> None:
        """Enter TUNED with ``graphs`` (dispatch in their order); ``checkpoint`` keeps loaded artifacts alive."""
        self.graphs = list(graphs)
        self.routes = {g.key: g.backend for g in graphs}
        self.serving, self.serving_count, self.serving_by_rank = {}, -1, {}
        self.phases = any(g.spec.phase is not None for g in graphs)
        self.strict_key = graphs[0].spec.strict if graphs else True
        self.recorder = None
        self.checkpoint = checkpoint
        self.status = ModuleState.TUNED

    def mark_passthrough(self, reason: str) -> None:
        """Run the original module from now on (the chosen backends are dropped, not deactivated; what was
        recorded stays readable through ``graph_specs``)."""
        logger.info("Module %s runs its original code: %s", self.name, reason)
        self.clear_tuning()
        self.status = ModuleState.PASSTHROUGH

    def clear_tuning(self) -> None:
        """Forget the tuned graphs and their backends (the status is the caller's to set)."""
        self.graphs, self.routes, self.serving, self.serving_count, self.serving_by_rank = [], {}, {}, -1, {}

    def refresh_serving(self) -> None:
        """Make each tuned graph's serving function again (see :mod:`.serving`) when a backend changed state since."""
        count = changes.count  # read first: a change made while the functions are made is seen at the next call
        if count != self.serving_count:
            self.serving = {key: serving_function(backend) for key, backend in self.routes.items()}
            self.serving_by_rank = {}
            self.serving_count = count

    def backends(self) -> list[Any]:
        """The chosen backend of each tuned graph."""
        return [g.backend for g in self.graphs]

    def offload_weights(self, device: str | torch.device | None) -> bool:
        """Release the wrapped module's own tensors (``"release"``, see :mod:`.released`) or move them to
        ``device`` (``tt.config.device_after_tuning``) when no chosen backend needs them; None keeps them.
        Submodules with a ``tt.Module`` of their own keep theirs. Returns whether anything changed."""
        if device is None or not self.graphs or any(b.requires_original_module for b in self.backends()):
            return False
        if device == "release":
            count = released.release(self.module, self.name, keep=is_intercepted)
            logger.info("Module %s: released %d original tensor(s) (no chosen backend needs them)", self.name, count)
        else:
            self.module.to(device)
            logger.info("Module %s: original weights moved to %s (no chosen backend needs them)", self.name, device)
        self.offloaded = True
        return True

    # checkpoints -------------------------------------------------------------------------------

    def snapshot(self) -> Callable[[], None]:
        """Remember the state; the returned function puts it back (used to roll back a failed load)."""
        saved = {k: copy.copy(v) if isinstance(v, (list, dict)) else v for k, v in vars(self).items() if k != "tls"}

        def restore() -> None:
            for key, value in saved.items():
                setattr(self, key, value)

        return restore

    def reset_after_load(self) -> None:
        """A loaded module records nothing and has its weights in place."""
        self.recorder = None
        self.offloaded = False


def internals(proxy: Any) -> ModuleInternals:
    """The state of the ``tt.Module`` ``proxy``."""
    return object.__getattribute__(proxy, "_tt")
