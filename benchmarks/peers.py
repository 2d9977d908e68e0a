"""torch_tweak against the tools users would pick instead, in one run on this machine, with the same inputs.

    python benchmarks/peers.py --quick    # ~25 min on a quiet machine: all systems on the MLP; CNNs, encoder at batch 1
    python benchmarks/peers.py --full     # every workload and batch size, fresh compiler caches, more repetitions

Systems: eager PyTorch; ``torch.compile`` (Inductor); ``torch.compile(backend="openvino")``; OpenVINO set up by
hand for throughput (THROUGHPUT hint, AsyncInferQueue) and for latency (LATENCY hint, one request), in its
default precision and quantized to INT8 with NNCF on the tuning samples; ONNX Runtime set up by hand
(``torch.onnx.export``, CPU provider); NVIDIA AITune 0.6 and Triton Model Navigator 0.14, each in its own
virtual environment under ``benchmarks/.peer_envs/`` (built on first use, reused afterwards); torch_tweak's
``tt.tune`` with ``HighestThroughputStrategy`` over every available backend, its checkpoint after
``tt.save`` -> ``tt.load`` in a fresh process, and (``--tt-task-metric``) ``tt.tune`` with the workload's task
bound as its fidelity check. Workloads: a ResNet-50-shaped CNN at 224x224 with batch-norm statistics
calibrated on image-like inputs, the same CNN with random weights on noise (worst case for reduced
precision), a BERT-base-shaped encoder at sequence 128 and a small MLP, all with random weights (see
``peers/workloads.py``). Every system is judged by the element-wise error against eager and by a task
metric on held-out inputs. Every measurement runs in its own process (see ``benchmarks/peers/``); the
tables go to ``benchmarks/results/peers_<mode>.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers import envs, report, serve  # noqa: E402
from peers.systems import BY_KEY, MODES, SYSTEMS, Mode, System  # noqa: E402
from peers.workloads import WORKLOADS  # noqa: E402

RUN_DIR = HERE / ".peer_envs" / "run"
CACHE_DIR = HERE / ".peer_envs" / "cache"


def log(message: str) -> None:
    """One progress line on stdout with the time and the machine's load."""
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:4.1f}] {message}", flush=True)


def uptime(when: str, into: list[dict[str, str]]) -> None:
    """Append the output of ``uptime`` (load averages over 1, 5 and 15 min) to ``into``."""
    try:
        text = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        load = os.getloadavg()
        text = f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"
    into.append({"when": when, "time": time.strftime("%H:%M:%S"), "uptime": text})


def task_metric_supported() -> tuple[bool, str]:
    """Whether the installed torch_tweak's ``FidelityConfig`` takes ``metric`` (checked in a subprocess)."""
    code = ("import inspect, torch_tweak.torch as tt; s = inspect.signature(tt.FidelityConfig); "
            "print('metric' in s.parameters); print(s)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        return False, f"import failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    return lines[0] == "True", f"FidelityConfig{lines[1] if len(lines) > 1 else ''}"


class Driver:
    """Runs the runner scripts in subprocesses and collects their records."""

    def __init__(self, mode: Mode, python: dict[str, Path | None], env_errors: dict[str, str]) -> None:
        self.mode = mode
        self.python = python
        self.env_errors = env_errors
        self.processes: list[dict[str, Any]] = []

    def _env(self, system: System, workload: str) -> dict[str, str]:
        root = CACHE_DIR if not self.mode.fresh_compiler_cache else RUN_DIR / "cache"
        cache = root / "inductor" / f"{system.key.replace('_loaded', '')}_{workload}"
        return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1"}

    def run(self, system: System, workload: str, phase: str, batches: list[int], tag: str = "") -> dict[str, Any]:
        """Run one runner process; a crash, a timeout or a missing environment becomes an error record."""
        name = f"{system.key}_{workload}_{phase}{tag}"
        out = RUN_DIR / "records" / f"{name}.json"
        out.unlink(missing_ok=True)
        env_name = system.env
        python = self.python.get(env_name) if env_name else Path(sys.executable)
        base = {"system": system.key, "workload": workload, "phase": phase, "ok": False, "batches": {}, "notes": []}
        if python is None:
            return {**base, "error": self.env_errors.get(env_name or "", "environment unavailable")}
        artifact = RUN_DIR / "artifacts" / f"{system.serves or system.key.replace('_loaded', '')}_{workload}"
        artifact.mkdir(parents=True, exist_ok=True)
        command = [str(python), str(HERE / "peers" / system.runner), "--system", system.key, "--workload", workload,
                   "--phase", phase, "--run-dir", str(RUN_DIR), "--out", str(out), "--artifact", str(artifact),
                   "--reps", str({"dispatch": self.mode.dispatch_reps, "serve": 1}.get(phase, self.mode.reps)),
                   "--rep-time", str(self.mode.rep_time), "--batches", ",".join(map(str, batches)),
                   "--tune-batches", ",".join(map(str, self.mode.tune_batches.get(workload, [1, 2])))]
        log_path = RUN_DIR / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            with open(log_path, "w") as handle:
                proc = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=self._env(system, workload),
                                      timeout=self.mode.timeout_s, cwd=HERE / "peers")
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
        wall = time.perf_counter() - start
        self.processes.append({"name": name, "wall_s": wall, "exit": code})
        if out.is_file():
            record = json.loads(out.read_text())
        elif code is None:
            record = {**base, "error": f"timed out after {self.mode.timeout_s:.0f} s (log: {log_path.name})"}
        else:
            tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
            record = {**base, "error": f"process exited with {code}: {tail[0][:200] if tail else ''}"}
        status = "ok" if record.get("ok") else f"FAILED: {record.get('error')}"
        log(f"{name}: {wall:.0f} s, {status}")
        return record


