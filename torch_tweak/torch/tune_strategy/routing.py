"""Batch-size routing: where another measured candidate beats the chosen one, and which ones to keep.

The chosen candidate is the best at its own best batch size; another candidate of the same runtime may
still be faster at other batch sizes (OpenVINO LATENCY at batch 1 against THROUGHPUT at batch 32).
Routes are worked out among candidates of the chosen one's runtime: calls alternating between runtimes pay
for their competing thread pools, which single-runtime measurements never see. Routes to another runtime
(``other_runtime=``) are only proposals, which ``mixed_routes.py`` keeps when calls of mixed batch sizes
confirm them.
"""

from __future__ import annotations

from torch_tweak.torch.backend.backend import BackendState
from torch_tweak.torch.tune_strategy.results import NOISE, Evaluation

Routes = list[tuple[int | None, Evaluation]]


def _built_here(evaluation: Evaluation) -> bool:
    return evaluation.backend is not None and evaluation.backend.state == BackendState.ACTIVE


def _alive(evaluations: list[Evaluation]) -> list[Evaluation]:
    """Measured candidates that are built here, or measured elsewhere (result cache, a worker) and buildable."""
    return [e for e in evaluations if e.sweep is not None and (
        _built_here(e) or (e.reused and e.template is not None and e.pick is not None))]


def runtime_of(evaluation: Evaluation) -> str:
    built = evaluation.backend if evaluation.backend is not None else evaluation.template
    assert built is not None
    return built.runtime


def worth_keeping(evaluations: list[Evaluation], margin: float) -> list[Evaluation]:
    """Per runtime: its best candidate and those that beat it by ``margin`` at a batch size where they lead.

    A candidate dropped here can still be the fastest of its runtime at some batch size, but by less than
    ``margin`` over that runtime's best: serving that batch size with the best instead loses less than
    the margin, and the strategy does not keep every candidate's memory alive for it.
    """
    by_runtime: dict[str, list[Evaluation]] = {}
    for e in _alive(evaluations):
        by_runtime.setdefault(runtime_of(e), []).append(e)
    keep: list[Evaluation] = []
    for group in by_runtime.values():
        best = max(group, key=lambda e: e.pick.throughput if e.pick is not None else -1.0)
        keep.append(best)
        assert best.sweep is not None
        for m in best.sweep.measurements:
            faster = [(e, e.sweep.at(m.batch_size)) for e in group if e is not best and e.sweep is not None]
            top = max(((e, r) for e, r in faster if r is not None), key=lambda p: p[1].throughput, default=None)
            if top is not None and top[1].throughput >= margin * m.throughput and all(top[0] is not k for k in keep):
                keep.append(top[0])
    return keep


def route_margin(rival: Evaluation, margin: float, chosen: Evaluation | None = None) -> float:
    """How many times the chosen candidate's throughput ``rival`` needs at a batch size to serve it.

    ``margin`` when serving it costs no compile: it is built in this process already, or building it again
    reuses the files its measured build left (:attr:`~torch_tweak.torch.backend.Backend.rebuilds_from_files`).
    A compiler's candidate measured in a worker compiles again here (Inductor on a BERT-base: tens of seconds and
    hundreds of MB), so it needs at least :data:`~.results.NOISE`: a gain the machine's noise could erase does
    not pay for that. So does a rival of another runtime than ``chosen``: serving it keeps a second runtime's copy
    of the weights and thread pool, and tuning confirms it on mixed calls with both built in the tuning process
    (a ResNet-50 on 2 cores: 10 s and +900 MB of peak RSS for ONNX Runtime and OpenVINO at batch 32, where the
    sweeps promised 5 % and two runs of the same tune came to opposite verdicts).
    """
    same_runtime = chosen is None or runtime_of(rival) == runtime_of(chosen)
    if same_runtime and (_built_here(rival) or (rival.template is not None and type(rival.template).rebuilds_from_files)):
        return margin
    return max(margin, NOISE)


def batch_routes(chosen: Evaluation, evaluations: list[Evaluation], margin: float,
                 other_runtime: str | None = None, refused: frozenset[tuple[int, int]] = frozenset()) -> Routes | None:
    """``(max_batch_size, evaluation)`` ranges, or None when the chosen candidate should serve every batch size.

    At each batch size the chosen candidate measured, a candidate of its runtime (or of ``other_runtime``) that
    measured the same batch size takes over when its throughput is at least :func:`route_margin` times the chosen
    one's (and the highest such), unless ``(id(candidate), batch size)`` is in ``refused`` (it lost that size when
    timed in turns). A batch size between two measured ones goes with the smaller; the last range is open.
    """
    if chosen.sweep is None or (chosen.backend is None and not chosen.reused):
        return None
    own = {m.batch_size: m.throughput for m in chosen.sweep.measurements if m.batched}
    sizes = sorted(own)
    if len(sizes) < 2:
        return None
    rivals = [e for e in _alive(evaluations)
              if e is not chosen and runtime_of(e) in (runtime_of(chosen), other_runtime)]
    assignment: list[Evaluation] = []
    for size in sizes:
        pick, speed = chosen, own[size]
        for rival in rivals:
            assert rival.sweep is not None
            if (id(rival), size) in refused:
                continue
            m = rival.sweep.at(size)
            if m is not None and m.throughput >= route_margin(rival, margin, chosen) * own[size] and m.throughput > speed:
                pick, speed = rival, m.throughput
        assignment.append(pick)
    if all(a is chosen for a in assignment):
        return None
    routes: Routes = []
    for i, evaluation in enumerate(assignment):
        if i + 1 < len(sizes) and assignment[i + 1] is evaluation:
            continue
        routes.append((sizes[i + 1] - 1 if i + 1 < len(sizes) else None, evaluation))
    return routes


def serving_of(chosen: Evaluation, routes: Routes | None) -> list[Evaluation]:
    """The candidates that serve calls: ``chosen`` alone, or each route's."""
    return [chosen] if routes is None else [e for _, e in routes]


def describe_routes(routes: Routes, chosen: Evaluation) -> str:
    """``batch sizes 1-3 go to X (24.1 vs 12.6 samples/s at batch 1; ...)`` per range ``chosen`` does not serve."""
    parts, low = [], 1
    for bound, evaluation in routes:
        if evaluation is not chosen and evaluation.sweep is not None and chosen.sweep is not None:
            span = f"size {low} goes" if bound == low else f"sizes {low}-{bound} go" if bound else f"sizes >={low} go"
            speeds = []
            for m in evaluation.sweep.measurements:
                mine = chosen.sweep.at(m.batch_size)
                if mine is not None and m.batch_size >= low and (bound is None or m.batch_size <= bound):
                    speeds.append(f"{m.throughput:.1f} vs {mine.throughput:.1f} samples/s at batch {m.batch_size}")
            parts.append(f"batch {span} to {evaluation.row.backend} ({'; '.join(speeds)})")
        low = (bound or 0) + 1
    return "; ".join(parts)
