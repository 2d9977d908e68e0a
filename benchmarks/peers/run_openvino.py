"""Runner: OpenVINO configured by hand as its documentation recommends (no torch_tweak involved).

    python run_openvino.py --system {ov_throughput,ov_latency,ov_int8_throughput,ov_int8_latency}[_torch] --workload W --phase {tune,load,serve} ...

``tune``: ``ov.convert_model`` (example input, dynamic shapes), ``ov.save_model`` (fp32 weights), then
``core.compile_model`` with ``PERFORMANCE_HINT`` THROUGHPUT or LATENCY and the model cache (``CACHE_DIR``)
switched on. THROUGHPUT is served through an ``AsyncInferQueue`` with the optimal number of parallel
infer requests (throughput = samples completed per second; latency = submit-to-callback time of each
request); LATENCY through one infer request called synchronously. OpenVINO's default precision for the
CPU is kept (bf16 where the CPU has it), so the fidelity column shows what that costs. Timing runs on
numpy inputs after a pause, with no torch call in between (torch and OpenVINO thread pools interfere).
``load``: a fresh process that never imports torch compiles the saved IR (from the model cache) and
runs one inference. ``serve``: a fresh process without torch compiles the saved IR and times every batch
size as ``tune`` does (one round of the driver's interleaved serving rounds).

The ``ov_int8_*`` systems quantize the converted model with NNCF post-training quantization
(``nncf.quantize`` with its defaults, ``model_type=TRANSFORMER`` for the encoder as NNCF's documentation
asks for transformers) on the same calibration data torch_tweak tunes with: the tuning samples (8 unless
``--tune-samples`` says otherwise), one at a time. The quantized IR is the same for both hints, so the second system of a run reuses the IR the
first one quantized (its tune time includes the first one's convert and quantize time).
"""

from __future__ import annotations

import json
import time

START = time.perf_counter()

import common  # noqa: E402  (path set-up first, then the timed imports)


def _compile(ov, source):
    core = ov.Core()
    core.set_property({"CACHE_DIR": str(args.artifact / "ov_cache")})
    compiled = core.compile_model(source, "CPU", {"PERFORMANCE_HINT": HINT})
    record["ov_config"] = {key: str(compiled.get_property(key)).replace("<Type: '", "").replace("'>", "") for key in
                           ("PERFORMANCE_HINT", "NUM_STREAMS", "OPTIMAL_NUMBER_OF_INFER_REQUESTS",
                            "INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS")}
    return compiled


def _time_async(ov, compiled, feed, batch: int) -> dict:
    """Throughput and per-request latency of an AsyncInferQueue kept full with the same input."""
    queue = ov.AsyncInferQueue(compiled)
    done: list[float] = []
    queue.set_callback(lambda request, started: done.append(time.perf_counter() - started))
    start = time.perf_counter()
    warm = 0
    while warm < 2 * len(queue) or (time.perf_counter() - start < 0.2 and warm < 60):
        queue.start_async(feed, time.perf_counter(), share_inputs=True)
        warm += 1
    queue.wait_all()
    per_request = (time.perf_counter() - start) / warm
    count = int(min(4000, max(2 * len(queue), args.rep_time / max(per_request, 1e-7))))
    p50, p99, throughput = [], [], []
    for _ in range(args.reps):
        done.clear()
        begin = time.perf_counter()
        for _ in range(count):
            queue.start_async(feed, time.perf_counter(), share_inputs=True)
        queue.wait_all()
        wall = time.perf_counter() - begin
        times = sorted(done)
        p50.append(common.percentile(times, 50) * 1e3)
        p99.append(common.percentile(times, 99) * 1e3)
        throughput.append(batch * count / wall)
    return {"calls_per_rep": count, "parallel_requests": len(queue), "p50_ms": common.summary(p50),
            "p99_ms": common.summary(p99), "throughput": common.summary(throughput)}


def tune() -> None:
    """Convert, save, compile, check against eager, measure."""
    import numpy as np
    import openvino as ov
    import torch

    torch.set_num_threads(2)
    from peers import workloads

    model = workloads.build(args.workload, args.run_dir / f"{args.workload}.weights.pt")
    inputs = workloads.load_inputs(args.run_dir, args.workload)
    refs = torch.load(args.run_dir / f"{args.workload}.ref.pt", weights_only=True)
    t0 = time.perf_counter()
    earlier_s = 0.0  # convert + quantize time of the run whose INT8 IR this one reuses
    shared = args.run_dir / "ov_int8" / args.workload
    if INT8 and (shared / "quantize.json").is_file():
        info = json.loads((shared / "quantize.json").read_text())
        ov_model = ov.Core().read_model(shared / "model.xml")
        earlier_s = info["convert_s"] + info["quantize_s"]
        record["int8"] = {**info, "reused": True}
        record["notes"].append(f"reuses the INT8 IR the {info['by']} run quantized (same model, calibration and "
                               f"settings); tune s includes its convert + quantize time ({earlier_s:.1f} s)")
    else:
        with torch.no_grad():
            ov_model = ov.convert_model(model, example_input=inputs["2"] if "2" in inputs else inputs["tune"][:2])
        if INT8:
            ov_model = _quantize(ov, ov_model, inputs, time.perf_counter() - t0, shared)
    xml = args.artifact / "model.xml"
    ov.save_model(ov_model, xml, compress_to_fp16=False)
    compiled = _compile(ov, ov_model)
    record["tune_s"] = time.perf_counter() - t0 + earlier_s
    precision = record["ov_config"]["INFERENCE_PRECISION_HINT"]
    record["selected"] = f"OpenVINO INT8 (NNCF) {HINT}, rest {precision}" if INT8 else f"OpenVINO {HINT} ({precision})"
    del model
    batches = [int(b) for b in args.batches.split(",")]
    feeds = {b: {0: np.ascontiguousarray(inputs[str(b)].numpy())} for b in batches}
    request = compiled.create_infer_request()
    for b in batches:
        out = request.infer(feeds[b])[0].copy()
        record["batches"][str(b)] = {"fidelity": common.fidelity(torch.from_numpy(out), refs[str(b)])}
    record["task"] = common.task_check(args.run_dir, args.workload, lambda x: request.infer({0: x})[0], numpy_io=True)
    time.sleep(1.0)
    for b in batches:
        record["batches"][str(b)].update(_time(ov, compiled, request, feeds[b], b))