def run_workload(driver: Driver, workload: str, systems: list[System]) -> dict[str, Any]:
    """Eager first (it writes the reference outputs), then every system's tune phase, then the loads."""
    batches = driver.mode.batches[workload]
    results: dict[str, Any] = {}
    eager = driver.run(BY_KEY["eager"], workload, "tune", batches)
    results["eager"] = {"tune": eager, "loads": []}
    if not eager.get("ok"):
        return results
    systems = [s for s in systems if s.key not in driver.mode.skip.get(workload, ())]
    for system in systems:
        if system.key in ("eager", "tt_loaded") or system.serves:
            continue
        results[system.key] = {"tune": driver.run(system, workload, "tune", batches), "loads": []}
    for system in systems:
        tuned = results.get(system.key.replace("_loaded", ""), {}).get("tune", {})
        if system.key == "tt_loaded" and "tt" in results:
            record = driver.run(system, workload, "load", batches) if tuned.get("ok") else {
                "system": "tt_loaded", "workload": workload, "ok": False, "batches": {}, "error": "tt.tune failed"}
            results["tt_loaded"] = {"tune": record, "loads": []}
            results["tt"]["loads"].append(record)
        if not system.load or not tuned.get("ok"):
            continue
        for i in range(driver.mode.load_reps - (1 if system.key == "tt" else 0)):
            load_system = BY_KEY["tt_loaded"] if system.key == "tt" else system
            results[system.key]["loads"].append(driver.run(load_system, workload, "load", [], tag=f"_{i}"))
    serve.run_rounds(driver, workload, results, driver.mode.serve_rounds, log)
    return results


def _earlier_run(args: argparse.Namespace, mode: Mode) -> tuple[Path, dict[str, Any], list[str]]:
    """The mode's result file, its records, and the asked-for workloads it holds, after checking that ``RUN_DIR``
    still holds that run (same eager records, inputs and references)."""
    path = args.out_dir / f"peers_{mode.name}.json"
    old = json.loads(path.read_text())
    if args.tune_samples != old["meta"]["settings"].get("tune_samples", 8):
        raise SystemExit(f"{path} was run with --tune-samples {old['meta']['settings'].get('tune_samples', 8)}; "
                         "--add and --serve-only reuse that run's inputs, so pass the same number (or run anew)")
    workloads = [w for w in old["records"] if w in args.workloads.split(",")]
    for workload in workloads:
        eager = RUN_DIR / "records" / f"eager_{workload}_tune.json"
        same = eager.is_file() and json.loads(eager.read_text()).get("started") == \
            old["records"][workload]["eager"]["tune"].get("started")
        if not same or not (RUN_DIR / f"{workload}.ref.pt").is_file():
            raise SystemExit(f"{RUN_DIR} no longer holds the run behind {path} (workload {workload}); run it anew")
    return path, old, workloads


def add_rounds(args: argparse.Namespace, mode: Mode, loads: list[dict[str, str]], start: float) -> None:
    """Run the interleaved serving rounds (``peers/serve.py``) again on the artifacts of the mode's existing result
    file, replacing its earlier rounds; noted in the tables' header like ``--add``."""
    path, old, workloads = _earlier_run(args, mode)
    driver = Driver(mode, {}, {})
    for workload in workloads:
        uptime(f"before {workload}", loads)
        serve.run_rounds(driver, workload, old["records"][workload], mode.serve_rounds, log)
    uptime("end", loads)
    _rewrite(old, mode, path, {"command": " ".join(["python", "benchmarks/peers.py", *sys.argv[1:]]),
                               "date": time.strftime("%Y-%m-%d %H:%M %Z"), "wall_s": time.perf_counter() - start,
                               "systems": ["serving rounds"], "workloads": workloads, "uptime": loads,
                               "processes": driver.processes})


