"""PyTorch module → OpenVINO IR (``model.xml`` / ``model.bin``) for one graph of a module.

Both conversion paths run the module through :class:`FlatForward`, a wrapper whose forward takes the graph's
input tensors positionally, in :class:`GraphSpec` order, rebuilds the original ``(args, kwargs)`` (keyword
arguments passed by name, non-tensor values and ``None`` bound from the recorded structure) and returns the
output tensors flattened in ``GraphSpec.outputs`` order. IR inputs and outputs therefore map to the spec by
position, whatever names the converter picks, and are then renamed after the tensor specs.

``openvino`` is imported inside functions only.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_tweak.errors import BackendUnavailableError, ConversionError
from torch_tweak.torch.backend._artifact_reuse import FINGERPRINT_NAME, copy_files, forget, matches, record
from torch_tweak.torch.backend._artifact_reuse import fingerprint as artifact_fingerprint
from torch_tweak.torch.backend._export import FlatForward, example_leaves, export_program
from torch_tweak.torch.module.forward import pristine
from torch_tweak.torch.module.spec import GraphSpec, TensorSpec
from torch_tweak.torch.module.tree import Sample
from torch_tweak.utils.permissions import secure_file, secure_mkdir

logger = logging.getLogger(__name__)

OV_MODEL_XML_NAME = "model.xml"
OV_MODEL_BIN_NAME = "model.bin"
_OP_RE = re.compile(r"\b(?:aten|prim|quantized|torchvision)::[A-Za-z0-9_.]+")


def import_openvino() -> Any:
    """Import and return the ``openvino`` module, or raise :class:`BackendUnavailableError`."""
    try:
        import openvino
    except ImportError as exc:
        raise BackendUnavailableError(
            "OpenVINOBackend needs the 'openvino' package, which is not installed. "
            "Install it with: pip install torch-tweak[openvino]"
        ) from exc
    return openvino


def _conversion_error(what: str, exc: BaseException, use_dynamo: bool) -> ConversionError:
    ops = sorted(set(_OP_RE.findall(str(exc))))
    where = f" The failing operator(s): {', '.join(ops)}." if ops else ""
    hint = (
        " torch.export could not capture the module; try OpenVINOBackendConfig(use_dynamo=False) to convert "
        "through TorchScript tracing instead."
        if use_dynamo and what == "torch.export"
        else ""
    )
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConversionError(f"{what} failed: {type(exc).__name__}: {first_line[:500]}.{where}{hint}")


def to_ov_model(module: nn.Module, graph_spec: GraphSpec, data: list[Sample], use_dynamo: bool) -> Any:
    """Export (``use_dynamo``) or trace ``module`` and convert it to an ``ov.Model`` named after ``graph_spec``."""
    ov = import_openvino()
    leaves = example_leaves(graph_spec, data)
    with torch.no_grad(), pristine(module):
        if use_dynamo:
            try:
                program = export_program(module, graph_spec, tuple(leaves))
            except Exception as exc:
                raise _conversion_error("torch.export", exc, True) from exc
            try:
                model = ov.convert_model(program)
            except Exception as exc:
                raise _conversion_error("OpenVINO conversion of the exported program", exc, use_dynamo) from exc
        else:
            try:
                model = ov.convert_model(FlatForward(module, graph_spec).eval(), example_input=tuple(leaves))
            except Exception as exc:
                raise _conversion_error("OpenVINO conversion (TorchScript trace)", exc, use_dynamo) from exc
    _zero_fully_masked_rows(model)
    _apply_graph_spec(ov, model, graph_spec)
    return model


def _zero_fully_masked_rows(model: Any) -> None:
    """Make OpenVINO's ScaledDotProductAttention return zeros for a query row whose mask allows no key (all False,
    or all -inf), as eager does; OpenVINO returns NaN there (a pad position under a causal mask in a left-padded
    batch, so the OpenVINO candidates of a GPT-2 or Llama tuned on such batches failed their check). Such a row
    attends to every key instead, and its output is zeroed."""
    from openvino import opset13 as ops

    for node in model.get_ordered_ops():
        if node.get_type_name() != "ScaledDotProductAttention" or node.get_input_size() < 4:
            continue
        mask = node.input_value(3)
        kind = mask.get_element_type()
        axis = ops.constant([-1])
        if kind.get_type_name() == "boolean":
            seen = ops.reduce_logical_or(mask, axis, keep_dims=True)  # [..., queries, 1]
            opened = ops.logical_or(mask, ops.logical_not(seen))
        elif kind.is_real():
            # not ReduceMax against -inf: OpenVINO's CPU ReduceMax of a row of -inf is the lowest finite float
            allowed = ops.logical_not(ops.is_inf(mask, {"detect_positive": False}))
            seen = ops.reduce_logical_or(allowed, axis, keep_dims=True)
            opened = ops.select(seen, mask, ops.constant(0, kind))
        else:
            continue
        node.input(3).replace_source_output(opened.output(0))
        output = node.output(0)
        users = list(output.get_target_inputs())
        zeroed = ops.select(seen, output, ops.constant(0, output.get_element_type()))
        for user in users:
            user.replace_source_output(zeroed.output(0))


def _partial_shape(ov: Any, spec: TensorSpec) -> Any:
    """Static axes keep their size; batch and dynamic axes accept any size (as eager does), not only the recorded
    range."""
    return ov.PartialShape([ov.Dimension(size) if isinstance(size, int) else ov.Dimension() for size in spec.shape])


def _apply_graph_spec(ov: Any, model: Any, graph_spec: GraphSpec) -> None:
    """Name inputs/outputs after the tensor specs and give the inputs the graph's static and dynamic axes."""
    if len(model.inputs) != len(graph_spec.inputs) or len(model.outputs) != len(graph_spec.outputs):
        raise ConversionError(
            f"The converted model has {len(model.inputs)} inputs and {len(model.outputs)} outputs, but graph "
            f"{graph_spec.name!r} has {len(graph_spec.inputs)} input and {len(graph_spec.outputs)} output tensors "
            "(an input the module ignores may have been dropped); the IR cannot be mapped to the call."
        )
    for port, spec in zip(model.inputs, graph_spec.inputs, strict=False):
        port.get_tensor().set_names({spec.name})
        port.get_node().set_partial_shape(_partial_shape(ov, spec))
    for port, spec in zip(model.outputs, graph_spec.outputs, strict=False):
        producer = port.get_node().input_value(0).get_node()
        if producer.get_type_name() != "Parameter":  # renaming a pass-through output would rename the input
            port.get_tensor().set_names({spec.name})
    try:
        model.validate_nodes_and_infer_types()
    except Exception as exc:
        raise _conversion_error("Applying the tuned input shapes to the OpenVINO model", exc, False) from exc


