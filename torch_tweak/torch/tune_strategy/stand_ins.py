"""Candidates that another measured candidate stands in for: skipped before they are built.

Some candidates would measure again what another candidate of the same graph has measured, at a build cost of
tens of seconds (a ResNet-50 on 2 cores: TorchAO 39 s, Inductor 61 s, Inductor AOT 23 s):

* ``TorchAOBackend`` quantizes ``nn.Linear`` layers only and compiles the rest with Inductor's defaults. When the
  graph's linear layers do less than :data:`LINEAR_SHARE` of its multiply-adds (a CNN whose one linear layer is
  the classifier: 0.05 % of a ResNet-50's), it computes like ``TorchInductorBackend()`` and is skipped once that
  candidate was measured. Its default config also quantizes each call's activations, which costs more than int8
  saves on small matrices: when the graph's largest ``nn.Linear`` call, at the largest recorded batch, does fewer
  than :data:`INT8_MIN_LINEAR_MACS` multiply-adds, it is skipped before anything is measured (four ``Linear(K, K)``
  layers on 2 cores of an AVX-512 VNNI EPYC, compiled: 0.48-0.70x eager from 65 k to 1.6 M multiply-adds per
  call, 1.19-3.07x from 4.2 M up; the demo's encoder, 0.4 M, spent 15-34 s building it for 0.26x). Where it is
  built (the worker; also before its background build), a copy of that largest layer quantized with its config is
  timed against the float layer first, and TorchAO is skipped when int8 is :data:`INT8_PROBE_SLOWDOWN` times
  slower: CPUs without int8 dot-product instructions (AVX2) run its int8 matrix multiply 25x slower than float.
  Once a calibrated int8 candidate of the graph (next point) passed its check and was measured, TorchAO's default
  is skipped too: it quantizes the same layers but computes the activations' scales on every call, and Inductor
  runs the rest; it never ran faster than that candidate in our benchmarks (:data:`STATIC_INT8_LEAD`), and on a
  BERT-base its compile was 72 of 113 s of tuning. Its background build is stopped as soon as that is known
  (:meth:`StandIns.drop_stood_in`), not in its turn.
* A calibrated int8 candidate (OpenVINO's ``quantization="int8"``, and its THROUGHPUT twin) spends tens of seconds
  in NNCF (a BERT-base: 33-38 s on 2 cores). On a graph whose ``nn.Linear`` layers do most of the multiply-adds
  (:data:`LINEAR_DOMINANT`), where it is built, its largest linear call is first compiled in float and quantized by
  NNCF alone (``OpenVINOBackend.int8_layer_calls``) and the two are timed in turns; when int8 takes longer
  (:data:`CALIBRATED_INT8_SLOWDOWN`), as on CPUs without VNNI or AMX, the candidate is skipped; on CPUs with them,
  only when int8 takes longer by more than a re-measurement's noise (:data:`CALIBRATED_INT8_SLOWDOWN_WITH_DOT`).
* ``TorchInductorBackend`` and ``TorchInductorAOTBackend`` compile the graph with the same compiler into the same
  kernels; they differ in per-call overhead (Dynamo's guards), which matters at small batches only. When one
  was screened out (below ``1 - screening_margin`` of the best at both screening ends, the large one included),
  the other is skipped. Inductor AOT is also skipped when Inductor JIT's calls, made shorter by more than its
  whole per-call overhead (:data:`JIT_OVERHEAD_MS`), would still lag the best candidate by more than a
  re-measurement moves (:data:`~.results.NOISE`) at every batch size measured: a ResNet-50 whose JIT build ran
  at 0.7x ONNX Runtime's throughput spent 28 s building its AOT twin for 0.7x.
* Inductor (JIT and AOT, default settings) leaves a graph's matrix multiplies, convolutions and attention to the
  oneDNN / BLAS kernels eager calls (:data:`~.graph_probes.HEAVY_KERNELS`) and can only shorten the rest. Their share of an eager
  call, timed on the smallest recorded call (``graph_probes.kernel_time``: kernels and whole calls in turns, so
  that a busy machine slows both), bounds its speed-up: even with those kernels :data:`KERNEL_GAIN` (the measurement noise)
  times faster and everything else free, a candidate that would stay below the best candidate's throughput at
  every measured batch size (so it could neither be chosen nor take a batch size in a route) is not built. A
  BERT-base whose int8 OpenVINO candidate ran 7x eager spent 37-49 s compiling Inductor for 0.7-1.1x eager; a
  ResNet-50 on Sapphire Rapids, whose bound reached 0.8-0.9x OpenVINO f32, built Inductor for 54-63 s and waited
  20-25 s for it, at 0.59-0.85x the best in all 16 results under ``benchmarks/results`` (until 2026-12-06 the bound
  skipped only below what screening keeps, half the best). With freezing or autotuning switched on in Inductor's
  process-wide config, no bound applies.

* ONNX Runtime's dynamic int8 quantizes ``nn.Linear`` layers only: below :data:`LINEAR_SHARE` it is skipped once
  its float configuration, which runs the rest alike, was measured.

* A candidate that runs on fewer threads than the runtime would use (OpenVINO's ``num_threads=1``, ONNX Runtime's
  ``intra_op_num_threads=1``) is skipped on what its every-core twin did (:func:`~.twins.thread_limited_reason`).

Turn order: candidates take their turns cheapest build first, but TorchAO goes before Inductor (JIT and AOT) on a
graph whose ``nn.Linear`` layers do at least :data:`LINEAR_SHARE` of the multiply-adds (:meth:`StandIns._turn_order`).
No measurement can skip TorchAO there, while Inductor's kernel bound often skips it once the others are measured;
and the background worker builds ahead in turn order. A BERT-base spent 48 s building Inductor ahead, which its
turn then skipped (eager's kernels took 91 % of a call), while TorchAO's build waited behind it, and the main worker
then waited 48 s for TorchAO (its tuning, from empty compiler caches and back to back: 149 s before, 130 s after).
On a CNN (its classifier does 0.05 % of a ResNet-50's multiply-adds) Inductor goes first, as TorchAO is skipped
once Inductor was measured. Inductor also keeps its turn first where a calibrated int8 candidate comes earlier on a CPU
with VNNI or AMX (:func:`_calibrated_int8_ahead`): once measured, that candidate skips TorchAO, whose background build
then only held up Inductor's queued behind it, and Inductor was built in its turn (an MLP 256-512-256 on a Sapphire
Rapids, from empty compiler caches: 26.2-26.4 s of tuning against 25.9-29.4 s, TorchAO's build dropped before it
started; a BERT-base, whose kernel bound skips Inductor, 148 against 146 s).

A skipped candidate is a ``skipped`` row naming what stood in for it. ``skip_stand_ins=False`` on a measuring
strategy builds every candidate, in cost order.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch_tweak.torch.backend.backend import Backend
from torch_tweak.torch.environment import int8_dot_saturates
from torch_tweak.torch.report.report import CandidateReport
from torch_tweak.torch.report.status import CandidateStatus
from torch_tweak.torch.tune_strategy.base import GraphTask, describe_task
from torch_tweak.torch.tune_strategy.graph_probes import probe, probed_kernel_time, probed_linear_share
from torch_tweak.torch.tune_strategy.linear_calls import (
    int8_layer_slowdown,
    largest_linear_call,
)
from torch_tweak.torch.tune_strategy.results import BASELINE, NOISE, Evaluation
from torch_tweak.torch.tune_strategy.screening import best_at_ends
from torch_tweak.torch.tune_strategy.twins import thread_limited_reason

if TYPE_CHECKING:
    from torch_tweak.torch.tune_strategy.ahead import BuildsAhead

logger = logging.getLogger(__name__)

#: Below this share of a graph's multiply-adds in ``nn.Linear`` layers, quantizing them cannot change its speed.
LINEAR_SHARE = 0.01
#: Below this many multiply-adds in a graph's largest ``nn.Linear`` call, TorchAO's int8 with per-call activation
#: quantization runs slower than eager (measured from 65 k to 1.6 M; faster from 4.2 M).
INT8_MIN_LINEAR_MACS = 2_000_000
#: TorchAO's default int8 is skipped when its uncompiled quantized copy of the graph's largest ``nn.Linear`` call
#: takes more than this many times as long as the float layer: compiling fuses the activation quantization around
#: the int8 matrix multiply but calls the same int8 kernel. Without int8 dot-product instructions (AVX2, no VNNI)
#: that kernel is slow: on 2 cores of an AVX2 EPYC a 1024x768 -> 3072 call took 28x the float one uncompiled and
#: 27x compiled, and a BERT-base compiled by TorchAO ran at 0.04x the best candidate after 290 s of building.
INT8_PROBE_SLOWDOWN = 4.0
#: A calibrated int8 candidate (OpenVINO's ``quantization="int8"``) is probed on graphs whose ``nn.Linear`` layers do
#: at least this share of the multiply-adds (transformers; a CNN's convolutions are not linear layers).
LINEAR_DOMINANT = 0.5
#: ... and skipped when its int8 copy of the graph's largest ``nn.Linear`` call, compiled as it would run, takes more
#: than this many times as long as the float copy: int8 cannot make such a graph faster. On 2 cores of an AVX2 EPYC
#: (no VNNI) BERT-base's 1024x768 -> 3072 call took 1.2-1.4x as long in int8, and the whole graph quantized by NNCF
#: (33-38 s) ran at 0.98-1.05x the float IR.
CALIBRATED_INT8_SLOWDOWN = 1.0
#: The same bound on CPUs with int8 dot-product instructions (VNNI, AMX), where int8 can win: one small layer's
#: timing is within a re-measurement's noise of the float one. On a Sapphire Rapids Xeon (AMX) an MLP's 32x256 -> 512
#: call took 1.08x as long in int8, while the whole graph quantized by NNCF ran 1.1x faster than bf16 by hand.
CALIBRATED_INT8_SLOWDOWN_WITH_DOT = NOISE
#: More than the per-call time Inductor AOT saves over Inductor JIT on the same kernels (Dynamo's guards and the
#: Python wrapper take tens of microseconds on CPU).
JIT_OVERHEAD_MS = 0.5
#: Inductor AOT is built only if dropping :data:`JIT_OVERHEAD_MS` could make Inductor JIT's measured calls this much
#: faster at some batch size (calls of 25 ms and more: not): a smaller difference is within what re-measuring the
#: same candidate moves. A BERT-base on 2 cores of an AVX2 EPYC (JIT 0.57-1.16 s per call) spent 60 s building and
#: measuring its AOT twin for 7.02/s against JIT's 6.90/s.
AOT_MIN_GAIN = 1.02
#: How much faster than eager's calls Inductor's default CPU compile may run the same kernels: it calls them as
#: eager does (weights are prepacked only with freezing, which the rule leaves alone), so what a re-measurement moves
#: (:data:`~.results.NOISE`). Measured on 2 cores of an AVX-512 VNNI EPYC, Inductor over eager: a ResNet-50 0.88x at
#: batch 1, a BERT-base 0.72x at batch 1 and 0.96x at batch 8 (with 2.0 here, that BERT's 49 s compile was skipped
#: or not from one run to the next).
KERNEL_GAIN = NOISE
#: Below this eager call time per-op timing is mostly Python overhead, which a compiler does remove: no bound.
MIN_CALL_MS = 1.0
#: What TorchAO's default int8 ran at against a calibrated int8 candidate (OpenVINO's ``quantization="int8"``) of the
#: same graph, best throughput of each, in the 26 benchmark results under ``benchmarks/results`` where both were
#: measured (MLPs, CNNs and BERT-shaped encoders on 2 cores of AVX2 and AVX-512 VNNI EPYCs and AMX Xeons): never the
#: faster one.
STATIC_INT8_LEAD = "0.06-0.79x"
_INDUCTOR, _AOT, _TORCHAO, _ORT = "TorchInductorBackend", "TorchInductorAOTBackend", "TorchAOBackend", "ONNXRuntimeBackend"


class StandIns:
    """Mixed into ``MeasuringStrategy``: the ``skipped`` row of a candidate another one stands in for."""

    skip_stand_ins: bool
    screening: bool
    screening_margin: float

    def _stand_in_row(self, template: Backend, role: str, task: GraphTask,
                      evaluations: list[Evaluation]) -> CandidateReport | None:
        if not self.skip_stand_ins:
            return None
        name = type(template).__name__
        # a candidate screened out before its check has its one measurement in its row, not a sweep
        measured = {e.template.key(): e for e in evaluations if e.template is not None
                    and (e.sweep is not None or e.row.status == CandidateStatus.SCREENED_OUT)}
        twin = template.every_core_twin()
        reason = None if twin is None else thread_limited_reason(twin, evaluations)
        if name == _TORCHAO:
            inductor = measured.get(_default_key(_INDUCTOR))
            share = probed_linear_share(task)
            if inductor is not None and share is not None and share < LINEAR_SHARE:
                reason = (f"it quantizes nn.Linear layers only, which do {share:.2%} of this graph's multiply-adds, "
                          f"and compiles the rest like {inductor.row.backend}, measured above")
            elif share is not None and share < LINEAR_SHARE and (bound := self._kernel_bound_reason(task, evaluations)):
                reason = (f"it quantizes nn.Linear layers only, which do {share:.2%} of this graph's multiply-adds, "
                          "and compiles the rest as Inductor's default compile does, which "
                          + bound.removeprefix("its default compile "))
            elif template.key() == _default_key(_TORCHAO):
                reason = self._measured_stand_in(template, task, evaluations) or _small_matrices_reason(task)
        elif name == _ORT and (fallback := template.precision_fallback()) is not None:
            while (finer := fallback.precision_fallback()) is not None:  # per-tensor int8 -> per-channel -> float
                fallback = finer
            float_model = measured.get((fallback.every_core_twin() or fallback).key())  # one-thread int8: every core
            share = probed_linear_share(task)
            if float_model is not None and share is not None and share < LINEAR_SHARE:
                reason = (f"its dynamic int8 quantizes nn.Linear layers only, which do {share:.2%} of this graph's "
                          f"multiply-adds, and runs the rest in float like {float_model.row.backend}, measured above")
        elif name in (_INDUCTOR, _AOT) and template.key() == _default_key(name):
            sibling = measured.get(_default_key(_AOT if name == _INDUCTOR else _INDUCTOR))
            if sibling is not None and sibling.row.status == CandidateStatus.SCREENED_OUT:
                reason = (f"it compiles the graph into the same kernels as {sibling.row.backend}, which was screened "
                          "out")
            elif sibling is not None and name == _AOT and (lag := aot_lag(sibling, evaluations)) is not None:
                reason = (f"it compiles the graph into the same kernels as {sibling.row.backend}, which even without "
                          f"{JIT_OVERHEAD_MS:g} ms of per-call overhead would reach only {lag} of the best "
                          f"candidate's throughput (under 1/{NOISE:g})")
            elif sibling is not None and name == _AOT and (gain := aot_gain(sibling)) is not None \
                    and gain < AOT_MIN_GAIN:
                shortest = min(m.p50_ms for m in sibling.sweep.measurements)  # type: ignore[union-attr]
                reason = (f"it compiles the graph into the same kernels as {sibling.row.backend}, whose calls took "
                          f"{shortest:,.1f} ms or more: without its {JIT_OVERHEAD_MS:g} ms of per-call overhead they "
                          f"would run at most {gain:.3f}x as fast, which no re-measurement tells apart")
            else:
                reason = self._kernel_bound_reason(task, evaluations)
        return None if reason is None else skipped_row(template, role, reason)

    def _measured_stand_in(self, template: Backend, task: GraphTask, evaluations: list[Evaluation]) -> str | None:
        """Why TorchAO's default is skipped on what other candidates measured, with no probe of the graph: a
        calibrated int8 candidate of it passed its check and was measured (None: build it)."""
        if not self.skip_stand_ins or template.key() != _default_key(_TORCHAO) or task.device.type != "cpu":
            return None
        static = [e for e in evaluations if e.template is not None and e.template.needs_calibration
                  and (e.sweep is not None or e.row.status == CandidateStatus.SCREENED_OUT)]
        if not static:
            return None
        return (f"its int8 quantizes the same nn.Linear layers as {static[0].row.backend}, measured above, but "
                "computes each call's activation scales instead of calibrating them once, and leaves the rest of the "
                f"graph to Inductor: on CPUs it ran at {STATIC_INT8_LEAD} of such a candidate's throughput wherever "
                "both were measured")

    def drop_stood_in(self, ahead: BuildsAhead | None, queue: list[tuple[Backend, str]], task: GraphTask,
                      evaluations: list[Evaluation]) -> None:
        """Drop the background builds of queued candidates a rule above already skips on what was measured, after
        each evaluation rather than in their turns (the rules only skip more as more is measured): a BERT-base's
        TorchAO compile went on for 37 s after its calibrated int8 candidate was measured, on the cores the main
        worker was using."""
        for template, role in queue if ahead is not None else ():
            if ahead.pending(template) and self._stand_in_row(template, role, task, evaluations) is not None \
                    and ahead.stop(template):
                logger.info("%s: %s will be skipped in its turn (a stand-in rule, on what was measured); its "
                            "background build was dropped", describe_task(task), template.describe())

    def _turn_order(self, templates: list[tuple[Backend, str]], task: GraphTask) -> list[tuple[Backend, str]]:
        """``templates`` (in cost order) with TorchAO's turns moved just before the first Inductor turn when the graph's
        ``nn.Linear`` layers do at least :data:`LINEAR_SHARE` of its multiply-adds, unless a calibrated int8 candidate
        will probably stand in for TorchAO first (see the module docstring)."""
        names = [type(t).__name__ for t, _ in templates]
        inductors = [i for i, name in enumerate(names) if name in (_INDUCTOR, _AOT)]
        if not self.skip_stand_ins or not inductors or all(
                i < inductors[0] for i, name in enumerate(names) if name == _TORCHAO):
            return templates
        defaults = all(t.key() == _default_key(_TORCHAO) for (t, _), n in zip(templates, names) if n == _TORCHAO)
        if defaults and _calibrated_int8_ahead(templates[:inductors[0]], task):
            return templates
        share = probed_linear_share(task)
        if share is None or share < LINEAR_SHARE:
            return templates
        torchao = [pair for pair, name in zip(templates, names, strict=True) if name == _TORCHAO]
        rest = [pair for pair, name in zip(templates, names, strict=True) if name != _TORCHAO]
        first = next(i for i, (t, _) in enumerate(rest) if type(t).__name__ in (_INDUCTOR, _AOT))
        return [*rest[:first], *torchao, *rest[first:]]

    def _probe_row(self, template: Backend, role: str, task: GraphTask) -> CandidateReport | None:
        """The ``skipped`` row of TorchAO's default when its int8 layer, timed where the candidate is built (a
        worker), runs :data:`INT8_PROBE_SLOWDOWN` times slower than the float one (None: build it)."""
        reason = self._probe_reason(template, task)
        return None if reason is None else skipped_row(template, role, reason)

    def _probe_reason(self, template: Backend, task: GraphTask) -> str | None:
        if not self.skip_stand_ins:
            return None
        if template.key() == _default_key(_TORCHAO):
            probed = _probed(template, task)
            if probed is None or probed[0] <= INT8_PROBE_SLOWDOWN:
                return None
            return (f"its int8 nn.Linear, timed on this graph's largest linear call ({probed[1]}), took "
                    f"{probed[0]:.1f}x as long as the float layer (over {INT8_PROBE_SLOWDOWN:g}x: this CPU's int8 "
                    "matrix multiply is slow, and compiling calls the same kernel), so quantizing can only slow the "
                    "graph down")
        if not template.needs_calibration:
            return None
        share = probed_linear_share(task)
        if share is None or share < LINEAR_DOMINANT:
            return None
        probed = _probed(template, task)
        bound = CALIBRATED_INT8_SLOWDOWN if int8_dot_saturates() else CALIBRATED_INT8_SLOWDOWN_WITH_DOT
        if probed is None or probed[0] <= bound:
            return None
        return (f"its int8 copy of this graph's largest nn.Linear call ({probed[1]}), built and timed as it would "
                f"run, took {probed[0]:.2f}x as long as the float one (this CPU's int8 matrix multiply is no faster "
                f"than its float one), and nn.Linear layers do {share:.0%} of the graph's multiply-adds, so "
                "quantizing cannot make the graph faster")

    def _skipped_whatever_measured(self, template: Backend, task: GraphTask) -> tuple[bool, str | None]:
        """Whether a rule above skips ``template`` in its turn whatever the other candidates measure (its background
        build would be wasted: TorchAO's default on a graph whose ``nn.Linear`` layers do too little, or whose int8
        layer is slow here), and the reason when it is final: the probe's and the small-matrices rule's depend on
        the graph and this CPU only, so the turn takes them as they are; the linear-share rule waits for Inductor's
        measurement in the turn (without one, TorchAO is built then: only the head start is lost)."""
        if not self.skip_stand_ins or template.key() != _default_key(_TORCHAO):
            return False, None
        share = probed_linear_share(task)
        if share is not None and share < LINEAR_SHARE:
            return True, None
        reason = _small_matrices_reason(task) or self._probe_reason(template, task)
        return reason is not None, reason

    def _kernel_bound_reason(self: Any, task: GraphTask, evaluations: list[Evaluation]) -> str | None:
        """Why Inductor cannot reach the best candidate at any measured batch size (None: it might)."""
        if _inductor_tuned_globally():
            return None
        eager = next((e for e in evaluations if e.role == BASELINE and e.sweep is not None), None)
        others = [e for e in evaluations if e.role != BASELINE and e.pick is not None]
        if eager is None or not others:
            return None
        sizes = [m.batch_size for m in eager.sweep.measurements]
        best = best_at_ends(others, sizes)
        if not best:
            return None
        timed = probed_kernel_time(task)
        if timed is None:
            return None
        batch, heavy_ms, call_ms = timed
        at = eager.sweep.at(batch)
        if at is None or at.p50_ms < MIN_CALL_MS or call_ms <= 0:
            return None
        share = min(1.0, heavy_ms / call_ms)
        ratios = {}
        for size, top in sorted(best.items()):
            measured = eager.sweep.at(size)
            if measured is None or not top:
                continue
            ratios[size] = measured.throughput * KERNEL_GAIN / max(share, 1e-3) / top
            if ratios[size] >= 1.0:
                return None
        if not ratios:
            return None
        shown = ", ".join(f"{r:.2f}x at batch {size}" for size, r in ratios.items())
        return (f"its default compile calls eager's matrix-multiply, convolution and attention kernels, which took "
                f"{share:.0%} of an eager call at batch {batch} ({at.p50_ms:.1f} ms measured); even with those {KERNEL_GAIN:g}x "
                f"faster and all else free it would reach at most {shown} of the best candidate's throughput, "
                "so it could neither be chosen nor serve a batch size")


def _probed(template: Backend, task: GraphTask) -> tuple[float, str] | None:
    """:func:`~.linear_calls.int8_layer_slowdown` of ``template``, once per outputs key and task (the twins of a
    probed candidate, scheduled differently, quantize the same)."""
    key = f"int8_layer:{template.outputs_key() or template.key()}"  # never stored: any value it has was measured
    return probe(task, key, lambda _: True, lambda: int8_layer_slowdown(template, task))  # type: ignore[no-any-return]


def _calibrated_int8_ahead(earlier: list[tuple[Backend, str]], task: GraphTask) -> bool:
    """Whether a calibrated int8 candidate among ``earlier`` turns will probably be measured, and so skip TorchAO's
    default config (:meth:`StandIns._measured_stand_in`; no other), before TorchAO's turn: on a CPU whose int8 dot
    products do not saturate (VNNI or AMX) its int8 layer probe seldom skips it."""
    return any(t.needs_calibration for t, _ in earlier) and task.device.type == "cpu" and not int8_dot_saturates()


def _small_matrices_reason(task: GraphTask) -> str | None:
    """Why TorchAO's default int8 cannot pay off on this graph's matrices (None: they are large enough, or none)."""
    macs = probe(task, "largest_linear_call", lambda v: isinstance(v, int), lambda: largest_linear_call(task))
    if macs is None or not 0 < macs < INT8_MIN_LINEAR_MACS:
        return None
    return (f"its int8 quantizes every call's activations, which costs more than int8 saves on matrices this small: "
            f"the largest nn.Linear call of the largest recorded batch does {macs:,} multiply-adds, under "
            f"{INT8_MIN_LINEAR_MACS:,}")


def skipped_row(template: Backend, role: str, reason: str) -> CandidateReport:
    """The ``skipped`` row of a candidate a stand-in rule skips for ``reason``."""
    row = CandidateReport(backend=template.describe(), key=template.key(), role=role, status=CandidateStatus.SKIPPED)
    row.error = f"skipped: {reason}; pass skip_stand_ins=False to the strategy to build it anyway"
    return row


def _inductor_tuned_globally() -> bool:
    """Whether Inductor's process-wide config (``torch._inductor.config``, e.g. ``TORCHINDUCTOR_FREEZING=1``) makes
    its default compile prepack weights or autotune kernels: then it does not call eager's kernels as they are."""
    from torch._inductor import config as inductor

    return bool(inductor.freezing or inductor.max_autotune or inductor.max_autotune_gemm)


