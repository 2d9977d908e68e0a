"""What tuning costs: wall time and peak RSS of a first run, a second run and a run resumed after kill -9.

    python benchmarks/tuning_cost.py [--workloads demo_cnn,demo_encoder,mlp,resnet50,bert] [--kill-after 0.5]
                                     [--executor process|inline|ray] [--peers-json FILE.json] [--out FILE.md]

Each run is a fresh process tuning one model with ``HighestThroughputStrategy`` over every backend available
here. The demo models (``demo_cnn``, ``demo_encoder``: ``torch_tweak.demo``) use the strategy's default
candidates; the peer workloads (``mlp``, ``resnet50``, ``resnet50_random``, ``bert``: ``benchmarks/peers/workloads.py``)
are tuned exactly as ``benchmarks/peers.py --full`` tunes them (same weights recipe, the same
``--tune-samples`` tuning samples, its tuning batch sizes, its candidates: the defaults plus Inductor AOT):

* first: an empty run folder (torch_tweak's cache and Inductor's compiler cache are folders inside it, so each first run compiles
  from nothing);
* second: the same run folder again (results reused, only the chosen candidate built again);
* resumed: an empty run folder, the process killed with SIGKILL after ``--kill-after`` times the first
  run's wall time, then tuned again in that folder (only what had not finished is built).

Ratios are against the first run measured in the same invocation (machines here are noisy). Each row
also names the chosen backend, so a faster run that chose worse shows. The CPU model, ISA flags and the
executor head the output.

The tuning peers: ``--peers-json`` names a result file of ``benchmarks/peers.py`` (default: the newest
``benchmarks/results/peers_full.json``). For each peer workload a second table puts this run's first tuning
next to that file's tuning wall time and peak RSS of NVIDIA AITune, Triton Model Navigator and torch_tweak
itself (the peer harness's ``tune_s``: the tuning call alone, every system from empty compiler caches, in
one run). The target is torch_tweak's first run faster than the fastest tuning peer; the same-run pair
(torch_tweak's row of that file against the peers of that file) is what decides it, this run's first run
is shown beside it as a check. The peers tune in one process; torch_tweak's tuning process hands candidates
to a worker, whose peak RSS is the worker column here (the peer file's RSS is the tuning process alone).

``--executor ray`` starts a local Ray cluster (2 CPUs) once in this process; each tuning process connects to
it and tunes with ``RayExecutor``. On one machine this shows only what Ray adds (connecting, scheduling,
moving the module through the object store) over the process executor, never a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import cpu_description

ROOT = Path(__file__).resolve().parent.parent
RAY_ADDRESS = "TUNING_COST_RAY_ADDRESS"  # the local cluster's address, for the tuning processes
WORKLOADS = ("demo_cnn", "demo_encoder")
PEER_WORKLOADS = ("mlp", "resnet50", "resnet50_random", "bert")  # benchmarks/peers/workloads.py
PEER_RUN_DIR = "TUNING_COST_PEER_RUN_DIR"  # the folder with the peer workloads' weights and inputs
PEERS = (("aitune", "NVIDIA AITune"), ("navigator", "Model Navigator"))


def _executor(name: str) -> object:
    if name != "ray":
        return name
    from torch_tweak.torch.executor import RayExecutor

    return RayExecutor(address=os.environ[RAY_ADDRESS])


def child(workload: str, cache: str, executor: str) -> None:
    """Tune ``workload`` with ``cache`` as the cache folder; print one JSON line."""
    import torch_tweak.torch as tt
    from torch_tweak.demo import small_cnn
    from torch_tweak.tiny_models import small_encoder

    tt.config.cache_dir = os.path.join(cache, "torch_tweak")  # beside Inductor's (an import may create that one first)
    if workload in PEER_WORKLOADS:
        model, data, sizes, candidates = _peer_workload(workload)
        strategy = tt.HighestThroughputStrategy(candidates)
    elif workload == "demo_cnn":
        model, data = small_cnn()
        data, sizes = data * 2, [1, 2, 4]
        strategy = tt.HighestThroughputStrategy()
    else:
        model, data = small_encoder()
        sizes = [1, 2]
        strategy = tt.HighestThroughputStrategy()
    start = time.perf_counter()  # like the peer harness: wrapping and tuning, not building the model
    wrapped = tt.Module(model, name=workload, strategy=strategy)
    report = tt.tune(wrapped, data, batch_sizes=sizes, executor=_executor(executor))
    tuned_s = time.perf_counter() - start
    tt.save(wrapped, Path(cache) / f"{workload}.tt")
    graph = report.modules[0].graphs[0]
    rows = graph.candidates
    print(json.dumps({
        "wall_s": tuned_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # the largest finished child: the worker process of the process executor (its compile helpers aside)
        "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "chosen": graph.chosen,
        "reused": sum(1 for r in rows if r.reused),
        "candidates": len(rows),
        "chosen_throughput": next((r.throughput for r in rows if r.status == "chosen"), None),
    }))


def _peer_workload(workload: str, weights: bool = True) -> tuple:
    """A peer workload's model, tuning samples, tuning batch sizes and candidates, as benchmarks/peers.py --full has them."""
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "peers")]
    import run_tt
    from peers import systems, workloads

    run_dir = Path(os.environ[PEER_RUN_DIR])
    model = workloads.build(workload, run_dir / f"{workload}.weights.pt" if weights else None)
    data = list(workloads.load_inputs(run_dir, workload)["tune"].unbind(0))
    return model, data, systems.FULL.tune_batches[workload], run_tt.candidates()