def fingerprint(module: nn.Module, graph_spec: GraphSpec, config: dict[str, Any]) -> str | None:
    """A hash of everything the IR depends on (:mod:`~torch_tweak.torch.backend._artifact_reuse`)."""
    ov = import_openvino()
    return artifact_fingerprint(module, graph_spec, config, {"torch": torch.__version__, "openvino": ov.__version__,
                                                             "masked_rows": "zeroed-v2"})


def cached_ir(ir_dir: Path, fp: str | None) -> Path | None:
    """The IR in ``ir_dir`` if it was saved with fingerprint ``fp`` and both files exist."""
    xml, bin_ = ir_dir / OV_MODEL_XML_NAME, ir_dir / OV_MODEL_BIN_NAME
    if not (xml.is_file() and bin_.is_file()):
        return None
    return xml if matches(ir_dir, fp) else None


def save_ir(model: Any, ir_dir: Path, fp: str | None) -> Path:
    """Write ``model`` as ``model.xml``/``model.bin`` (full precision weights); partial files are removed on failure."""
    ov = import_openvino()
    secure_mkdir(ir_dir)
    xml, bin_, fp_file = ir_dir / OV_MODEL_XML_NAME, ir_dir / OV_MODEL_BIN_NAME, ir_dir / FINGERPRINT_NAME
    tmp_xml, tmp_bin = ir_dir / "model.partial.xml", ir_dir / "model.partial.bin"
    forget(ir_dir)
    try:
        ov.save_model(model, str(tmp_xml), compress_to_fp16=False)
        for path in (tmp_xml, tmp_bin):
            secure_file(path)
        os.replace(tmp_bin, bin_)
        os.replace(tmp_xml, xml)
        record(ir_dir, fp)
    except Exception as exc:
        for path in (tmp_xml, tmp_bin, xml, bin_, fp_file):
            path.unlink(missing_ok=True)
        raise ConversionError(f"Could not write the OpenVINO IR to {ir_dir}: {exc}") from exc
    return xml


