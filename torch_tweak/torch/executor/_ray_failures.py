"""What Ray's own failures mean for a candidate: each becomes a :class:`~torch_tweak.torch.executor.base.Failure`.

Why: a lost node, a killed worker or Ray's memory monitor must give the same report rows as a crash of a local
worker process (``crashed``, ``out_of_memory`` ...), with a message that says what happened, why and what to do,
and the run goes on with the other candidates. Ray is imported only inside the function (``ray.exceptions``).
"""

from __future__ import annotations

from typing import Any

from torch_tweak.torch.executor.base import CRASHED, ERROR, OUT_OF_MEMORY, Failure

RERUN = "tune again to evaluate it (finished candidates are reused from the result cache)"


def describe_node(node: dict[str, Any]) -> str:
    """``"pid 123 on host (10.0.0.5, class 1a2b3c4d5e)"`` for rows and messages."""
    return f"pid {node.get('pid')} on {node.get('host')} ({node.get('ip')}, class {node.get('class')})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def failure_from(exc: BaseException, label: str, worker: str) -> Failure:
    """The :class:`Failure` for a Ray exception raised while waiting for a candidate's task on ``worker``."""
    from ray import exceptions as rex

    why = f"{type(exc).__name__}: {_first_line(exc)}"
    if isinstance(exc, rex.OutOfMemoryError):
        return Failure(OUT_OF_MEMORY, (
            f"{label}: Ray's memory monitor killed its worker on {worker} because the node ran low on memory "
            f"({why}); give the nodes more memory, or raise RayExecutor(num_threads=...) so fewer candidates run "
            "at once on a node"), worker)
    if isinstance(exc, rex.TaskCancelledError):
        return Failure(CRASHED, f"{label}: its Ray task on {worker} was cancelled from outside ({why}); {RERUN}",
                       worker)
    if isinstance(exc, (rex.NodeDiedError, rex.LocalRayletDiedError)):
        return Failure(CRASHED, f"{label}: the Ray node running it ({worker}) was lost ({why}); {RERUN}", worker)
    if isinstance(exc, rex.WorkerCrashedError):
        return Failure(CRASHED, (
            f"{label}: the Ray worker process running it ({worker}) died (a crash in native code, the system's "
            f"out-of-memory killer, or killed from outside; {why}); its build log and the node's Ray worker logs "
            "say more"), worker)
    if isinstance(exc, (rex.ObjectLostError, rex.OwnerDiedError)):
        return Failure(CRASHED, f"{label}: its result on {worker} was lost with its node ({why}); {RERUN}", worker)
    if isinstance(exc, rex.TaskUnschedulableError):
        return Failure(CRASHED, (
            f"{label}: Ray could not place its task ({why}); check that the nodes of the hardware class are alive "
            "(`ray status`)"), worker)
    if isinstance(exc, rex.RayTaskError):
        return Failure(ERROR, f"{label} raised in its Ray task on {worker}: {exc}", worker)
    return Failure(CRASHED, f"{label}: Ray failed while running it on {worker} ({why}); {RERUN}", worker)
