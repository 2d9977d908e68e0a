"""BatchRouterBackend: one graph served by several built backends, each for a range of batch sizes.

No single backend is fastest at every batch size: OpenVINO's THROUGHPUT hint splits a large batch across
parallel streams but leaves a batch of one on a single core, where the LATENCY hint uses them all. A
measuring strategy that sees the best overall candidate beaten at some batch sizes assembles this
backend from the candidates it already built; it is never built from a template.

A call's batch size is read from the first batched input (a direct index for top-level arguments); a
size between two measured ones goes to the route of the smaller. Routes are saved and loaded with the
checkpoint like any backend: each route stores its backend's type and ``to_dict`` state.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from torch_tweak.errors import BackendStateError, ConfigError
from torch_tweak.torch.backend.backend import Backend, BackendState
from torch_tweak.torch.backend.registry import resolve_backend
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, flatten_sample, qualified_name
from torch_tweak.utils.hashing import hash_string

BatchReader = Callable[[tuple[Any, ...], dict[str, Any]], int]
_ARG = re.compile(r"args\[(\d+)\]")
_KWARG = re.compile(r"kwargs\['([^'\\]+)'\]")


def batch_reader(graph_spec: GraphSpec) -> BatchReader:
    """A function giving the batch size of a call of ``graph_spec`` (cheap for top-level tensor arguments)."""
    index = next((i for i, s in enumerate(graph_spec.inputs) if s.batch_multipliers), None)
    if index is None:
        raise ConfigError(f"Graph {graph_spec.name!r} has no batch axis, so its calls cannot be routed by batch size.")
    spec = graph_spec.inputs[index]
    axis, k = next(iter(spec.batch_multipliers.items()))

    def from_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        return int(flatten_sample(args, kwargs)[0][index].shape[axis]) // k

    if (match := _ARG.fullmatch(spec.locator)) is not None:
        position = int(match.group(1))
        return lambda args, kwargs: (int(args[position].shape[axis]) // k if len(args) > position
                                     else from_leaves(args, kwargs))
    if (match := _KWARG.fullmatch(spec.locator)) is not None:
        name = match.group(1)
        return lambda args, kwargs: (int(kwargs[name].shape[axis]) // k if name in kwargs
                                     else from_leaves(args, kwargs))
    return from_leaves


class BatchRouterBackend(Backend):
    """Sends each call to the backend of its batch-size range.

    Args:
        routes: ``(max_batch_size, backend)`` pairs in increasing order of ``max_batch_size`` (inclusive);
            the last one has ``None`` (no upper bound). Every backend serves the same graph and is in the
            same state (built and active, or loaded from a checkpoint).
        graph_spec: the graph the routes serve; it must have a batch axis.
    """

    # Whether inference needs the module's weights depends on the routes; a class-level question (a
    # checkpoint's list of backend classes) gets the safe answer, an instance the exact one.
    requires_original_module = True

    def __init__(self, routes: Sequence[tuple[int | None, Backend]], graph_spec: GraphSpec) -> None:
        super().__init__()
        self._routes = _checked_routes(routes)
        self._graph_spec = graph_spec
        self._batch_of = batch_reader(graph_spec)
        self._bounds = [bound for bound, _ in self._routes[:-1]]
        self._backends = [backend for _, backend in self._routes]
        self.requires_original_module = any(b.requires_original_module for b in self._backends)  # type: ignore[misc]
        states = {b.state for b in self._backends}
        if len(states) != 1 or (state := states.pop()) not in (BackendState.ACTIVE, BackendState.CHECKPOINT_LOADED):
            raise BackendStateError(
                "BatchRouterBackend routes must all be built and active, or all loaded from a checkpoint; got "
                f"states {sorted(b.state.value for b in self._backends)}."
            )
        self.state = state
        devices = {b.device for b in self._backends}
        self._device = devices.pop() if len(devices) == 1 else None

    @property
    def routes(self) -> list[tuple[int | None, Backend]]:
        """The ``(max_batch_size, backend)`` pairs, smallest range first."""
        return list(self._routes)

    def components(self) -> list[Backend]:
        """The router and every route's backend, with what those delegate to (e.g. a guard's inner backend)."""
        return [self, *(c for backend in self._backends for c in backend.components())]

    def reactivates_quickly(self) -> bool:
        """True if every route's backend reactivates quickly."""
        return all(backend.reactivates_quickly() for backend in self._backends)

    @property
    def executed_precision(self) -> str:
        """The routes' precisions, ``/``-separated when they differ (``fp32/bf16``)."""
        return "/".join(dict.fromkeys(b.executed_precision for b in self._backends))

    def backend_for(self, batch_size: int) -> Backend:
        """The backend a call of ``batch_size`` samples goes to."""
        for bound, backend in zip(self._bounds, self._backends, strict=False):
            if batch_size <= bound:
                return backend
        return self._backends[-1]

    def key(self) -> str:
        """Class name and a hash of the bounds and the routes' keys."""
        parts = [f"{bound}:{backend.key()}" for bound, backend in self._routes]
        return f"{self.__class__.__name__}_{hash_string('|'.join(parts))}"

    def describe(self) -> str:
        """``BatchRouterBackend(batch<=3: A(), batch>=4: B())``."""
        parts, low = [], 1
        for bound, backend in self._routes:
            where = f"batch>={low}" if bound is None else f"batch<={bound}" if low == 1 else f"batch {low}-{bound}"
            parts.append(f"{where}: {backend.describe()}")
            low = (bound or 0) + 1
        return f"{self.__class__.__name__}({', '.join(parts)})"

    def _build(self, module: nn.Module, graph_spec: GraphSpec, data: list[Sample], cache_dir: Path) -> Backend:
        raise BackendStateError("BatchRouterBackend is assembled by a strategy from backends it has already built; "
                                "build the routes' backends and pass them to BatchRouterBackend(routes, graph_spec).")

    def _activate(self) -> None:
        for backend in self._backends:
            backend.activate()

    def _deactivate(self) -> None:
        for backend in self._backends:
            backend.deactivate()

    def _deploy(self) -> None:
        for backend in self._backends:
            backend.deploy(self._device)

    def _infer(self, *args: Any, **kwargs: Any) -> Any:
        try:
            batch = self._batch_of(args, kwargs)
        except (AttributeError, IndexError, KeyError, TypeError):  # not the recorded structure: the route says why
            return self._backends[-1].infer(*args, **kwargs)
        return self.backend_for(batch).infer(*args, **kwargs)

    def _serving(self) -> Callable[..., Any]:
        """``_infer`` with each route's own serving function in place of its ``infer``."""
        read, last = self._batch_of, self._backends[-1].serving()
        routes = [(bound, backend.serving()) for bound, backend in zip(self._bounds, self._backends, strict=False)]

        def serve(*args: Any, **kwargs: Any) -> Any:
            try:
                batch = read(args, kwargs)
            except (AttributeError, IndexError, KeyError, TypeError):
                return last(*args, **kwargs)
            for bound, route in routes:
                if batch <= bound:
                    return route(*args, **kwargs)
            return last(*args, **kwargs)

        return serve

    def to_dict(self) -> dict[str, Any]:
        """Type, graph spec, device and, per route, its bound and its backend's type, class and state."""
        return {
            self.STATE_TYPE: self.__class__.__name__,
            self.STATE_GRAPH_SPEC: self._graph_spec.to_dict(),
            self.STATE_DEVICE: str(self._device) if self._device is not None else None,
            "routes": [{"max_batch_size": bound, "backend_type": type(backend).__name__,
                        "backend_class": qualified_name(type(backend)), "state": backend.to_dict()}
                       for bound, backend in self._routes],
        }

    @classmethod
    def from_dict(cls, module: nn.Module | None, state_dict: dict[str, Any]) -> BatchRouterBackend:
        """Recreate every route's backend with its own ``from_dict`` (state CHECKPOINT_LOADED)."""
        if state_dict.get(cls.STATE_TYPE) != cls.__name__:
            raise ValueError(f"Invalid state_dict type: {state_dict.get(cls.STATE_TYPE)}")
        stored = state_dict.get("routes")
        if not isinstance(stored, list) or not stored or not all(isinstance(r, dict) for r in stored):
            raise ValueError("BatchRouterBackend state has no list of routes.")
        routes: list[tuple[int | None, Backend]] = []
        for i, route in enumerate(stored):
            type_name, class_name = route.get("backend_type"), route.get("backend_class")
            if not isinstance(type_name, str) or not isinstance(class_name, str) or type_name == cls.__name__:
                raise ValueError(f"BatchRouterBackend route {i} names no usable backend type.")
            backend_cls = resolve_backend(type_name, class_name, f"BatchRouterBackend route {i}")
            routes.append((route.get("max_batch_size"), backend_cls.from_dict(module, route.get("state"))))
        backend = cls(routes, GraphSpec.from_dict(state_dict[cls.STATE_GRAPH_SPEC]))
        backend._set_device(state_dict.get(cls.STATE_DEVICE))
        return backend


def _checked_routes(routes: Sequence[tuple[int | None, Backend]]) -> list[tuple[int | None, Backend]]:
    checked = list(routes)
    if len(checked) < 2:
        raise ConfigError(f"BatchRouterBackend needs at least two routes, got {len(checked)}; use the backend itself.")
    previous = 0
    for i, route in enumerate(checked):
        if not (isinstance(route, tuple) and len(route) == 2 and isinstance(route[1], Backend)):
            raise ConfigError(f"BatchRouterBackend route {i} must be a (max_batch_size, Backend) pair, got {route!r}.")
        bound, backend = route
        if isinstance(backend, BatchRouterBackend):
            raise ConfigError(f"BatchRouterBackend route {i} is itself a BatchRouterBackend; merge their ranges.")
        last = i == len(checked) - 1
        if last and bound is not None:
            raise ConfigError(f"The last BatchRouterBackend route must have max_batch_size=None (no bound), got {bound!r}.")
        if not last and (isinstance(bound, bool) or not isinstance(bound, int) or bound <= previous):
            raise ConfigError(f"BatchRouterBackend route {i}: max_batch_size must be an integer greater than the "
                              f"previous route's ({previous}), got {bound!r}.")
        previous = bound if isinstance(bound, int) else previous
    return checked
