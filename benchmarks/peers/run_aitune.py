"""Runner: NVIDIA AITune 0.6 on CPU (run with the Python of ``.peer_envs/aitune``).

    python run_aitune.py --system aitune --workload W --phase {tune,load,dispatch} ...

AITune imports TensorRT unconditionally; on this CPU-only machine a stub module stands in for
``tensorrt`` (its classes can be subclassed but never instantiated), so the TensorRT backends are
still unusable. The default strategy builds a CUDA-only backend, so the strategy is
``MaxThroughputStrategy`` over the backends that run on CPU: TorchInductor JIT, TorchAO and TorchInductor
AOT, with AITune's eager baseline and "must beat eager" gate. TorchAO uses the same settings as
torch_tweak's TorchAO default (int8 dynamic activation + int8 weight, ``torch.compile`` default mode;
AITune's own default is fp8 weight-only, which the CPU cannot run, compiled with ``max-autotune``, which
takes minutes per model on 2 cores). The AOT
backend loads its package with device index 0, which the CPU runner rejects; a one-line patch passes
-1 on CPU (``inductor_aot_patched``). Profiling uses the common tuning batch sizes and 5 timed steps
after 2 warm-up steps per batch size (AITune's default of 20 + 10 does not fit the time budget).
"""

from __future__ import annotations

import time

START = time.perf_counter()

import sys  # noqa: E402
import types  # noqa: E402

import common  # noqa: E402


