"""One ``nn.Linear`` call run by OpenVINO in float and in int8, for the stand-in rule that skips an ``"int8"``
candidate on a CPU whose int8 matrix multiply is no faster than its float one (``tune_strategy/stand_ins.py``).

Quantizing a whole graph with NNCF takes tens of seconds (a BERT-base: 33-38 s on 2 cores). Whether int8 can pay
off on a graph made of linear layers shows on its largest one: both copies are compiled as the candidate would be
(its precision hint, the LATENCY hint) and NNCF quantizes the int8 one with the candidate's own settings, calibrated
on the call's recorded input. On an AVX2 EPYC without VNNI the int8 layer took 1.2-1.4x as long as the float one
(BERT's 1024x768 -> 3072 and 1024x3072 -> 768, three runs each); VNNI and AMX make it faster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from torch_tweak.torch.backend.openvino.converter import import_openvino
from torch_tweak.torch.backend.openvino.quantize import quantize_layer


def _float_model(ov: Any, layer: nn.Linear) -> Any:
    from openvino import opset13 as ops

    weight = layer.weight.detach().float().cpu().numpy()
    rows = ops.parameter([-1, layer.in_features], np.float32, name="rows")
    out = ops.matmul(rows, ops.constant(weight), False, True)
    if layer.bias is not None:
        out = ops.add(out, ops.constant(layer.bias.detach().float().cpu().numpy()))
    return ov.Model([out], [rows], "linear_probe")


def int8_layer_pair(core: Any, layer: nn.Linear, activation: torch.Tensor, device: str,
                    config: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Calls of ``layer`` on ``activation`` (its rows) compiled by OpenVINO for ``device`` with ``config``: the float
    layer and its NNCF int8 copy. Exceptions from OpenVINO and NNCF propagate."""
    ov = import_openvino()
    rows = np.ascontiguousarray(activation.detach().float().reshape(-1, layer.in_features).cpu().numpy())
    quantized = quantize_layer(_float_model(ov, layer), rows, device)
    calls = []
    for model in (_float_model(ov, layer), quantized):
        request = core.compile_model(model, device, config).create_infer_request()
        calls.append(lambda request=request: request.infer({0: rows}))
    return calls[0], calls[1]