def aot_gain(jit: Evaluation) -> float | None:
    """The most Inductor AOT could gain over Inductor JIT (``jit``, measured) at any batch size JIT was measured at
    by dropping :data:`JIT_OVERHEAD_MS` per call (None: not measured, or calls no longer than that overhead)."""
    if jit.sweep is None or not jit.sweep.measurements:
        return None
    calls = [m.p50_ms for m in jit.sweep.measurements]
    if min(calls) <= JIT_OVERHEAD_MS:
        return None
    return max(ms / (ms - JIT_OVERHEAD_MS) for ms in calls)


def aot_lag(jit: Evaluation, evaluations: list[Evaluation]) -> str | None:
    """How far Inductor AOT would lag the best candidate at each batch size Inductor JIT (``jit``) was measured
    at, if it ran JIT's kernels without :data:`JIT_OVERHEAD_MS` per call (``0.62x at batch 1, ...``); None when
    it could come within :data:`~.results.NOISE` of the best at one of them."""
    if jit.sweep is None or not jit.sweep.measurements:
        return None
    best = best_at_ends([e for e in evaluations if e is not jit], [m.batch_size for m in jit.sweep.measurements])
    ratios = []
    for measured in jit.sweep.measurements:
        top, shortened_ms = best.get(measured.batch_size), measured.p50_ms - JIT_OVERHEAD_MS
        if not top or shortened_ms <= 0:
            return None
        ratio = measured.batch_size / (shortened_ms / 1000.0) / top
        if ratio * NOISE >= 1.0:
            return None
        ratios.append(f"{ratio:.2f}x at batch {measured.batch_size}")
    return ", ".join(ratios)


def _default_key(name: str) -> str | None:
    """The key of backend ``name`` with its default config (None where it is not available here)."""
    from torch_tweak.torch.backend.registry import backend_class

    cls = backend_class(name)
    return cls().key() if cls is not None else None
