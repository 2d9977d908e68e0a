"""What runs inside a Ray worker process for :class:`~torch_tweak.torch.executor.ray_executor.RayExecutor`.

Why a separate module: Ray ships a remote function to its workers by reference (module and name), so the code
a worker runs must live in an importable module that does not itself import Ray at import time (``import
torch_tweak.torch.executor`` must stay free of Ray). Ray is imported here only inside the functions, which run
in a Ray worker where it is loaded already.

:func:`run_unit` is a streaming task: it first yields ``("started", node)`` (so the caller knows where and when
the unit began: the time limit counts from there, and a node of another hardware class is refused before it
measures), then ``("done", value)`` or ``("error", traceback)``. The tuning context arrives as the bytes
``torch_tweak`` pickled in the caller, fetched from Ray's object store on first use and kept unpickled per
worker process, so a graph's module and samples cross the network once per node, not once per candidate.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import socket
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

#: Unpickled contexts of this worker process: ``"<caller>:<object id>"`` -> context (one per caller).
_contexts: OrderedDict[str, Any] = OrderedDict()
_node: dict[str, Any] | None = None


def hardware_class(cpu: str | None, isa: list[str] | None) -> str:
    """A short stable name of a CPU fingerprint (model and ISA flags): nodes with the same one measure alike."""
    text = json.dumps([cpu, isa], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def node_info() -> dict[str, Any]:
    """This node as the caller reports it: Ray node id, host, IP, CPU model, ISA flags and hardware class."""
    global _node
    if _node is None:
        import ray

        from torch_tweak.torch.environment import cpu_info, isa_flags

        cpu, isa = cpu_info().model, isa_flags()
        _node = {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                 "ip": ray.util.get_node_ip_address(), "cpu": cpu, "isa": isa, "class": hardware_class(cpu, isa)}
    return {**_node, "pid": os.getpid()}


def _context(refs: list[Any], key: str) -> Any:
    context = _contexts.get(key)
    if context is None:
        import ray

        caller = key.partition(":")[0]
        for old in [k for k in _contexts if k.startswith(caller + ":")]:  # a caller tunes one graph at a time
            del _contexts[old]
        context = pickle.loads(ray.get(refs[0]))
        _contexts[key] = context
        while len(_contexts) > 4:  # several callers sharing this worker: keep the most recent few
            _contexts.popitem(last=False)
    return context


def run_unit(refs: list[Any], key: str, fn: Callable[..., Any], args: tuple[Any, ...],
             num_threads: int) -> Iterator[tuple[str, Any]]:
    """Run ``fn(context, *args)`` with ``num_threads`` torch threads (Ray sets one per CPU it grants)."""
    yield "started", node_info()
    try:
        import torch

        torch.set_num_threads(num_threads)
        context = _context(refs, key)
        value = fn(context, *args)
    except BaseException:  # noqa: BLE001 - any escape is reported as data, the worker stays usable
        yield "error", traceback.format_exc()
        return
    yield "done", value


def probe() -> dict[str, Any]:
    """This node's description (run once per node when the executor connects)."""
    return node_info()