def _rewrite(old: dict[str, Any], mode: Mode, path: Path, addition: dict[str, Any]) -> None:
    """Note ``addition`` in the result file's meta, assemble it again and write its JSON and Markdown."""
    meta = old["meta"]
    meta.setdefault("additions", []).append(addition)
    data = report.assemble(meta, mode, old["dispatch"], old["records"])
    path.write_text(json.dumps(data, indent=1, default=str))
    path.with_suffix(".md").write_text(report.markdown(data))
    print(report.markdown(data))
    log(f"done in {addition['wall_s']:.0f} s: {path}, {path.with_suffix('.md')}")


def add_systems(args: argparse.Namespace, mode: Mode, systems: list[System], loads: list[dict[str, str]],
                start: float) -> None:
    """Run ``systems`` on the workloads of the mode's existing result file, in that run's folder, and add their
    records to the file (a system already there is replaced); the additions are listed in the tables' header."""
    path, old, workloads = _earlier_run(args, mode)
    python: dict[str, Path | None] = {}
    env_errors: dict[str, str] = {}
    for name in sorted({s.env for s in systems if s.env}):
        env = envs.ensure(name)
        python[name] = env.python
        if env.error:
            env_errors[name] = env.error
    driver = Driver(mode, python, env_errors)
    log(f"adding {', '.join(s.key for s in systems)} to {path.name} ({', '.join(workloads)}); {loads[0]['uptime']}")
    for workload in workloads:
        uptime(f"before {workload}", loads)
        entries = old["records"][workload]
        batches = mode.batches[workload]
        for system in systems:
            if system.key in mode.skip.get(workload, ()) or system.serves:
                continue
            if system.key == "tt_loaded":
                if not entries.get("tt", {}).get("tune", {}).get("ok"):
                    continue
                record = driver.run(system, workload, "load", batches)
                entries["tt_loaded"] = {"tune": record, "loads": []}
                tt_loads = entries["tt"].setdefault("loads", [])
                first = next((i for i, r in enumerate(tt_loads) if r.get("system") == "tt_loaded"), None)
                if first is None:
                    tt_loads.append(record)
                else:
                    tt_loads[first] = record
                continue
            entries[system.key] = {"tune": driver.run(system, workload, "tune", batches), "loads": []}
            if system.load and entries[system.key]["tune"].get("ok"):
                for i in range(mode.load_reps):
                    entries[system.key]["loads"].append(driver.run(system, workload, "load", [], tag=f"_{i}"))
        old["records"][workload] = {s.key: entries[s.key] for s in SYSTEMS if s.key in entries}
    uptime("end", loads)
    if any(s.key == "tt_task" for s in systems) and old["meta"].get("tt_task_metric"):
        old["meta"]["tt_task_metric"]["included"] = True
    _rewrite(old, mode, path, {
        "command": " ".join(["python", "benchmarks/peers.py", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "wall_s": time.perf_counter() - start, "systems": [s.key for s in systems], "workloads": workloads,
        "uptime": loads, "processes": driver.processes})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_const", const="quick", dest="mode", help="the default")
    group.add_argument("--full", action="store_const", const="full", dest="mode")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="subset, comma-separated")
    parser.add_argument("--systems", default=",".join(s.key for s in SYSTEMS if s.default),
                        help="subset, comma-separated (default: all but tt_task, which --tt-task-metric adds)")
    parser.add_argument("--tt-task-metric", choices=("auto", "on", "off"), default="auto",
                        help="add the row 'tt.tune with the task metric' (tt.FidelityConfig(metric=...)): auto = when "
                             "the installed torch_tweak's FidelityConfig takes metric; on = always (fails without it)")
    parser.add_argument("--tune-samples", type=int, default=8,
                        help="tuning samples every tuner and quantizer sees (default 8); more give torch_tweak more "
                             "recorded calls to calibrate int8 on and to judge candidates on held-out calls "
                             "(tt.config.max_num_calibration_samples), and OpenVINO INT8 by hand the same calibration")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--from-json", type=Path, help="only rewrite the Markdown of an earlier run's JSON")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other workloads of the mode's existing result file (re-measure a subset)")
    parser.add_argument("--add", action="store_true",
                        help="add (or redo) the given --systems in the mode's existing result file, reusing that run's "
                             "weights, inputs and eager references (benchmarks/.peer_envs/run must still be that run's)")
    parser.add_argument("--serve-rounds", type=int,
                        help="interleaved serving rounds per workload (default: 2 quick, 3 full; 0: none), see "
                             "peers/serve.py")
    parser.add_argument("--serve-only", action="store_true",
                        help="only run the serving rounds again on the artifacts of the mode's existing result file "
                             "(benchmarks/.peer_envs/run must still be that run's)")
    args = parser.parse_args()
    if args.tune_samples < 1:
        parser.error("--tune-samples must be at least 1")
    if args.from_json:
        old = json.loads(args.from_json.read_text())
        data = report.assemble(old["meta"], MODES[old["meta"]["mode"]], old["dispatch"], old["records"])
        args.from_json.write_text(json.dumps(data, indent=1, default=str))
        args.from_json.with_suffix(".md").write_text(report.markdown(data))
        print(report.markdown(data))
        return
    mode = MODES[args.mode or "quick"]
    if args.serve_rounds is not None:
        if args.serve_rounds < 0:
            parser.error("--serve-rounds must be 0 or more")
        mode = dataclasses.replace(mode, serve_rounds=args.serve_rounds)
    start = time.perf_counter()
    loads: list[dict[str, str]] = []
    uptime("start", loads)
    keys = args.systems.split(",")
    supported, signature = task_metric_supported()
    task_row = {"flag": args.tt_task_metric, "supported": supported, "signature": signature}
    if "tt" in keys and "tt_task" not in keys and (args.tt_task_metric == "on" or (args.tt_task_metric == "auto"
                                                                                    and supported)):
        keys.insert(keys.index("tt") + 1, "tt_task")
    if args.tt_task_metric == "off":
        keys = [k for k in keys if k != "tt_task"]
    task_row["included"] = "tt_task" in keys
    wanted = sorted((BY_KEY[k] for k in keys), key=SYSTEMS.index)
    if "eager" not in [s.key for s in wanted]:
        wanted.insert(0, BY_KEY["eager"])
    if args.serve_only:
        add_rounds(args, mode, loads, start)
        return
    if args.add:
        add_systems(args, mode, [s for s in wanted if s.key != "eager" or "eager" in keys], loads, start)
        return
    log(f"mode {mode.name}; workloads {args.workloads}; {os.cpu_count()} CPUs; {loads[0]['uptime']}")
    log(f"row 'tt.tune with the task metric': {'included' if task_row['included'] else 'left out'} "
        f"(--tt-task-metric {args.tt_task_metric}; FidelityConfig "
        f"{'takes metric' if supported else 'takes no metric: ' + signature})")
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    python: dict[str, Path | None] = {}
    env_errors: dict[str, str] = {}
    env_info: dict[str, Any] = {}
    for name in sorted({s.env for s in wanted if s.env}):
        log(f"peer environment {name}: checking (built on first use, a few minutes)")
        env = envs.ensure(name)
        python[name], env_info[name] = env.python, {"built_now": env.built_now, "build_s": env.build_s,
                                                      "error": env.error}
        if env.error:
            env_errors[name] = env.error
        log(f"peer environment {name}: {'ready' if env.python else env.error}"
            + (f" (built in {env.build_s:.0f} s)" if env.built_now else ""))
    driver = Driver(mode, python, env_errors)
    dispatch = {s.key: driver.run(s, "tiny", "dispatch", []) for s in wanted if s.dispatch}
    results = {}
    for workload in args.workloads.split(","):
        uptime(f"before {workload}", loads)
        log(f"workload {workload}: preparing weights and inputs ({loads[-1]['uptime']})")
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); from pathlib import "
                        f"Path; from peers import workloads; workloads.prepare(Path({str(RUN_DIR)!r}), {workload!r}, "
                        f"{args.tune_samples})"],
                       check=True, env={**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"},
                       stderr=subprocess.DEVNULL)
        results[workload] = run_workload(driver, workload, wanted)
    meta = report.environment(mode, time.perf_counter() - start, " ".join(["python", "benchmarks/peers.py",
                                                                          *sys.argv[1:]]))
    uptime("end", loads)
    meta.update({"peer_envs": env_info, "processes": driver.processes, "uptime": loads, "tt_task_metric": task_row})
    meta["settings"]["tune_samples"] = args.tune_samples
    previous = args.out_dir / f"peers_{mode.name}.json"
    origin = {"command": meta["command"], "date": meta["date"], "wall_s": meta["wall_s"]}
    meta["origins"] = dict.fromkeys(results, origin)
    if args.merge and previous.is_file():
        old = json.loads(previous.read_text())
        kept = [w for w in old["records"] if w not in results]
        earlier = {"command": old["meta"]["command"], "date": old["meta"]["date"], "wall_s": old["meta"]["wall_s"]}
        meta["origins"] = {**{w: old["meta"].get("origins", {}).get(w, earlier) for w in kept}, **meta["origins"]}
        results = {**{w: old["records"][w] for w in kept}, **results}
        results = {w: results[w] for w in WORKLOADS if w in results}
    data = report.assemble(meta, mode, dispatch, results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"peers_{mode.name}"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    markdown = report.markdown(data)
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    log(f"done in {time.perf_counter() - start:.0f} s: {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