def serve(workload: str, cache: str) -> None:
    """Load the checkpoint the first run saved into a fresh model and serve what the peers' harness serves: the
    serving process's peak RSS. A peer workload is called twice at each batch size ``benchmarks/peers.py --full``
    measures (1 and 32: a runtime's buffers for the largest batch are part of serving it), a demo model on its
    samples at batch 1."""
    import torch

    import torch_tweak.torch as tt
    from torch_tweak.demo import small_cnn
    from torch_tweak.tiny_models import small_encoder

    if workload in PEER_WORKLOADS:  # random weights: the checkpoint brings its own
        model = _peer_workload(workload, weights=False)[0]  # puts benchmarks/peers on the path too
        from peers import systems, workloads

        inputs = workloads.load_inputs(Path(os.environ[PEER_RUN_DIR]), workload)
        calls = [((inputs[str(size)],), {}) for size in systems.FULL.batches[workload] for _ in range(2)]
    else:
        from torch_tweak.torch.dataset import dataset_items, iter_batches

        model, data = small_cnn() if workload == "demo_cnn" else small_encoder()
        calls = list(iter_batches(dataset_items(data), 1))
    loaded = tt.load(model, Path(cache) / f"{workload}.tt", trust_native_code=True)
    with torch.no_grad():
        for args, kwargs in calls:
            loaded(*args, **kwargs)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _env(cache: str) -> dict[str, str]:
    """The child's environment: Inductor's compiler cache in the run's own folder, so a first run compiles
    from nothing (as a user's first tune does), a second run finds what its first run compiled, and a resumed run
    what its killed run compiled, never what another run of this script left in the machine's shared cache."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor-cache")}


def _run(workload: str, cache: str, executor: str, kill_after: float | None = None) -> dict | None:
    command = [sys.executable, __file__, "--child", workload, cache, executor]
    env = _env(cache)
    errors = tempfile.TemporaryFile(mode="w+")  # the child's stderr, shown if it fails
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return None
    out, _ = proc.communicate()
    if proc.returncode != 0:
        errors.seek(0)
        tail = "".join(errors.readlines()[-40:])
        raise SystemExit(f"{workload}: the tuning process failed ({proc.returncode}); the end of its stderr:\n{tail}")
    errors.close()
    return json.loads(out.strip().splitlines()[-1])


def serving_calls(workload: str) -> str:
    """What the serving process of ``workload`` calls (:func:`serve`), for the table."""
    if workload not in PEER_WORKLOADS:
        return "its samples at batch 1"
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "peers")]
    from peers import systems

    return "2 calls at batch " + " and ".join(map(str, systems.FULL.batches[workload]))


def _serve(workload: str, cache: str) -> dict:
    command = [sys.executable, __file__, "--serve", workload, cache]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(cache))
    if done.returncode != 0:
        raise SystemExit(f"{workload}: the serving process failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prepare_peer_workload(workload: str, run_dir: str, tune_samples: int) -> None:
    """The peer workload's weights and inputs, made the way benchmarks/peers.py makes them (in a subprocess)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); from pathlib import Path; "
            f"from peers import workloads; workloads.prepare(Path({run_dir!r}), {workload!r}, {tune_samples})")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _peer_cell(records: dict, key: str) -> tuple[float | None, str]:
    """A system's tuning seconds in a peer result file and its table cell (seconds and peak RSS, or why not)."""
    record = records.get(key, {}).get("tune")
    if record is None:
        return None, "not run"
    if not record.get("ok") or record.get("tune_s") is None:
        return None, f"failed ({(record.get('error') or '?')[:60]})"
    return record["tune_s"], f"{record['tune_s']:.1f} ({record.get('maxrss_mb', 0):.0f} MB)"


