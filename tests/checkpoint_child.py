"""Models for the checkpoint tests, and a fresh-process loader.

    python tests/checkpoint_child.py KIND CHECKPOINT DATA OUT [--seed N] [--device-map JSON] [--trust-native-code] [--verify-key HEX]

builds model KIND (with weights from ``--seed``, so that weights the checkpoint must provide differ from
the saving process's), loads CHECKPOINT into it with ``tt.load``, runs the inputs stored in DATA (a
safetensors file with ``input.0``, ``input.1``...) and writes the outputs to OUT. It prints one JSON line:
the type returned by tt.load, module states, backend classes, and how many times anything compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402
from toy_models import cnn  # noqa: E402


class ToyPipeline:
    """A plain pipeline object: a CNN encoder, a dict of heads and a list of stages."""

    def __init__(self, seed: int = 0) -> None:
        self.encoder = cnn(seed)
        torch.manual_seed(seed + 1)
        self.heads = {"score": nn.Linear(3, 2).eval()}
        self.stages = [nn.Sequential(nn.Linear(2, 2), nn.Tanh()).eval()]
        self.note = "plain attributes are ignored"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages[0](self.heads["score"](self.encoder(x)))


class LinearNet(nn.Sequential):
    """Linear layers large enough for torchao to quantize."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        super().__init__(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
        self.eval()


def build(kind: str, seed: int = 0) -> object:
    """A fresh model or pipeline of ``kind``."""
    if kind == "pipeline":
        return ToyPipeline(seed)
    if kind == "cnn":
        return cnn(seed)
    if kind == "linear":
        return LinearNet(seed)
    raise ValueError(kind)


def call(kind: str, model: object, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)  # type: ignore[operator]


def install_compile_counters() -> dict[str, int]:
    """Count every way torch_tweak's backends could compile from PyTorch."""
    counts = {"torch.compile": 0, "torch.export.export": 0, "aoti_compile_and_package": 0, "to_ov_model": 0}

    def counting(owner: object, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            counts[key] += 1
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    import torch._inductor
    import torch.export

    counting(torch, "compile", "torch.compile")
    counting(torch.export, "export", "torch.export.export")
    counting(torch._inductor, "aoti_compile_and_package", "aoti_compile_and_package")
    try:
        from torch_tweak.torch.backend.openvino import converter
    except ImportError:
        pass
    else:
        counting(converter, "to_ov_model", "to_ov_model")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind")
    parser.add_argument("checkpoint")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=99)
    parser.add_argument("--device-map", default=None)
    parser.add_argument("--trust-native-code", action="store_true")
    parser.add_argument("--verify-key", default=None, help="an HMAC secret, hex")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import torch_tweak.torch as tt

    counts = install_compile_counters()
    model = build(args.kind, args.seed)
    start = time.perf_counter()
    loaded = tt.load(model, args.checkpoint, device_map=json.loads(args.device_map) if args.device_map else None,
                     trust_native_code=args.trust_native_code,
                     verify_key=bytes.fromhex(args.verify_key) if args.verify_key else None)
    load_s = time.perf_counter() - start
    inputs = load_file(args.data)
    outputs = {}
    for i in range(len(inputs)):
        outputs[f"output.{i}"] = call(args.kind, loaded, inputs[f"input.{i}"]).contiguous()
    save_file(outputs, args.out)
    from torch_tweak.torch.module.state import internals
    from torch_tweak.torch.module.wrapper import registered_modules

    modules = registered_modules()
    print(json.dumps({
        "returned": type(loaded).__name__ if type(loaded) is not tt.Module else "tt.Module",
        "states": {n: m.state.name for n, m in modules.items()},
        "backends": {n: sorted({type(b).__name__ for b in m.backends.values()}) for n, m in modules.items()},
        "offloaded": {n: internals(m).offloaded for n, m in modules.items()},
        "compiles": counts,
        "dynamo_frames": sum(torch._dynamo.utils.counters["frames"].values()),
        "load_s": load_s,
    }))


if __name__ == "__main__":
    main()
