"""Runner: Triton Model Navigator 0.14 on CPU (run with the Python of ``.peer_envs/navigator``).

    python run_navigator.py --system navigator --workload W --phase {tune,load,dispatch} ...

``nav.torch.optimize`` exports TorchScript, ExportedProgram and ONNX, checks correctness and profiles
the CPU runners (TorchCPU, TorchScriptCPU, TorchCompileCPU, TorchExportedProgramCPU, OnnxCPU); the
runner its ``MaxThroughputStrategy`` picks is then timed through ``runner.infer`` on numpy inputs. With
a CPU-only torch the Torch runners call ``torch.cuda.synchronize()`` while profiling and fail there, so
the record lists each runner's status and which ones navigator could measure. Profiling keeps
navigator's stability rules but uses windows of 10 requests (default 25) and the common tuning batch
sizes, to fit the time budget. ``load``: a fresh process loads the saved ``.nav`` package and runs one inference.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import common  # noqa: E402

WINDOW = 10  # requests per profiling window (navigator's default of 25 does not fit the time budget)
RUNNERS = ("TorchCPU", "TorchScriptCPU", "TorchCompileCPU", "TorchExportedProgramCPU", "OnnxCPU")


def _setup():
    import model_navigator as nav
    import torch

    record["import_s"] = time.perf_counter() - START
    torch.set_num_threads(2)
    return torch, nav


def _runner(nav, package):
    runner = package.get_runner(strategies=[nav.MaxThroughputStrategy()], include_source=False, device="cpu",
                                return_type=nav.TensorType.NUMPY)
    runner.activate()
    return runner, list(runner.input_metadata.keys())[0], list(runner.output_metadata.keys())[0]


def _statuses(package) -> tuple[list[str], list[str]]:
    """Per model/runner command statuses, and the runners whose performance navigator measured."""
    rows, measured = [], []
    for model_key, model_status in package.status.models_status.items():
        for runner_name, runner_status in model_status.runners_status.items():
            parts = {str(getattr(k, "value", k)): str(getattr(v, "value", v)) for k, v in runner_status.status.items()}
            rows.append(f"{model_key}/{runner_name}: " + ", ".join(f"{k}={v}" for k, v in parts.items()))
            if any("Performance" in k and v == "OK" for k, v in parts.items()):
                measured.append(f"{model_key}/{runner_name}")
    return rows, measured


def tune() -> None:
    """optimize (timed), save, pick, check and measure."""
    torch, nav = _setup()
    from peers import workloads

    model = workloads.build(args.workload, args.run_dir / f"{args.workload}.weights.pt")
    inputs = workloads.load_inputs(args.run_dir, args.workload)
    sizes = [int(b) for b in args.tune_batches.split(",")]
    samples = inputs["tune"]
    dataloader = [samples[: min(b, len(samples))] if b <= len(samples) else samples.repeat(b // len(samples) + 1,
                  *[1] * (samples.dim() - 1))[:b] for b in sizes]
    profile = nav.OptimizationProfile(max_batch_size=max(sizes), batch_sizes=sizes, window_size=WINDOW)
    t0 = time.perf_counter()
    package = nav.torch.optimize(model, dataloader=dataloader, target_device=nav.DeviceKind.CPU, runners=RUNNERS,
                                 optimization_profile=profile, workspace=args.artifact / "workspace")
    record["tune_s"] = time.perf_counter() - t0
    record["candidates"], record["measured_runners"] = _statuses(package)
    t0 = time.perf_counter()
    nav.package.save(package, args.artifact / "model.nav", override=True)
    record["save_s"] = time.perf_counter() - t0
    runner, name, out_name = _runner(nav, package)
    record["selected"] = type(runner).__name__
    refs = torch.load(args.run_dir / f"{args.workload}.ref.pt", weights_only=True)
    batches = [int(b) for b in args.batches.split(",")]
    feeds = {b: {name: inputs[str(b)].numpy()} for b in batches}
    for b in batches:
        out = runner.infer(feeds[b])[out_name]
        record["batches"][str(b)] = {"fidelity": common.fidelity(torch.from_numpy(out), refs[str(b)])}
    record["task"] = common.task_check(args.run_dir, args.workload, lambda x: runner.infer({name: x})[out_name],
                                       numpy_io=True)
    time.sleep(1.0)
    for b in batches:
        feed = feeds[b]
        record["batches"][str(b)].update(common.time_calls(lambda feed=feed: runner.infer(feed), b, args.reps,
                                                           args.rep_time))


def load() -> None:
    """Fresh process: load the .nav package, get the selected runner, first inference."""
    import numpy as np

    torch, nav = _setup()
    x = np.load(args.run_dir / f"{args.workload}.inputs.npz")["b1"]
    t0 = time.perf_counter()
    package = nav.package.load(args.artifact / "model.nav", workspace=args.artifact / "load_workspace")
    runner, name, _ = _runner(nav, package)
    runner.infer({name: x})
    record["load_s"] = time.perf_counter() - t0
    record["first_output_s"] = time.perf_counter() - START
    record["selected"] = type(runner).__name__


def dispatch() -> None:
    """navigator's ONNX Runtime runner vs an onnxruntime session on the same ONNX file."""
    import onnxruntime as ort

    torch, nav = _setup()
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    profile = nav.OptimizationProfile(max_batch_size=2, batch_sizes=[1, 2], window_size=WINDOW)
    package = nav.torch.optimize(model, dataloader=[torch.randn(1, 16), torch.randn(2, 16)],
                                 target_device=nav.DeviceKind.CPU, runners=("OnnxCPU",), target_formats=("onnx",),
                                 optimization_profile=profile, workspace=args.artifact / "workspace")
    runner, name, _ = _runner(nav, package)
    onnx_files = sorted((args.artifact / "workspace").rglob("*.onnx"))
    session = ort.InferenceSession(str(onnx_files[0]), providers=["CPUExecutionProvider"])
    x = torch.randn(1, 16).numpy()
    feed = {name: x}
    timings = common.compare_calls(lambda: session.run(None, feed), lambda: runner.infer(feed), args.reps, args.rep_time)
    record["dispatch"] = {**timings,
                          "raw_what": "an onnxruntime InferenceSession on navigator's ONNX file (default options)",
                          "backend": type(runner).__name__}



if __name__ == "__main__":  # guard: some peers start worker processes that re-import __main__
    args = common.parse_args(__doc__.splitlines()[0])
    record = common.new_record(args)
    common.run_guarded(record, args.out, {"tune": tune, "load": load, "dispatch": dispatch}[args.phase])
