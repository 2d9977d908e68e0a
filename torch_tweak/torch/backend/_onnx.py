"""PyTorch graph → ONNX file for :class:`~torch_tweak.torch.backend.onnxruntime.ONNXRuntimeBackend`.

The graph is exported with ``torch.onnx``'s dynamo exporter (``torch.export`` capture, shared with OpenVINO's
conversion in the same process by :func:`~._export.export_program`, then onnxscript translation at opset
:data:`OPSET` and onnxscript's graph optimizer): it folds batch norm into convolutions and keeps every symbolic
axis symbolic, where the TorchScript exporter bakes sizes into the reshapes of ``nn.TransformerEncoder`` (the
model then fails at any other batch size). The module runs through :class:`~._export.FlatForward`, so ONNX inputs and outputs are the graph's
tensors in :class:`GraphSpec` order and are named after the tensor specs.

Every batch and dynamic axis is exported unbounded (:func:`~torch_tweak.torch.backend._export.dynamic_shapes`):
an ONNX model serves any size eager serves. Optional INT8: onnxruntime's dynamic quantization of the ``MatMul``
weights (per output channel; activations are quantized per call, one scale per tensor).

``torch.onnx``, ``onnx`` and ``onnxruntime.quantization`` are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import BackendUnavailableError, ConversionError
from torch_tweak.torch import environment
from torch_tweak.torch.backend._compile_helpers import build_failure
from torch_tweak.torch.backend._export import example_leaves, export_program
from torch_tweak.torch.module.forward import pristine
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import Sample
from torch_tweak.utils.permissions import secure_file

logger = logging.getLogger(__name__)

INSTALL_HINT = "Install it with: pip install torch-tweak[onnxruntime]"
EXPORT_HINT = (
    "The module could not be captured as one graph with dynamic batch and dynamic axes; data-dependent Python "
    "control flow, sizes fixed by the code and operators without an ONNX translation are the usual causes. Use "
    "another backend for this module (TorchInductorBackend allows graph breaks)."
)
# Opset 23 translates scaled_dot_product_attention to one Attention node, which onnxruntime runs as one kernel: on a
# BERT-base at batch 32 the int8 model ran 6 % faster than at opset 20 (AVX2 EPYC), and a query row whose keys are all
# masked (left padding under a causal mask) comes out zero as in eager, where opset 20's translation returned other
# values. torch.onnx's own optimize step also applies onnxscript's opset-23 fusions, whose RotaryEmbedding node
# onnxruntime 1.32 rejects at run time on a Llama ("Inputs 'cos_cache' and 'sin_cache' are expected to have the same
# shape as input 'x'"); only the optimizer (constant folding, dead code) runs here.
OPSET = 23


def require(*packages: str, what: str) -> None:
    """Raise :class:`BackendUnavailableError` naming the first of ``packages`` that is not installed."""
    for package in packages:
        if importlib.util.find_spec(package) is None:
            raise BackendUnavailableError(
                f"ONNXRuntimeBackend needs the {package!r} package {what}, which is not installed. {INSTALL_HINT}"
            )


def export_onnx(module: nn.Module, graph_spec: GraphSpec, data: list[Sample], path: Path, log_dir: Path | None) -> Path:
    """Export one graph of ``module`` to ``path`` (``path.data`` beside it holds the weights of a model over
    protobuf's 2 GiB limit); return ``path``. Raise :class:`ConversionError` when the module cannot be captured
    (its message names the build log in ``log_dir``)."""
    require("onnxscript", "onnx", what="to export the module to ONNX")
    from onnxscript import optimizer

    leaves = tuple(example_leaves(graph_spec, data))
    names = {"input_names": [s.name for s in graph_spec.inputs], "output_names": [s.name for s in graph_spec.outputs]}
    with torch.no_grad(), pristine(module), warnings.catch_warnings():
        # the exporter names each shared dim once and says so for every other
        warnings.filterwarnings("ignore", message=".*will not be used, since it shares the same shape")
        try:
            exported = export_program(module, graph_spec, leaves)
        except Exception as exc:
            raise build_failure(f"torch.export of graph {graph_spec.name!r} failed", exc, log_dir, EXPORT_HINT,
                                error_cls=ConversionError) from exc
        try:
            program = torch.onnx.export(exported, leaves, dynamo=True, opset_version=OPSET, optimize=False,
                                        verbose=False, report=False, **names)
            optimizer.optimize_ir(program.model)
            _expand_attention_masks(program.model)
        except Exception as exc:
            # torch.onnx wraps the error in an exception whose text is generic advice: report the cause
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            raise build_failure(f"torch.onnx.export of graph {graph_spec.name!r} failed", cause, log_dir, EXPORT_HINT,
                                error_cls=ConversionError) from exc
    try:
        program.save(str(path))
    except Exception as exc:
        raise build_failure(f"Could not write the ONNX model to {path}", exc, log_dir, error_cls=ConversionError) from exc
    _secure(path)
    return path


def _expand_attention_masks(model: Any) -> None:
    """Give every Attention mask the query length on its second-to-last axis. ONNX lets that axis broadcast (a key
    padding mask of shape [batch, 1, 1, keys], as nn.MultiheadAttention passes it), onnxruntime 1.32's kernel does not
    ("inconsistent q_sequence_length (between attn_mask and Q)")."""
    from onnxscript import ir  # onnxscript's own IR package (onnx_ir)

    for node in list(model.graph.all_nodes()):
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 4:
            continue
        query, mask = node.inputs[0], node.inputs[3]
        if mask is None or query is None or _same_length(mask.shape, query.shape):
            continue
        length = ir.node("Shape", [query], {"start": -2, "end": -1})
        one = ir.node("Constant", [], {"value": ir.tensor([1], dtype=ir.DataType.INT64)})
        target = ir.node("Concat", [length.outputs[0], one.outputs[0]], {"axis": 0})
        expanded = ir.node("Expand", [mask, target.outputs[0]])  # broadcasts [.., 1, keys] against [queries, 1]
        node.graph.insert_before(node, [length, one, target, expanded])
        node.replace_input_with(3, expanded.outputs[0])


def _same_length(mask: Any, query: Any) -> bool:
    """Whether the mask's second-to-last axis is known to have the query's length."""
    if mask is None or query is None or len(mask) < 2 or len(query) < 2:
        return False
    a, b = mask[-2], query[-2]
    known = isinstance(a, int) or getattr(a, "value", None) is not None
    return known and a == b and a != 1


def _secure(path: Path) -> None:
    secure_file(path)
    data = path.with_name(path.name + ".data")
    if data.is_file():
        secure_file(data)


class _QuantizerAdvice(logging.Filter):
    """Drops onnxruntime.quantization's warnings (advice to its own users: "Please consider to run pre-processing
    before quantization...") into this module's debug log; its errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or f"onnxruntime{os.sep}quantization" not in record.pathname:
            return True
        logger.debug("onnxruntime.quantization: %s", record.getMessage())
        return False


@contextlib.contextmanager
def _root_logger_untouched() -> Iterator[None]:
    """onnxruntime.quantization warns through ``logging.warning``, which configures the root logger when it has
    no handler; a temporary NullHandler keeps the application's logging as it was, and a filter keeps its advice
    out of the application's log (in a worker process the root logger forwards to the caller's handlers)."""
    root = logging.getLogger()
    guard = logging.NullHandler() if not root.handlers else None
    advice = _QuantizerAdvice()
    if guard is not None:
        root.addHandler(guard)
    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)
        if guard is not None:
            root.removeHandler(guard)


