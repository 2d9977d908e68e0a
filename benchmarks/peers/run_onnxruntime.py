"""Runner: ONNX Runtime set up by hand, as a user's few-line script would (no torch_tweak involved).

    python run_onnxruntime.py --system {onnxruntime,onnxruntime_int8} --workload W --phase {tune,load,serve} ...
    python run_onnxruntime.py --system {onnxruntime,onnxruntime_int8}_torch --workload W --phase serve ...

``tune``: ``torch.onnx.export`` with torch's default exporter and dynamic batch (and, for the encoder,
sequence) axes, then an ``onnxruntime.InferenceSession`` with the CPU execution provider, the default
graph optimizations (``ORT_ENABLE_ALL``) and ``intra_op_num_threads`` set to the number of cores; every
call is ``session.run`` on numpy inputs, one after another. The "tuning" time is export plus session
creation. ``load``: a fresh process that never imports torch creates the session from the saved
``.onnx`` file and runs one inference. ``serve``: a fresh process without torch creates the session from the
saved file and times every batch size (one round of the driver's interleaved serving rounds); as a ``_torch``
system (``onnxruntime_torch``, ``onnxruntime_int8_torch``) it serves its twin's file to a torch tensor,
converted on each call, and returns a tensor.

``onnxruntime_int8`` is ONNX Runtime's dynamic INT8 quantization as a user would apply it: the same export (to
a float32 file of its own), then ``onnxruntime.quantization.quantize_dynamic(fp32, "model.onnx",
weight_type=QuantType.QInt8)`` with ORT's other defaults (per-tensor weights, no ``reduce_range``, every op
type it quantizes, no calibration: activations are quantized on the fly at each call); the float32 file is
deleted, and the session, checks and timing are the float32 system's. Its "tuning" time is export plus
quantization plus session creation (``quantize_s`` on its own in the record)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

START = time.perf_counter()

import common  # noqa: E402  (path set-up first, then the timed imports)


def _session(ort, path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    record["ort_config"] = {"providers": session.get_providers(), "intra_op_num_threads": options.intra_op_num_threads,
                            "graph_optimization_level": str(options.graph_optimization_level)}
    return session


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise RuntimeError("onnxruntime is not installed in this environment "
                           "(pip install onnxruntime onnx onnxscript 'torch==2.13.0')") from exc
    return ort


def _export(model: torch.nn.Module, inputs: dict[str, Any], axes: dict[int, str], path: Path) -> None:
    """``torch.onnx.export`` as a by-hand user writes it (torch's default exporter, dynamic axes); its warnings and
    time go to the record."""
    import warnings

    import torch

    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.onnx.export(model, (inputs["2"] if "2" in inputs else inputs["tune"][:2],), str(path),
                          input_names=["input"], output_names=["output"], dynamic_axes={"input": axes})
    record["export_s"] = time.perf_counter() - t0
    record["export_warnings"] = sorted({str(w.message).splitlines()[0][:160] for w in caught})[:5]


def _quantize(fp32_path: Path, path: Path) -> None:
    """``quantize_dynamic`` with ORT's defaults but QInt8 weights, then the float32 export deleted (with its
    external-data file, if the exporter wrote one)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    t0 = time.perf_counter()
    quantize_dynamic(fp32_path, path, weight_type=QuantType.QInt8)
    record["quantize_s"] = time.perf_counter() - t0
    record["model_mb"] = {"fp32": sum(f.stat().st_size for f in fp32_path.parent.glob(f"{fp32_path.name}*")) / 2**20,
                          "int8": sum(f.stat().st_size for f in path.parent.glob(f"{path.name}*")) / 2**20}
    for leftover in fp32_path.parent.glob(f"{fp32_path.name}*"):
        leftover.unlink()


