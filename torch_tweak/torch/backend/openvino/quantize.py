"""INT8 post-training quantization of a converted OpenVINO model with NNCF, for quantized OpenVINO candidates.

This module exists so that NNCF stays out of every path that does not build a quantized candidate: NNCF (with
scipy and scikit-learn behind it) is imported inside :func:`quantize_model` only, and a checkpoint holding a
quantized IR loads and runs with OpenVINO alone (the IR carries its quantization as ordinary operations).

Two modes (``OpenVINOBackendConfig.quantization``):

``"int8"``
    activations and weights (``nncf.quantize``): NNCF inserts quantize/dequantize pairs that OpenVINO's CPU
    plugin runs as int8 kernels (VNNI/AMX-INT8), with scales calibrated on the graph's recorded samples. On a
    CPU without VNNI or AMX (:func:`~torch_tweak.torch.environment.int8_dot_saturates`) every layer's weights
    take 7 bits (NNCF's overflow fix), as 8-bit ones saturate its int8 kernels.
``"int8_weights"``
    weights only (``nncf.compress_weights``, INT8 asymmetric, per output channel): the weights of the matrix
    multiplications and embeddings are stored as int8 and decompressed on the fly; activations keep the
    device's precision. It saves memory and bandwidth on large linear layers, not arithmetic, so convolutions
    keep float weights (decompressing them made ResNet-50 slower than bf16). Only the LATENCY hint is allowed:
    OpenVINO 2026.4's CPU plugin computes compressed weights wrongly when it runs several streams (THROUGHPUT
    hints), at random per compilation (relative error 1e2..1e7 or NaN on 1x1 convolutions and on linear layers
    with <= 32 inputs; a model right at tuning could come back wrong when a checkpoint is loaded).

Calibration: ``build`` receives the calibration data in ``data`` and NNCF calibrates on all of it; choosing it is
the strategy's job (``GraphTask.calibration_data``: the calibrating share of the graph's recorded calls, so that
the fidelity check judges calls calibration never saw). ``data`` may be a lazy sequence that loads each call from
disk: it is read one call at a time, never copied into a list. Each call is flattened to the IR's inputs in
:class:`GraphSpec` order, the order the converter gives the IR's parameters.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torch_tweak.errors import BackendUnavailableError, BuildError
from torch_tweak.torch import environment
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample, flatten_sample

logger = logging.getLogger(__name__)

INT8 = "int8"
INT8_WEIGHTS = "int8_weights"
QUANTIZATION_MODES = (INT8, INT8_WEIGHTS)
#: Operation types that mark an attention block: the graph is quantized with NNCF's transformer rules.
ATTENTION_OPS = frozenset({"Softmax", "ScaledDotProductAttention"})
#: Operation types whose weights ``"int8_weights"`` leaves in float (see the module docstring).
FLOAT_WEIGHT_OPS = ("Convolution", "GroupConvolution")
_INT_WEIGHT_TYPES = frozenset({"u8", "i8"})


def nncf_available() -> bool:
    """True when ``nncf`` can be imported (looked up without importing it)."""
    return importlib.util.find_spec("nncf") is not None


def import_nncf() -> Any:
    """Import and return ``nncf``, or raise :class:`BackendUnavailableError` saying what to install."""
    try:
        import nncf
    except ImportError as exc:
        raise BackendUnavailableError(
            "OpenVINOBackendConfig(quantization=...) needs the 'nncf' package, which is not installed. Install it "
            "with: pip install torch-tweak[nncf]; or leave quantization=None."
        ) from exc
    return nncf


def calibration_item(graph_spec: GraphSpec, sample: Sample, index: int = 0) -> tuple[np.ndarray, ...]:
    """One call's input tensors as numpy arrays, positionally in the IR's (= ``GraphSpec``'s) input order."""
    leaves, _ = flatten_sample(*sample)
    if len(leaves) != len(graph_spec.inputs):
        raise BuildError(
            f"Recorded sample {index} of graph {graph_spec.name!r} has {len(leaves)} input tensors, the graph "
            f"{len(graph_spec.inputs)}; it cannot calibrate the quantized model. Tune again so that the samples "
            "are recorded for this graph."
        )
    arrays = []
    for leaf, spec in zip(leaves, graph_spec.inputs, strict=True):
        if leaf.dtype == torch.bfloat16:
            raise BuildError(
                f"{spec.locator}: bfloat16 inputs cannot be passed to OpenVINO through numpy, so they cannot "
                "calibrate an int8 model. Tune the module with float32 inputs."
            )
        arrays.append(np.ascontiguousarray(leaf.detach().cpu().numpy()))
    return tuple(arrays)


def calibration_inputs(graph_spec: GraphSpec, samples: Sequence[Sample]) -> list[tuple[np.ndarray, ...]]:
    """Every call's :func:`calibration_item` (all in memory: for tests and small sets)."""
    return [calibration_item(graph_spec, sample, index) for index, sample in enumerate(samples)]


class _CalibrationItems(Sequence[tuple[np.ndarray, ...]]):
    """``data`` as NNCF's data source: each call converted when NNCF reads it, none kept."""

    def __init__(self, graph_spec: GraphSpec, data: Sequence[Sample]) -> None:
        self._spec, self._data = graph_spec, data

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return calibration_item(self._spec, self._data[index], index)

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        for index, sample in enumerate(self._data):
            yield calibration_item(self._spec, sample, index)


def calibration_digest(graph_spec: GraphSpec, data: Sequence[Sample]) -> str:
    """A hash of the calibration inputs, part of a quantized IR's fingerprint (other samples, other scales)."""
    digest = hashlib.sha256()
    for item in _CalibrationItems(graph_spec, data):
        for array in item:
            digest.update(f"{array.dtype}:{array.shape};".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def looks_like_transformer(model: Any) -> bool:
    """True when the OpenVINO model contains attention (a Softmax or a fused ScaledDotProductAttention)."""
    return any(op.get_type_name() in ATTENTION_OPS for op in model.get_ops())


def quantize_model(model: Any, mode: str, graph_spec: GraphSpec, data: Sequence[Sample], target_device: str) -> Any:
    """Quantize the converted ``ov.Model`` of ``graph_spec`` in ``mode``; returns the quantized model.

    Raises :class:`BuildError` (NNCF's error chained) when NNCF fails or quantizes no operation at all, so the
    candidate becomes a failed row of the report rather than an fp32 model labelled int8.
    """
    nncf = import_nncf()
    start = time.perf_counter()
    if mode == INT8_WEIGHTS:
        try:
            keep_float = nncf.IgnoredScope(types=list(FLOAT_WEIGHT_OPS), validate=False)
            quantized = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM, ignored_scope=keep_float)
        except Exception as exc:
            raise BuildError(f"NNCF could not compress the weights of graph {graph_spec.name!r} to int8: "
                             f"{type(exc).__name__}: {exc}") from exc
        compressed = sum(op.get_type_name() == "Constant" and op.get_element_type().to_string() in _INT_WEIGHT_TYPES
                         for op in quantized.get_ops())
        _require(compressed, "weights", graph_spec, "matrix multiplications or embeddings (convolutions stay float)",
                 "quantization='int8' (activations and weights) or None")
        logger.info("Graph %s: weights compressed to int8 (%d int8 constants with the zero points) in %.1fs.",
                    graph_spec.name, compressed, time.perf_counter() - start)
        return quantized
    if not len(data):
        raise BuildError(f"Graph {graph_spec.name!r} has no recorded sample to calibrate int8 quantization with; "
                         "tune with a dataset, or use quantization='int8_weights', which needs none.")
    transformer = looks_like_transformer(model)
    options = _int8_options(nncf, len(data), target_device, transformer)
    dataset = nncf.Dataset(_CalibrationItems(graph_spec, data))
    try:
        quantized = nncf.quantize(model, dataset, **options)
    except Exception as exc:
        raise BuildError(f"NNCF int8 quantization of graph {graph_spec.name!r} failed: {type(exc).__name__}: "
                         f"{exc}") from exc
    quantizers = sum(op.get_type_name() == "FakeQuantize" for op in quantized.get_ops())
    _require(quantizers, "activations", graph_spec, "convolutions or matrix multiplications", "quantization=None")
    logger.info("Graph %s: int8 with %d quantizers in %.1fs, calibrated on %d recorded call(s)%s%s.",
                graph_spec.name, quantizers, time.perf_counter() - start, len(data),
                " (transformer rules)" if transformer else "",
                " (7-bit weights: this CPU's int8 kernels saturate)" if "advanced_parameters" in options else "")
    return quantized


def _int8_options(nncf: Any, samples: int, target_device: str, transformer: bool) -> dict[str, Any]:
    """``nncf.quantize`` keyword arguments of an ``"int8"`` candidate (and of its one-layer probe)."""
    options: dict[str, Any] = {
        "subset_size": samples,
        "fast_bias_correction": True,
        "target_device": nncf.TargetDevice.GPU if target_device.startswith("GPU") else nncf.TargetDevice.CPU,
        # CNNs: symmetric activations (PERFORMANCE); MIXED was no more accurate on a ResNet-50 and 7 % slower
        "preset": nncf.QuantizationPreset.MIXED if transformer else nncf.QuantizationPreset.PERFORMANCE,
    }
    if transformer:  # fewer quantizers around attention, SmoothQuant: BERT-base rel. L2 error 0.24 -> 0.03 (batch 8)
        options["model_type"] = nncf.ModelType.TRANSFORMER
    if not target_device.startswith("GPU") and environment.int8_dot_saturates():
        # NNCF's default fixes the first layer's weights only; a 256-512-256 MLP on an AVX2 EPYC: rel. L2 0.135 -> 0.027
        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

        options["advanced_parameters"] = AdvancedQuantizationParameters(overflow_fix=OverflowFix.ENABLE)
    return options


def quantize_layer(model: Any, rows: np.ndarray, target_device: str) -> Any:
    """``model`` (one matrix multiply, from :mod:`.layer_probe`) quantized as an ``"int8"`` candidate quantizes its
    layers, calibrated on ``rows``. Exceptions from NNCF propagate (the probe that asks treats any as "no probe")."""
    nncf = import_nncf()
    return nncf.quantize(model, nncf.Dataset([rows]), **_int8_options(nncf, 1, target_device, transformer=False))


def _require(count: int, what: str, graph_spec: GraphSpec, layers: str, fix: str) -> None:
    if count == 0:
        raise BuildError(
            f"NNCF quantized no {what} of graph {graph_spec.name!r}: it has no {layers} NNCF can quantize, so an "
            f"int8 candidate would run the float model. Use {fix} for this module."
        )
