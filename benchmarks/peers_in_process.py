"""torch_tweak's loaded artifact and the one-call-at-a-time by-hand peers' artifacts, timed in one process, in turns.

    python benchmarks/peers_in_process.py [--run-dir benchmarks/.peer_envs/run] [--results FILE.json]
                                          [--workloads mlp,resnet50,bert] [--rounds 7] [--block-s 0.5] [--out FILE.md]

Why: the interleaved serving rounds of ``peers.py`` start one process per system and round, and on the shared VMs
here a process runs at one of two speeds that differ by up to 1.7x (the same loaded MLP took 21 us per call in one
process and 36 us in the next), which no number of rounds averages away between two systems that serve the same
runtime. In one process the systems share that state: this script loads, after a ``peers.py`` run, torch_tweak's
``tt.load``ed checkpoint, eager PyTorch and every by-hand peer that answers one call at a time (ONNX Runtime fp32 and
INT8, OpenVINO LATENCY default precision and INT8, each fed a numpy array built once as in their own rows, and with
torch tensors in and out) from that run's artifacts, then times blocks of calls (``--block-s`` seconds each) at every
batch size, the systems in turns with the order rotating, ``--rounds`` times. torch_tweak's ratio to the best peer
is taken within each round (adjacent blocks), then summarized. With ``--results`` (the run's JSON), peers outside the
workload's task bound are marked and left out of "best peer in bound".

The async THROUGHPUT peers keep several requests in flight, which a module call does not; they stay in the run's own
table. Timing here holds every loaded runtime in one process: the by-hand sessions' threads and torch_tweak's runtime
threads share two cores, as the serving rounds' single systems do not; a peer's block follows another system's, so
spinning worker threads of the one before (ONNX Runtime's, for a few ms) can slow the first calls of a block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: by-hand systems that answer one call at a time, and the artifact file each serves
PEERS = {"onnxruntime": "model.onnx", "onnxruntime_int8": "model.onnx", "ov_latency": "model.xml",
         "ov_int8_latency": "model.xml"}
MINE = "tt_loaded"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=HERE / ".peer_envs" / "run")
    parser.add_argument("--results", type=Path, help="the run's peers JSON: task-bound verdicts of the peers")
    parser.add_argument("--workloads", default="mlp,resnet50,bert")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block-s", type=float, default=0.5)
    parser.add_argument("--out", type=Path, help="write the markdown here too")
    return parser.parse_args()


def _within(results: dict[str, Any] | None, workload: str, key: str) -> bool | None:
    """The run's task-bound verdict of ``key`` on ``workload`` (None: no results given)."""
    from peers.serve import within_bound

    return None if results is None else within_bound(results.get("records", {}).get(workload, {}), key)


def _ort_calls(path: Path, batches: dict[int, Any]) -> dict[str, dict[int, Callable[[], Any]]]:
    import os

    import onnxruntime as ort
    import torch

    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    arrays = {b: x.numpy() for b, x in batches.items()}
    return {"": {b: (lambda a=a: session.run(None, {"input": a})) for b, a in arrays.items()},
            " torch I/O": {b: (lambda x=x: torch.from_numpy(session.run(None, {"input": x.numpy()})[0]))
                           for b, x in batches.items()}}