def _peer_table(path: Path, firsts: dict[str, dict]) -> list[str]:
    """This run's first tunings next to the tuning peers' (and torch_tweak's own) from a peers.py result file."""
    if not path.is_file():
        return [f"\nNo tuning peers: {path} does not exist (run benchmarks/peers.py --full first)."]
    data = json.loads(path.read_text())
    meta = data["meta"]
    lines = [f"\nTuning peers from `{path.name}` (`{meta['command']}`, {meta['date']}, CPU {meta['cpu']}, "
             f"{meta['settings'].get('tune_samples', 8)} tuning samples): tuning seconds (peak RSS of the tuning "
             "process)", "",
             "| workload | AITune | Model Navigator | torch_tweak (same run as the peers) | torch_tweak, this run's first "
             "(tuning process + worker RSS) | this run's first / fastest peer | faster than the fastest peer |",
             "|---|---|---|---|---|---|---|"]
    for workload, first in firsts.items():
        records = data["records"].get(workload)
        mine = (f"{first['wall_s']:.1f} ({first['peak_rss_mb']:.0f} + {first['worker_rss_mb']:.0f} MB)")
        if records is None:
            lines.append(f"| {workload} | not in that file | | | {mine} | | |")
            continue
        peers = [_peer_cell(records, key) for key, _ in PEERS]
        tt_cell = _peer_cell(records, "tt")[1]
        fastest = min((s for s, _ in peers if s is not None), default=None)
        ratio = f"{first['wall_s'] / fastest:.2f}x" if fastest else "–"
        met = "–" if not fastest else ("yes" if first["wall_s"] < fastest else "no")
        lines.append(f"| {workload} | {peers[0][1]} | {peers[1][1]} | {tt_cell} | {mine} | {ratio} | {met} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "CACHE", "EXECUTOR"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, metavar=("WORKLOAD", "CACHE"), help=argparse.SUPPRESS)
    parser.add_argument("--executor", choices=("process", "inline", "ray"), default="process",
                        help="where candidates are built and measured (ray: a local cluster started here)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--kill-after", type=float, default=0.5, help="fraction of the first run before SIGKILL")
    parser.add_argument("--tune-samples", type=int, default=64,
                        help="tuning samples of the peer workloads (as benchmarks/peers.py --tune-samples)")
    parser.add_argument("--peers-json", type=Path, default=ROOT / "benchmarks" / "results" / "peers_full.json",
                        help="the benchmarks/peers.py result file the tuning peers' times come from")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.serve:
        serve(*args.serve)
        return
    executor = args.executor
    if executor == "ray":
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        os.environ[RAY_ADDRESS] = ray.get_runtime_context().gcs_address
        executor = "ray (a local cluster, 2 CPUs)"
    lines = [f"CPU: {cpu_description()}; executor: {executor}; load average at start {os.getloadavg()[0]:.1f}", "",
             "| workload | run | wall s | x first | tuning process peak RSS MB | worker peak RSS MB | reused rows | "
             "chosen (throughput) |",
             "|---|---|---|---|---|---|---|---|"]
    names = args.workloads.split(",")
    unknown = [w for w in names if w not in WORKLOADS + PEER_WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS + PEER_WORKLOADS)}")
    peer_dir = tempfile.TemporaryDirectory()
    os.environ[PEER_RUN_DIR] = peer_dir.name
    firsts: dict[str, dict] = {}
    for workload in names:
        if workload in PEER_WORKLOADS:
            _prepare_peer_workload(workload, peer_dir.name, args.tune_samples)
        with tempfile.TemporaryDirectory() as first_cache, tempfile.TemporaryDirectory() as resumed_cache:
            first = _run(workload, first_cache, args.executor)
            serving = _serve(workload, first_cache)
            second = _run(workload, first_cache, args.executor)
            _run(workload, resumed_cache, args.executor, kill_after=first["wall_s"] * args.kill_after)
            resumed = _run(workload, resumed_cache, args.executor)
        firsts[workload] = first
        for name, result in (("first", first), ("second", second), ("resumed after kill", resumed)):
            lines.append(f"| {workload} | {name} | {result['wall_s']:.1f} | {result['wall_s'] / first['wall_s']:.2f} | "
                         f"{result['peak_rss_mb']:.0f} | {result['worker_rss_mb']:.0f} | "
                         f"{result['reused']}/{result['candidates']} | "
                         f"{result['chosen']} ({result['chosen_throughput'] or 0:,.0f}/s) |")
        lines.append(f"| {workload} | serving (tt.load of the first run's checkpoint, {serving_calls(workload)}) | | | "
                     f"{serving['peak_rss_mb']:.0f} | | | |")
    peer_firsts = {w: r for w, r in firsts.items() if w in PEER_WORKLOADS}
    if peer_firsts:
        lines += _peer_table(args.peers_json, peer_firsts)
    peer_dir.cleanup()
    lines.append(f"\nload average at end {os.getloadavg()[0]:.1f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