def quantize_int8_dynamic(source: Path, target: Path, log_dir: Path | None, *, per_channel: bool) -> Path:
    """Write ``source`` with INT8 ``MatMul`` weights (one scale per output channel, or per matrix) to ``target``;
    return ``target``.

    ``Gemm`` nodes (what the exporter makes of an ``nn.Linear`` on 2-D inputs) are first rewritten as
    ``MatMul`` + ``Add``, which onnxruntime's dynamic quantization handles and ``Gemm`` it does not. On a CPU whose
    int8 kernels saturate (:func:`~torch_tweak.torch.environment.int8_dot_saturates`) the weights take 7 bits
    (onnxruntime's ``reduce_range``).
    """
    require("onnx", what="to quantize the ONNX model")
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source))
    large = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    rewritten = _gemm_to_matmul(model)
    if not rewritten:  # the quantizer loads the file itself: a second copy of the float weights meanwhile (BERT-base: 440 MB)
        model = None
    reduce_range = environment.int8_dot_saturates()
    if reduce_range:
        logger.info("INT8 weights of %s take 7 bits: this CPU has no VNNI or AMX, and its int8 kernels saturate "
                    "with 8-bit weights", source.name)
    try:
        with _root_logger_untouched():
            quantize_dynamic(model if rewritten else source, target, op_types_to_quantize=["MatMul"], per_channel=per_channel,
                             weight_type=QuantType.QInt8, reduce_range=reduce_range, use_external_data_format=large)
        if not large:
            _drop_zero_weight_zero_points(target)
    except Exception as exc:
        raise build_failure(f"onnxruntime's dynamic INT8 quantization of {source} failed", exc, log_dir,
                            "Use ONNXRuntimeBackendConfig(quantization=None) for this module.",
                            error_cls=ConversionError) from exc
    _secure(target)
    return target


