"""Runner: eager PyTorch, ``torch.compile`` (Inductor, default mode) and ``torch.compile(backend="openvino")``.

    python run_torch.py --system {eager,inductor,ov_compile} --workload W --phase {tune,load,serve} ...

``tune``: build the model, compile it (the compile and the first call at every measured batch size are
the "tuning" time), check each output against eager and the task metric on the held-out samples, then
time every batch size. The eager system also writes the reference outputs (measured batches and
held-out samples) every other system is compared with. ``load``: a fresh process that imports,
builds the model, loads the run's weights, compiles (with the compiler cache the tune phase filled, like
a restart on the same machine; ``torch.compile`` keeps no other artifact) and runs one inference.
``serve``: a fresh process builds (and compiles) the model like ``load`` and times every batch size (one
round of the driver's interleaved serving rounds).
"""

from __future__ import annotations

import time

START = time.perf_counter()

import common  # noqa: E402  (path set-up first, then the timed imports)


def _prepare() -> tuple:
    import torch

    record["import_s"] = time.perf_counter() - START
    torch.set_num_threads(2)
    from peers import workloads

    t0 = time.perf_counter()
    model = workloads.build(args.workload, args.run_dir / f"{args.workload}.weights.pt")
    record["build_s"] = time.perf_counter() - t0
    return torch, model, workloads.load_inputs(args.run_dir, args.workload)


def _compile(torch, model):
    if args.system == "eager":
        return model
    if args.system == "inductor":
        return torch.compile(model)
    if args.system == "ov_compile":
        import openvino.torch  # noqa: F401  (registers the "openvino" backend)

        return torch.compile(model, backend="openvino")
    raise SystemExit(f"unknown system {args.system}")


def tune() -> None:
    """Compile, check against eager, measure."""
    torch, model, inputs = _prepare()
    from peers import workloads

    batches = [int(b) for b in args.batches.split(",")]
    ref_path = args.run_dir / f"{args.workload}.ref.pt"
    with torch.no_grad():
        t0 = time.perf_counter()
        runner = _compile(torch, model)
        outputs = {b: runner(inputs[str(b)]) for b in batches}
        if args.system != "eager":
            record["tune_s"] = time.perf_counter() - t0
        else:
            refs = {str(b): out for b, out in outputs.items()}
            refs["eval"] = common.held_out(args.run_dir, args.workload, runner)
            if ref_path.exists():
                refs = {**torch.load(ref_path, weights_only=True), **refs}
            torch.save(refs, ref_path)
            record["eval_stats"] = common.reference_stats(workloads.TASKS[workloads.WORKLOADS[args.workload].task].kind,
                                                          refs["eval"])
        refs = torch.load(ref_path, weights_only=True)
        record["selected"] = {"eager": "eager", "inductor": "Inductor (default mode)",
                              "ov_compile": "OpenVINO torch.compile backend"}[args.system]
        for b in batches:
            entry = record["batches"].setdefault(str(b), {})
            entry["fidelity"] = common.fidelity(outputs[b], refs[str(b)])
        record["task"] = common.task_check(args.run_dir, args.workload, runner,
                                           outputs=refs["eval"] if args.system == "eager" else None)
        time.sleep(1.0)
        for b in batches:
            x = inputs[str(b)]
            record["batches"][str(b)].update(common.time_calls(lambda x=x: runner(x), b, args.reps, args.rep_time))


def load() -> None:
    """Fresh process: import, build, load weights, compile, first inference."""
    torch, model, inputs = _prepare()
    x = inputs["1"]
    with torch.no_grad():
        t0 = time.perf_counter()
        runner = _compile(torch, model)
        runner(x)
        record["load_s"] = time.perf_counter() - t0
    record["first_output_s"] = time.perf_counter() - START


def serve() -> None:
    """Fresh process: build, load weights, compile, time every batch size."""
    torch, model, inputs = _prepare()
    with torch.no_grad():
        runner = _compile(torch, model)
        for b in args.batches.split(","):
            runner(inputs[b])
        common.serve_batches(record, args, lambda b: common.time_calls(lambda: runner(inputs[str(b)]), b, args.reps,
                                                                       args.rep_time))


if __name__ == "__main__":  # guard: some peers start worker processes that re-import __main__
    args = common.parse_args(__doc__.splitlines()[0])
    record = common.new_record(args)
    common.run_guarded(record, args.out, {"tune": tune, "load": load, "serve": serve}[args.phase])
