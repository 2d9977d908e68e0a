"""The nodes of a Ray cluster as :class:`~torch_tweak.torch.executor.ray_executor.RayExecutor` sees them.

Why: measurements compare only on identical hardware, so before a tuning run uses a cluster it learns each
node's CPU model and ISA flags (one tiny task per node, placed on that node) and chooses the hardware class the
run measures on. Ray is passed in by the caller (imported there, lazily).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from torch_tweak.errors import WorkerError
from torch_tweak.torch.executor import _ray_task

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0


def probe_nodes(ray: Any, label: str | None) -> dict[str, dict[str, Any]]:
    """Ray node id -> ``{node_id, host, ip, cpu, isa, class, cpus}`` of every live node (with ``label``: every
    live node carrying that custom resource) that answers; raises :class:`WorkerError` when none does."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if label:
        alive = [n for n in alive if n.get("Resources", {}).get(label, 0) > 0]
        if not alive:
            raise WorkerError(
                f"No live node of the Ray cluster has the resource '{label}' (RayExecutor(hardware_class=...)). "
                f"Start the nodes of that class with `ray start ... --resources='{{\"{label}\": 1}}'`, or pass "
                "hardware_class=None to group nodes by CPU model and ISA flags.")
    probe = ray.remote(num_cpus=0, max_retries=0)(_ray_task.probe)
    refs = {n["NodeID"]: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote() for n in alive}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    cpus = {n["NodeID"]: int(n.get("Resources", {}).get("CPU", 0)) for n in alive}
    nodes: dict[str, dict[str, Any]] = {}
    for node_id, ref in refs.items():
        why = f"no answer within {PROBE_TIMEOUT_S:g} s"
        try:
            info = ray.get(ref) if ref in ready else None
        except ray.exceptions.RayError as exc:
            info, why = None, f"{type(exc).__name__}: {exc}"
        if info is None:
            logger.warning("Ray node %s is not used for tuning: %s", node_id, why)
            continue
        nodes[node_id] = {**info, "cpus": cpus.get(node_id, 0)}
    if not nodes:
        raise WorkerError("No node of the Ray cluster answered; check `ray status` on the head node.")
    return nodes


def choose_class(nodes: dict[str, dict[str, Any]], label: str | None) -> tuple[str, list[str] | None]:
    """The hardware class to measure on (the one with the most CPUs; ties: the first node's) and, when the nodes
    have several classes, the ids of the chosen class's nodes, to which tasks are then pinned."""
    totals: Counter[str] = Counter()
    for node in nodes.values():
        totals[node["class"]] += node["cpus"]
    chosen = max(totals, key=lambda c: totals[c])
    if len(totals) == 1:
        return chosen, None
    members = [n for n in nodes.values() if n["class"] == chosen]
    others = "; ".join(f"{c}: {next(n for n in nodes.values() if n['class'] == c)['cpu']}"
                       for c in totals if c != chosen)
    logger.warning("The Ray nodes%s have %d hardware classes; candidates run only on class %s (%s, %d node(s)), not "
                   "on the others (%s), as their measurements would not compare. Label each class with a custom "
                   "resource and pass RayExecutor(hardware_class=...) to choose.",
                   f" labelled '{label}'" if label else "", len(totals), chosen, members[0]["cpu"], len(members),
                   others)
    return chosen, [n["node_id"] for n in members]