def _time(ov, compiled, request, feed, batch: int) -> dict:
    """THROUGHPUT: an AsyncInferQueue kept full; LATENCY: ``request`` called synchronously."""
    if HINT == "THROUGHPUT":
        return _time_async(ov, compiled, feed, batch)
    return common.time_calls(lambda: request.infer(feed, share_inputs=True), batch, args.reps, args.rep_time)


def _quantize(ov, ov_model, inputs: dict, convert_s: float, shared):
    """NNCF post-training quantization on the tuning samples; the IR and its settings go to ``shared``."""
    import numpy as np

    try:
        import nncf
    except ImportError as exc:
        raise RuntimeError("nncf is not installed in this environment (pip install nncf 'torch==2.13.0')") from exc
    from peers import workloads

    calibration = [np.ascontiguousarray(sample.unsqueeze(0).numpy()) for sample in inputs["tune"]]
    options = {}
    if workloads.WORKLOADS[args.workload].task == "encoder":
        options["model_type"] = nncf.ModelType.TRANSFORMER
    t0 = time.perf_counter()
    quantized = nncf.quantize(ov_model, nncf.Dataset(calibration), subset_size=len(calibration), **options)
    info = {"by": args.system, "nncf": nncf.__version__, "convert_s": convert_s, "quantize_s": time.perf_counter() - t0,
            "calibration": f"{len(calibration)} tuning samples at batch 1", "subset_size": len(calibration),
            "options": {key: str(value) for key, value in options.items()}}
    shared.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, shared / "model.xml", compress_to_fp16=False)
    (shared / "quantize.json").write_text(json.dumps(info, indent=1))
    record["int8"] = {**info, "reused": False}
    return quantized


def load() -> None:
    """Fresh process without torch: compile the saved IR (model cache warm) and run one inference."""
    import numpy as np
    import openvino as ov

    record["import_s"] = time.perf_counter() - START
    x = np.load(args.run_dir / f"{args.workload}.inputs.npz")["b1"]
    t0 = time.perf_counter()
    compiled = _compile(ov, str(args.artifact / "model.xml"))
    compiled.create_infer_request().infer({0: x})
    record["load_s"] = time.perf_counter() - t0
    record["first_output_s"] = time.perf_counter() - START
    record["selected"] = f"OpenVINO INT8 (NNCF) {HINT}" if INT8 else f"OpenVINO {HINT}"


def serve() -> None:
    """Fresh process: compile the saved IR (model cache warm), time every batch size; without torch on a numpy array
    built once, or (``*_torch``, LATENCY) with a torch tensor converted on each call and a tensor returned."""
    import numpy as np
    import openvino as ov

    inputs = np.load(args.run_dir / f"{args.workload}.inputs.npz")
    compiled = _compile(ov, str(args.artifact / "model.xml"))
    request = compiled.create_infer_request()
    feeds = {b: {0: np.ascontiguousarray(inputs[f"b{b}"])} for b in map(int, args.batches.split(","))}
    for feed in feeds.values():
        request.infer(feed)
    if TORCH_IO:
        import torch

        tensors = {b: torch.from_numpy(feed[0]) for b, feed in feeds.items()}

        def time_batch(b: int) -> dict:
            x = tensors[b]
            call = lambda: torch.from_numpy(request.infer({0: x.numpy()}, share_inputs=True).to_tuple()[0])  # noqa: E731
            call()
            return common.time_calls(call, b, args.reps, args.rep_time)

        common.serve_batches(record, args, time_batch)
        return
    common.serve_batches(record, args, lambda b: _time(ov, compiled, request, feeds[b], b))


if __name__ == "__main__":  # guard: some peers start worker processes that re-import __main__
    args = common.parse_args(__doc__.splitlines()[0])
    record = common.new_record(args)
    TORCH_IO = args.system.endswith("_torch")
    HINT = {"ov_throughput": "THROUGHPUT", "ov_latency": "LATENCY", "ov_int8_throughput": "THROUGHPUT",
            "ov_int8_latency": "LATENCY"}[args.system.removesuffix("_torch")]
    INT8 = args.system.startswith("ov_int8")
    common.run_guarded(record, args.out, {"tune": tune, "load": load, "serve": serve}[args.phase])
