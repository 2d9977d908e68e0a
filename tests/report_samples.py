"""Realistic tuning reports built without tuning: measurement dicts come from the real profiling classes."""

from __future__ import annotations

import random

from torch_tweak.torch.fidelity import FidelityResult
from torch_tweak.torch.profiling import Measurement, SweepResult
from torch_tweak.torch.report import CandidateReport, GraphReport, ModuleReport, TuningReport
from torch_tweak.torch.report.environment import collect_environment
from torch_tweak.torch.tune_strategy.results import selection_dict


def measurements(overhead_ms: float, per_sample_ms: float, batch_sizes=(1, 2, 4, 8), calls: int = 60, seed: int = 0,
                 metric: str = "throughput") -> dict:
    """A sweep dict as written by the measuring strategies: per batch size runs with raw per-call times."""
    rng = random.Random(seed)
    runs = []
    for b in batch_sizes:
        base = overhead_ms + per_sample_ms * b
        times = [base * (1 + abs(rng.gauss(0, 0.04))) for _ in range(calls)]
        runs.append(Measurement(b, times, [base * 3, base * 1.5], True, "stable", sum(times) / 1000, True, 0.03))
    sweep = SweepResult(runs, "completed")
    pick = sweep.best() if metric == "throughput" else runs[0]
    data = sweep.to_dict()
    data["selection"] = selection_dict(metric, pick)
    return data


def fidelity(precision: str = "fp32", error: float = 1e-6, passed: bool = True) -> dict:
    tolerance = "atol=0.0001,rtol=0.0001" if precision == "fp32" else "max_rel_l2=0.15,min_cosine=0.99"
    return FidelityResult(passed, precision, tolerance, error, error / 3, 1 - error, "" if passed else
                          f"relative L2 error {error / 3:.3g} above 0.15").to_dict()


def candidate(backend: str, status: str, *, role: str = "candidate", precision: str = "fp32", error: str | None = None,
              timing: tuple[float, float] | None = None, fid: dict | None = None, seed: int = 0,
              metric: str = "throughput") -> CandidateReport:
    key = backend.split("(")[0] + "_" + "0" * 8
    return CandidateReport(
        backend=backend, key=key, status=status, precision=precision if status != "build_failed" else None,
        build_time_s=1.25, fidelity=fid, error=error, log_path=f"/cache/m/0/{key}/build.log", role=role,
        measurements=measurements(*timing, seed=seed, metric=metric) if timing else None)


def sample_report() -> TuningReport:
    """Two tuned modules (throughput and latency strategies) and one that fell back to its original code."""
    encoder = GraphReport(
        name="0", strategy="HighestThroughputStrategy(OpenVINOBackend(), TorchInductorBackend(), TorchAOBackend())",
        chosen="OpenVINOBackend()", reason="2412.0 samples/s at batch 8, 2.50x eager's throughput",
        candidates=[
            candidate("TorchEagerBackend()", "passed", role="baseline", timing=(0.8, 0.9), fid=fidelity(error=0.0)),
            candidate("OpenVINOBackend()", "chosen", timing=(0.3, 0.35), fid=fidelity(error=2e-6), seed=1),
            candidate("TorchInductorBackend()", "passed", timing=(0.5, 0.6), fid=fidelity(error=8e-7), seed=2),
            candidate("TorchAOBackend()", "rejected", precision="int8", fid=fidelity("int8", 0.9, passed=False),
                      error="FidelityError: relative L2 error 0.3 above 0.15 <int8>"),
            candidate("OpenVINOBackend(performance_hint=THROUGHPUT)", "build_failed",
                      error="BuildError: conversion failed\nsecond line of the traceback"),
        ])
    head = GraphReport(
        name="0", strategy="LowestLatencyStrategy(TorchInductorBackend())", chosen="TorchInductorBackend()",
        reason="p50 0.100 ms at batch 1, 1.60x eager's p50 latency",
        candidates=[
            candidate("TorchEagerBackend()", "passed", role="baseline", timing=(0.15, 0.01), fid=fidelity(error=0.0),
                      metric="p50 latency"),
            candidate("TorchInductorBackend()", "chosen", timing=(0.09, 0.01), fid=fidelity(error=3e-7), seed=3,
                      metric="p50 latency"),
        ])
    for c in head.candidates:  # the latency strategy measures one batch size
        c.measurements = {**c.measurements, "runs": c.measurements["runs"][:1], "batch_sizes": [1]}
    return TuningReport(
        modules=[ModuleReport("text_encoder", "tuned", graphs=[encoder]), ModuleReport("head", "tuned", graphs=[head]),
                 ModuleReport("vae", "passthrough", "TuningError: no candidate could be built")],
        device="cpu", batch_sizes=[1, 2, 4, 8], duration_s=42.5, environment=collect_environment(),
        created="2026-01-01T00:00:00+00:00")