def copy_ir(source: Path, ir_dir: Path, fp: str) -> Path | None:
    """Copy the IR in ``source`` (saved with fingerprint ``fp``) into ``ir_dir``; None if it cannot be copied."""
    if cached_ir(source, fp) is None:
        return None
    forget(ir_dir)
    if not copy_files(source, ir_dir, (OV_MODEL_BIN_NAME, OV_MODEL_XML_NAME)):
        return None
    record(ir_dir, fp)
    return ir_dir / OV_MODEL_XML_NAME


def convert(
    module: nn.Module, graph_spec: GraphSpec, data: list[Sample], use_dynamo: bool, ir_dir: Path, config: dict[str, Any],
    transform: Callable[[Any], Any] | None = None, shared: Iterable[Path] = (), base_config: dict[str, Any] | None = None,
) -> Path:
    """Return the path of ``model.xml`` for ``module``'s graph, reusing a matching IR already in ``ir_dir``, or
    copying one with the same fingerprint from a ``shared`` folder (another candidate's, for the same graph).

    ``config`` holds the settings the IR depends on (not those applied when compiling it, so that candidates
    differing only in those share one conversion). ``transform`` (e.g. quantization) maps the converted
    ``ov.Model`` to the one saved; whatever it depends on beyond the module, the graph and the settings (such as
    calibration data) must be in ``config``, which is part of the fingerprint, so that an IR is reused only for
    the same settings and inputs. It starts from the untransformed IR of ``base_config`` when a ``shared`` folder
    holds one (a float candidate's), instead of converting the module again.
    """
    fp = fingerprint(module, graph_spec, config)
    reused = cached_ir(ir_dir, fp)
    if reused is not None:
        logger.info("Reusing the OpenVINO IR in %s (same module weights, graph and config).", ir_dir)
        return reused
    for source in shared if fp is not None else ():
        copied = copy_ir(source, ir_dir, fp)
        if copied is not None:
            logger.info("Reusing the OpenVINO IR of %s (same module weights, graph and IR settings).", source)
            return copied
    model = None
    if transform is not None and base_config is not None:
        model = _read_base(fingerprint(module, graph_spec, base_config), shared)
    if model is None:
        model = to_ov_model(module, graph_spec, data, use_dynamo)
    if transform is not None:
        model = transform(model)
    return save_ir(model, ir_dir, fp)


def _read_base(fp: str | None, shared: Iterable[Path]) -> Any:
    """The ``ov.Model`` saved with fingerprint ``fp`` in one of the ``shared`` folders, or None."""
    for source in shared if fp is not None else ():
        xml = cached_ir(source, fp)
        if xml is None:
            continue
        try:
            model = import_openvino().Core().read_model(str(xml))
        except Exception as exc:  # noqa: BLE001 - a damaged IR of another candidate: convert instead
            logger.debug("Could not read the OpenVINO IR %s: %s", xml, exc)
            continue
        logger.info("Starting from the OpenVINO IR of %s (same module weights and graph).", source)
        return model
    return None