def _drop_zero_weight_zero_points(path: Path) -> None:
    """Remove the weight zero points of ``MatMulInteger`` nodes in the model at ``path`` where they are all zero.

    ``quantize_dynamic`` gives symmetric per-channel int8 weights a vector of zeros; without it ONNX Runtime runs
    the same arithmetic faster (an MLP 256-512-256 on an AVX-512 VNNI EPYC, two threads, p50: 24.8 against 30.6 µs
    at batch 1, 66 against 83 µs at batch 32). Outputs are unchanged.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    weights = {t.name: t for t in model.graph.initializer}
    dropped = set()
    for node in model.graph.node:
        point = weights.get(node.input[3]) if node.op_type == "MatMulInteger" and len(node.input) == 4 else None
        if point is not None and not numpy_helper.to_array(point).any():
            dropped.add(node.input.pop(3))
    if not dropped:
        return
    unused = dropped - _referenced(model.graph)
    kept = [t for t in model.graph.initializer if t.name not in unused]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    onnx.save(model, str(path))


def _gemm_to_matmul(model: Any) -> bool:
    """Rewrite ``Y = A @ op(B) + C`` Gemm nodes with a constant ``B`` (alpha = beta = 1, A not transposed) as
    ``MatMul(A, B')`` + ``Add(C)`` in place; return True if any node changed."""
    from onnx import helper, numpy_helper

    weights = {t.name: t for t in model.graph.initializer}
    nodes, replaced = [], set()
    for index, node in enumerate(model.graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = weights.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) > 1 else None
        if weight is None or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            nodes.append(node)
            continue
        array = numpy_helper.to_array(weight)
        matrix = numpy_helper.from_array((array.T if attrs.get("transB", 0) else array).copy(), f"tt_gemm{index}_weight")
        model.graph.initializer.append(matrix)
        replaced.add(weight.name)
        has_bias = len(node.input) > 2 and node.input[2] != ""
        product = f"tt_gemm{index}_product" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], matrix.name], [product], name=f"tt_gemm{index}_matmul"))
        if has_bias:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"tt_gemm{index}_add"))
    if not replaced:
        return False
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    unused = replaced - _referenced(model.graph)
    kept = [t for t in model.graph.initializer if t.name not in unused]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return True


def _referenced(graph: Any) -> set[str]:
    """Names ``graph`` uses as node inputs or outputs, subgraphs (If, Loop, Scan bodies) included."""
    from onnx import helper

    names = {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            value = helper.get_attribute_value(attr)
            for sub in value if isinstance(value, list) else [value]:
                if hasattr(sub, "node") and hasattr(sub, "initializer"):
                    names |= _referenced(sub)
    return names
