"""Runner: torch_tweak ``tt.tune`` with ``HighestThroughputStrategy`` over every available backend.

    python run_tt.py --system {tt,tt_task,tt_loaded} --workload W --phase {tune,load,serve,dispatch} ...

``tune`` (systems ``tt`` and ``tt_task``): wrap the model, ``tt.tune`` it over the tuning samples at the
tuning batch sizes (timed), ``tt.save`` the result, check each output against eager (element-wise on
the measured batches, task metric on the held-out samples) and time every batch size. ``tt`` uses the
strategy's default fidelity check; ``tt_task`` passes the workload's task bound as
``FidelityConfig(metric=..., threshold=..., k=...)`` (needs a torch_tweak whose ``FidelityConfig``
takes ``metric``; otherwise the row fails with that reason).
``load`` (system ``tt_loaded``): a fresh process builds the model with random weights, ``tt.load``s the
checkpoint (``trust_native_code=True``: the run made it itself), runs one inference (timed from process
start), then checks and times like ``tune``.
``serve`` (system ``tt_loaded``): a fresh process ``tt.load``s the checkpoint and times every batch size (one
round of the driver's interleaved serving rounds).
``dispatch``: the per-call cost of the ``tt.Module`` wrapper (eager backend) over calling the module.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import common  # noqa: E402  (path set-up first, then the timed imports)


def _setup() -> tuple:
    import torch

    import torch_tweak.torch as tt

    record["import_s"] = time.perf_counter() - START
    torch.set_num_threads(2)
    tt.config.cache_dir = args.artifact / "tt_cache"
    tt.config.progress = False
    return torch, tt


def candidates() -> list:
    """The strategy's defaults (OpenVINO LATENCY and THROUGHPUT, Inductor, TorchAO, eager) plus Inductor AOT."""
    from torch_tweak.torch import backend as backends
    from torch_tweak.torch.backend import default_candidates

    templates = default_candidates()
    if backends.available("TorchInductorAOTBackend"):
        templates.insert(len(templates) - 1, backends.TorchInductorAOTBackend())
    return templates


def _strategy(tt):
    """``HighestThroughputStrategy`` over the candidates; for ``tt_task`` with the workload's task bound."""
    if args.system != "tt_task":
        return tt.HighestThroughputStrategy(candidates())
    import inspect

    from peers import workloads

    signature = inspect.signature(tt.FidelityConfig)
    if "metric" not in signature.parameters:
        raise RuntimeError(f"this torch_tweak's FidelityConfig takes no task metric yet (signature {signature})")
    settings = workloads.TASKS[workloads.WORKLOADS[args.workload].task].tt_fidelity
    record["fidelity_config"] = dict(settings)
    return tt.HighestThroughputStrategy(candidates(), fidelity=tt.FidelityConfig(**settings))


def _trust(tt) -> dict:
    """``trust_native_code=True`` where ``tt.load`` asks for it (checkpoints with compiled machine code)."""
    import inspect

    return {"trust_native_code": True} if "trust_native_code" in inspect.signature(tt.load).parameters else {}


def _measure(torch, model, inputs: dict) -> None:
    refs = torch.load(args.run_dir / f"{args.workload}.ref.pt", weights_only=True)
    batches = [int(b) for b in args.batches.split(",")]
    with torch.no_grad():
        for b in batches:
            record["batches"].setdefault(str(b), {})["fidelity"] = common.fidelity(model(inputs[str(b)]), refs[str(b)])
        record["task"] = common.task_check(args.run_dir, args.workload, model)
        time.sleep(1.0)  # let the thread pools of the runtimes used so far go idle
        for b in batches:
            x = inputs[str(b)]
            record["batches"][str(b)].update(common.time_calls(lambda x=x: model(x), b, args.reps, args.rep_time))


