"""What tuning costs: wall time and peak RSS of a first run, a second run and a run resumed after kill -9.

    python benchmarks/tuning_cost.py [--workloads demo_cnn,demo_encoder] [--kill-after 0.5] [--out FILE.md]
                                     [--executor process|inline|ray]

Each run is a fresh process tuning one demo model (``torch_tweak.demo``) with the default strategy
(``HighestThroughputStrategy`` over every backend available here):

* first: an empty cache folder;
* second: the same cache folder again (results reused, only the chosen candidate built again);
* resumed: an empty cache folder, the process killed with SIGKILL after ``--kill-after`` times the first
  run's wall time, then tuned again in that folder (only what had not finished is built).

Ratios are against the first run measured in the same invocation (machines here are noisy). Each row
also names the chosen backend, so a faster run that chose worse shows. The CPU model, ISA flags and the
executor head the output.

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

ROOT = Path(__file__).resolve().parent.parent
RAY_ADDRESS = "TUNING_COST_RAY_ADDRESS"  # the local cluster's address, for the tuning processes
WORKLOADS = ("demo_cnn", "demo_encoder")


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

    tt.config.cache_dir = cache
    start = time.perf_counter()
    if workload == "demo_cnn":
        model, data = small_cnn()
        data, sizes = data * 2, [1, 2, 4]
    else:
        model, data = small_encoder()
        sizes = [1, 2]
    wrapped = tt.Module(model, name=workload, strategy=tt.HighestThroughputStrategy())
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


def serve(workload: str, cache: str) -> None:
    """Load the checkpoint the first run saved into a fresh model and run it: the serving process's peak RSS."""
    import torch

    import torch_tweak.torch as tt
    from torch_tweak.demo import small_cnn
    from torch_tweak.tiny_models import small_encoder

    model, data = small_cnn() if workload == "demo_cnn" else small_encoder()
    loaded = tt.load(model, Path(cache) / f"{workload}.tt", trust_native_code=True)
    from torch_tweak.torch.dataset import dataset_items, iter_batches

    with torch.no_grad():
        for args, kwargs in iter_batches(dataset_items(data), 1):
            loaded(*args, **kwargs)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _run(workload: str, cache: str, executor: str, kill_after: float | None = None) -> dict | None:
    command = [sys.executable, __file__, "--child", workload, cache, executor]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return None
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{workload}: the tuning process failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _serve(workload: str, cache: str) -> dict:
    command = [sys.executable, __file__, "--serve", workload, cache]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"{workload}: the serving process failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cpu() -> str:
    from torch_tweak.torch.environment import cpu_info, isa_flags

    info = cpu_info()
    flags = [f for f in (isa_flags() or []) if f.startswith(("avx512", "amx", "avx_vnni"))]
    return f"{info.model}; ISA: {', '.join(flags) or 'no AVX-512/AMX'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "CACHE", "EXECUTOR"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, metavar=("WORKLOAD", "CACHE"), help=argparse.SUPPRESS)
    parser.add_argument("--executor", choices=("process", "inline", "ray"), default="process",
                        help="where candidates are built and measured (ray: a local cluster started here)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--kill-after", type=float, default=0.5, help="fraction of the first run before SIGKILL")
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
    lines = [f"CPU: {_cpu()}; executor: {executor}; load average at start {os.getloadavg()[0]:.1f}", "",
             "| workload | run | wall s | x first | tuning process peak RSS MB | worker peak RSS MB | reused rows | "
             "chosen (throughput) |",
             "|---|---|---|---|---|---|---|---|"]
    for workload in args.workloads.split(","):
        with tempfile.TemporaryDirectory() as first_cache, tempfile.TemporaryDirectory() as resumed_cache:
            first = _run(workload, first_cache, args.executor)
            serving = _serve(workload, first_cache)
            second = _run(workload, first_cache, args.executor)
            _run(workload, resumed_cache, args.executor, kill_after=first["wall_s"] * args.kill_after)
            resumed = _run(workload, resumed_cache, args.executor)
        for name, result in (("first", first), ("second", second), ("resumed after kill", resumed)):
            lines.append(f"| {workload} | {name} | {result['wall_s']:.1f} | {result['wall_s'] / first['wall_s']:.2f} | "
                         f"{result['peak_rss_mb']:.0f} | {result['worker_rss_mb']:.0f} | "
                         f"{result['reused']}/{result['candidates']} | "
                         f"{result['chosen']} ({result['chosen_throughput'] or 0:,.0f}/s) |")
        lines.append(f"| {workload} | serving (tt.load of the first run's checkpoint, 4 calls) | | | "
                     f"{serving['peak_rss_mb']:.0f} | | | |")
    lines.append(f"\nload average at end {os.getloadavg()[0]:.1f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