def _ov_calls(path: Path, batches: dict[int, Any]) -> dict[str, dict[int, Callable[[], Any]]]:
    import openvino as ov
    import torch

    compiled = ov.Core().compile_model(str(path), "CPU", {"PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    arrays = {b: x.numpy() for b, x in batches.items()}
    return {"": {b: (lambda a=a: request.infer({0: a}, share_inputs=True)) for b, a in arrays.items()},
            " torch I/O": {b: (lambda x=x: torch.from_numpy(request.infer({0: x.numpy()}, share_inputs=True)
                                                            .to_tuple()[0])) for b, x in batches.items()}}


def _systems(run_dir: Path, workload: str, batches: dict[int, Any]) -> dict[str, dict[int, Callable[[], Any]]]:
    """Every system found in the run's artifacts, as ``{name: {batch: call}}``."""
    import torch
    from peers import workloads

    import torch_tweak.torch as tt

    systems: dict[str, dict[int, Callable[[], Any]]] = {}
    eager = workloads.build(workload, run_dir / f"{workload}.weights.pt")
    systems["eager"] = {b: (lambda x=x: eager(x)) for b, x in batches.items()}
    checkpoint = run_dir / "artifacts" / f"tt_{workload}" / "model.tt"
    if checkpoint.exists():
        tt.config.progress = False
        loaded = tt.load(workloads.build(workload), checkpoint, trust_native_code=True)  # this run's own checkpoint
        systems[MINE] = {b: (lambda x=x: loaded(x)) for b, x in batches.items()}
    for key, filename in PEERS.items():
        path = run_dir / "artifacts" / f"{key}_{workload}" / filename
        if path.exists():
            variants = (_ort_calls if key.startswith("onnxruntime") else _ov_calls)(path, batches)
            systems.update({key + suffix: calls for suffix, calls in variants.items()})
    with torch.no_grad():
        for calls in systems.values():
            for call in calls.values():
                call()
    return systems


def _block(call: Callable[[], Any], batch: int, seconds: float) -> float:
    """Samples per second over a block of calls lasting about ``seconds``."""
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        call()
        calls += 1
    return calls * batch / elapsed


def measure(workload: str, args: argparse.Namespace, results: dict[str, Any] | None) -> list[str]:
    """The markdown rows of ``workload``: per batch size, each system's median samples/s and torch_tweak's ratio."""
    import torch
    from peers import workloads

    inputs = workloads.load_inputs(args.run_dir, workload)
    batches = {int(k): v for k, v in inputs.items() if k.isdigit()}
    systems = _systems(args.run_dir, workload, batches)
    names = list(systems)
    speeds: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in batches}
    with torch.no_grad():
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for b in batches:
                for name in order:
                    speeds[(name, b)].append(_block(systems[name][b], b, args.block_s))
    mark = {n: " ✗" if _within(results, workload, n.removesuffix(" torch I/O")) is False else "" for n in names}
    peers = [n for n in names if n not in ("eager", MINE) and not mark[n]]
    rows = [f"**{workload}**", "", f"| batch | {' | '.join(n + mark[n] for n in names)} | torch_tweak x best one-call "
            "peer in bound |", "|---" * (len(names) + 2) + "|"]
    for b in batches:
        cells = [f"{statistics.median(v):,.1f} ({min(v):,.1f}-{max(v):,.1f})" for v in (speeds[(n, b)] for n in names)]
        ratio = "–"
        if MINE in names and peers:
            per_round = [speeds[(MINE, b)][r] / max(speeds[(p, b)][r] for p in peers) for r in range(args.rounds)]
            best = max(peers, key=lambda p: statistics.median(speeds[(p, b)]))
            ratio = f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-{max(per_round):.2f}x; {best})"
        rows.append(f"| {b} | {' | '.join(cells)} | {ratio} |")
    return [*rows, ""]


def main() -> None:
    args = _args()
    if args.rounds < 1 or args.block_s <= 0:
        raise SystemExit("--rounds must be at least 1 and --block-s positive")
    results = json.loads(args.results.read_text()) if args.results else None
    import torch

    torch.set_num_threads(2)
    from torch_tweak.torch.environment import cpu_info, isa_flags

    lines = [f"One process, calls in turns (`benchmarks/peers_in_process.py`, {args.rounds} rounds of "
             f"{args.block_s:g} s blocks, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}): CPU "
             f"{cpu_info().model}, ISA flags {' '.join(isa_flags() or [])}. Samples/s, median (min-max) over the "
             "rounds; ✗ outside the task bound; torch_tweak's ratio to the best one-call peer in bound is taken "
             "within each round, median (min-max), with the best peer by median named.", ""]
    for workload in args.workloads.split(","):
        lines += measure(workload, args, results)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":  # guard: torch_tweak's workers re-import __main__
    main()