def tune() -> None:
    """Export (and, for ``onnxruntime_int8``, quantize), create the session, check against eager, measure."""
    import numpy as np
    import torch

    torch.set_num_threads(2)
    ort = _import_ort()
    from peers import workloads

    model = workloads.build(args.workload, args.run_dir / f"{args.workload}.weights.pt")
    inputs = workloads.load_inputs(args.run_dir, args.workload)
    refs = torch.load(args.run_dir / f"{args.workload}.ref.pt", weights_only=True)
    axes = {0: "batch", 1: "sequence"} if workloads.WORKLOADS[args.workload].inputs == "tokens" else {0: "batch"}
    path = args.artifact / "model.onnx"
    t0 = time.perf_counter()
    if INT8:
        fp32_path = args.artifact / "model_fp32.onnx"
        _export(model, inputs, axes, fp32_path)
        _quantize(fp32_path, path)
    else:
        _export(model, inputs, axes, path)
    session = _session(ort, path)
    record["tune_s"] = time.perf_counter() - t0
    shapes = ", ".join(f"{i.name} {i.shape}" for i in session.get_inputs())
    record["selected"] = f"ONNX Runtime {'INT8 (quantize_dynamic) ' if INT8 else ''}CPU ({shapes})"
    del model
    batches = [int(b) for b in args.batches.split(",")]
    feeds = {b: {"input": np.ascontiguousarray(inputs[str(b)].numpy())} for b in batches}
    for b in batches:
        out = session.run(None, feeds[b])[0]
        record["batches"][str(b)] = {"fidelity": common.fidelity(torch.from_numpy(out), refs[str(b)])}
    record["task"] = common.task_check(args.run_dir, args.workload, lambda x: session.run(None, {"input": x})[0],
                                       numpy_io=True)
    time.sleep(1.0)
    for b in batches:
        feed = feeds[b]
        record["batches"][str(b)].update(common.time_calls(lambda feed=feed: session.run(None, feed), b, args.reps,
                                                           args.rep_time))


def load() -> None:
    """Fresh process without torch: create the session from the saved file and run one inference."""
    import numpy as np

    ort = _import_ort()
    record["import_s"] = time.perf_counter() - START
    x = np.load(args.run_dir / f"{args.workload}.inputs.npz")["b1"]
    t0 = time.perf_counter()
    session = _session(ort, args.artifact / "model.onnx")
    session.run(None, {"input": x})
    record["load_s"] = time.perf_counter() - t0
    record["first_output_s"] = time.perf_counter() - START
    record["selected"] = "ONNX Runtime INT8 (quantize_dynamic) CPU" if INT8 else "ONNX Runtime CPU"


def serve() -> None:
    """Fresh process: the saved session, timed at every batch size; without torch on a numpy array built once
    (``onnxruntime``, ``onnxruntime_int8``), or with a torch tensor converted on each call and a tensor returned
    (their ``_torch`` twins)."""
    import numpy as np

    ort = _import_ort()
    inputs = np.load(args.run_dir / f"{args.workload}.inputs.npz")
    session = _session(ort, args.artifact / "model.onnx")
    feeds = {b: {"input": np.ascontiguousarray(inputs[f"b{b}"])} for b in map(int, args.batches.split(","))}
    if args.system.endswith("_torch"):
        import torch

        tensors = {b: torch.from_numpy(feed["input"]) for b, feed in feeds.items()}
        calls = {b: (lambda x=x: torch.from_numpy(session.run(None, {"input": x.numpy()})[0])) for b, x in tensors.items()}
    else:
        calls = {b: (lambda feed=feed: session.run(None, feed)) for b, feed in feeds.items()}
    for call in calls.values():
        call()
    common.serve_batches(record, args, lambda b: common.time_calls(calls[b], b, args.reps, args.rep_time))


if __name__ == "__main__":  # guard: some peers start worker processes that re-import __main__
    args = common.parse_args(__doc__.splitlines()[0])
    record = common.new_record(args)
    INT8 = args.system.removesuffix("_torch") == "onnxruntime_int8"
    common.run_guarded(record, args.out, {"tune": tune, "load": load, "serve": serve}[args.phase])
