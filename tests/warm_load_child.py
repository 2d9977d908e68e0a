"""A fresh process that loads a checkpoint and reports every compile event (for tests/test_warm_load.py).

    python tests/warm_load_child.py KIND CHECKPOINT DATA OUT [--trust-native-code]

builds model KIND of ``checkpoint_child.build`` (other weights than the saving process's), loads CHECKPOINT,
runs the inputs in DATA (safetensors ``input.0``, ``input.1``...), writes the outputs to OUT and prints one
JSON line: module states, compile calls counted at their entry points, Dynamo frames, Inductor and
AOTAutograd counters, and the warnings raised while loading.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from checkpoint_child import build, install_compile_counters  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("kind", "checkpoint", "data", "out"):
        parser.add_argument(name)
    parser.add_argument("--trust-native-code", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import torch_tweak.torch as tt

    counts = install_compile_counters()
    model = build(args.kind, seed=99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = tt.load(model, args.checkpoint, trust_native_code=args.trust_native_code)
    inputs = load_file(args.data)
    with torch.no_grad():
        outputs = {f"output.{i}": loaded(inputs[f"input.{i}"]).contiguous() for i in range(len(inputs))}
    save_file(outputs, args.out)
    from torch._dynamo.utils import counters

    from torch_tweak.torch.module.state import internals

    backends = [c for b in internals(loaded).backends() for c in b.components()]
    print(json.dumps({
        "warm_packages": [str(b._warm) for b in backends if getattr(b, "_warm", None) is not None],
        "state": loaded.state.name,
        "compiles": counts,
        "dynamo_frames": sum(counters["frames"].values()),
        "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "torch_tweak" in str(w.category.__module__)],
    }))


if __name__ == "__main__":
    main()