def _describe(report) -> None:
    chosen, notes = [], []
    for module in report.modules:
        if module.error:
            notes.append(f"module {module.name}: {module.status}: {module.error}")
        for graph in module.graphs:
            chosen.append(graph.chosen or "none")
            for row in graph.candidates:
                pick = (row.measurements or {}).get("selection") or {}
                speed = f", {pick['throughput']:.0f}/s @{pick['batch_size']}" if pick else ""
                error = f": {row.error[:120]}" if row.error else ""
                notes.append(f"{row.backend} [{row.status}{speed}]{error}")
    record["selected"] = "; ".join(dict.fromkeys(chosen))
    record["candidates"] = notes


def tune() -> None:
    """Tune, save, check and measure."""
    torch, tt = _setup()
    from peers import workloads

    model = workloads.build(args.workload, args.run_dir / f"{args.workload}.weights.pt")
    inputs = workloads.load_inputs(args.run_dir, args.workload)
    dataset = list(inputs["tune"].unbind(0))
    t0 = time.perf_counter()
    wrapped = tt.Module(model, name=args.workload, strategy=_strategy(tt))
    report = tt.tune(wrapped, dataset, batch_sizes=[int(b) for b in args.tune_batches.split(",")])
    record["tune_s"] = time.perf_counter() - t0
    _describe(report)
    report.to_json(args.artifact / "tt_report.json")
    t0 = time.perf_counter()
    tt.save(wrapped, args.artifact / "model.tt")
    record["save_s"] = time.perf_counter() - t0
    _measure(torch, wrapped, inputs)


def load() -> None:
    """Fresh process: build with random weights, tt.load, first inference, then check and measure."""
    torch, tt = _setup()
    from peers import workloads

    t0 = time.perf_counter()
    model = workloads.build(args.workload)  # random weights: the checkpoint must bring its own
    record["build_s"] = time.perf_counter() - t0
    inputs = workloads.load_inputs(args.run_dir, args.workload)
    t0 = time.perf_counter()
    # the checkpoint was made by this run's own tune process, so its native code (Inductor AOT) is trusted
    loaded = tt.load(model, args.artifact / "model.tt", **_trust(tt))
    with torch.no_grad():
        loaded(inputs["1"])
    record["load_s"] = time.perf_counter() - t0
    record["first_output_s"] = time.perf_counter() - START
    record["selected"] = "; ".join(sorted({b.describe() for b in loaded.backends.values()}))
    if args.batches:
        _measure(torch, loaded, inputs)


def serve() -> None:
    """Fresh process: tt.load the checkpoint, time every batch size."""
    torch, tt = _setup()
    from peers import workloads

    inputs = workloads.load_inputs(args.run_dir, args.workload)
    loaded = tt.load(workloads.build(args.workload), args.artifact / "model.tt", **_trust(tt))
    with torch.no_grad():
        for b in args.batches.split(","):
            loaded(inputs[b])
        common.serve_batches(record, args, lambda b: common.time_calls(lambda: loaded(inputs[str(b)]), b, args.reps,
                                                                       args.rep_time))


def dispatch() -> None:
    """tt.Module with the eager backend vs the same module called directly (blocks of calls, same runtime)."""
    torch, tt = _setup()
    from torch import nn

    from torch_tweak.torch.backend import TorchEagerBackend

    torch.manual_seed(0)
    raw = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    wrapped = tt.Module(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), name="tiny",
                        strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    wrapped.load_state_dict(raw.state_dict())
    tt.tune(wrapped, [torch.randn(16) for _ in range(4)], batch_sizes=[1, 2])
    x = torch.randn(1, 16)
    with torch.no_grad():
        timings = common.compare_calls(lambda: raw(x), lambda: wrapped(x), args.reps, args.rep_time)
        record["dispatch"] = {**timings,
                              "raw_what": "the nn.Module called directly", "backend": "TorchEagerBackend"}



if __name__ == "__main__":  # guard: some peers start worker processes that re-import __main__
    args = common.parse_args(__doc__.splitlines()[0])
    record = common.new_record(args)
    common.run_guarded(record, args.out, {"tune": tune, "load": load, "serve": serve, "dispatch": dispatch}[args.phase])