def install_tensorrt_stub() -> None:
    """Put a ``tensorrt`` module into ``sys.modules`` whose attributes are inert placeholder classes."""

    class _Meta(type):
        def __getattr__(cls, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return _placeholder(f"{cls.__name__}.{name}")

    def _refuse(self, *a, **k) -> None:
        raise RuntimeError("TensorRT is not installed (CPU-only benchmark stub)")

    def _placeholder(name: str) -> type:
        return _Meta(name, (), {"__init__": _refuse})

    class _Stub(types.ModuleType):
        def __getattr__(self, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            value = _placeholder(name)
            setattr(self, name, value)
            return value

    stub = _Stub("tensorrt")
    stub.__version__ = "0.0.0-stub"
    stub.__spec__ = types.SimpleNamespace(name="tensorrt", loader=None, origin="stub", submodule_search_locations=None,
                                          parent="", has_location=False, cached=None)
    sys.modules["tensorrt"] = stub


def _setup():
    install_tensorrt_stub()
    import os

    os.environ.setdefault("AITUNE_CACHE_DIR", str(args.artifact / "aitune_cache"))
    import aitune.torch as ait
    import torch

    record["import_s"] = time.perf_counter() - START
    torch.set_num_threads(2)
    return torch, ait


def patch_aot_device_index() -> None:
    """TorchInductorAotBackend._activate passes device_index=0; the CPU AOTInductor runner needs -1."""
    import torch
    from aitune.torch.backend import torch_inductor_aot_backend as aot

    def _activate(self) -> None:
        index = -1 if self._device.type == "cpu" else (self._device.index or 0)
        self._runner = torch._inductor.aoti_load_package(str(self._compiled_model_artifact.path), device_index=index)

    aot.TorchInductorAotBackend._activate = _activate


def _strategy(ait):
    from aitune.torch.backend import (
        TorchAOBackend,
        TorchAOBackendConfig,
        TorchInductorAotBackend,
        TorchInductorJitBackend,
    )
    from aitune.torch.task.profiling import ProfilingConfig
    from aitune.torch.task.profiling.measuring_stop_strategy import NumStepsMeasuringStopStrategy

    patch_aot_device_index()
    profiling = ProfilingConfig(batch_sizes=[int(b) for b in args.tune_batches.split(",")],
                                measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=5, warmup_samples=2))
    backends = [TorchInductorJitBackend(), TorchAOBackend(TorchAOBackendConfig(quantization="int8dq", mode="default")),
                TorchInductorAotBackend()]
    return ait.MaxThroughputStrategy(backends=backends, profiling_config=profiling)


def _selected(wrapped) -> str:
    tuned = getattr(wrapped, "_self_wrapper", None)
    backends = getattr(tuned, "backends", None) or {}
    names = [type(b).__name__ for b in (backends.values() if isinstance(backends, dict) else backends)]
    return "; ".join(dict.fromkeys(names)) or f"state {getattr(wrapped, '_self_state', '?')}"


def _measure(torch, model, inputs: dict) -> None:
    refs = torch.load(args.run_dir / f"{args.workload}.ref.pt", weights_only=True)
    batches = [int(b) for b in args.batches.split(",")]
    with torch.no_grad():
        for b in batches:
            record["batches"].setdefault(str(b), {})["fidelity"] = common.fidelity(model(inputs[str(b)]), refs[str(b)])
        record["task"] = common.task_check(args.run_dir, args.workload, model)
        time.sleep(1.0)
        for b in batches:
            x = inputs[str(b)]
            record["batches"][str(b)].update(common.time_calls(lambda x=x: model(x), b, args.reps, args.rep_time))


def tune() -> None:
    """Wrap, tune (timed), save, check and measure."""
    torch, ait = _setup()
    from peers import workloads

    model = workloads.build(args.workload, args.run_dir / f"{args.workload}.weights.pt")
    inputs = workloads.load_inputs(args.run_dir, args.workload)
    strategy = _strategy(ait)
    t0 = time.perf_counter()
    wrapped = ait.Module(model, args.workload, strategy=strategy)
    ait.tune(wrapped, list(inputs["tune"].unbind(0)), batch_sizes=[int(b) for b in args.tune_batches.split(",")],
             device="cpu", ignore_failing_modules=False)
    record["tune_s"] = time.perf_counter() - t0
    record["selected"] = _selected(wrapped)
    record["candidates"] = [f"{r.backend_description}: {r.metric:.0f}/s vs eager {r.baseline_metric:.0f}/s"
                            for r in getattr(strategy, "perf_validation_results", [])]
    t0 = time.perf_counter()
    ait.save(wrapped, f"{args.workload}.ait", storage=ait.LocalTorchStorage(base_folder=args.artifact / "ckpt"))
    record["save_s"] = time.perf_counter() - t0
    _measure(torch, wrapped, inputs)


def load() -> None:
    """Fresh process: build with random weights, ait.load, first inference."""
    torch, ait = _setup()
    patch_aot_device_index()
    from peers import workloads

    t0 = time.perf_counter()
    model = workloads.build(args.workload)
    record["build_s"] = time.perf_counter() - t0
    x = workloads.load_inputs(args.run_dir, args.workload)["1"]
    t0 = time.perf_counter()
    loaded = ait.load(model, f"{args.workload}.ait", storage=ait.LocalTorchStorage(base_folder=args.artifact / "ckpt"))
    with torch.no_grad():
        loaded(x)
    record["load_s"] = time.perf_counter() - t0
    record["first_output_s"] = time.perf_counter() - START
    record["selected"] = _selected(loaded)


def dispatch() -> None:
    """ait.Module with the eager backend vs the same module called directly."""
    torch, ait = _setup()
    from aitune.torch.backend import TorchEagerBackend
    from torch import nn

    torch.manual_seed(0)
    raw = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    model.load_state_dict(raw.state_dict())
    strategy = ait.OneBackendStrategy(TorchEagerBackend())
    strategy.enable_performance_validation(False)
    wrapped = ait.Module(model, "tiny", strategy=strategy)
    ait.tune(wrapped, [torch.randn(16) for _ in range(4)], batch_sizes=[1, 2], device="cpu",
             ignore_failing_modules=False)
    x = torch.randn(1, 16)
    with torch.no_grad():
        timings = common.compare_calls(lambda: raw(x), lambda: wrapped(x), args.reps, args.rep_time)
        record["dispatch"] = {**timings,
                              "raw_what": "the nn.Module called directly", "backend": "TorchEagerBackend"}



if __name__ == "__main__":  # guard: some peers start worker processes that re-import __main__
    args = common.parse_args(__doc__.splitlines()[0])
    record = common.new_record(args)
    common.run_guarded(record, args.out, {"tune": tune, "load": load, "dispatch": dispatch}[args.phase])
