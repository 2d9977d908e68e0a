"""Fresh-process side of tests/test_pipelines.py: build each untuned scenario, tt.load its checkpoint, run it.

    python tests/pipeline_child.py FOLDER SCENARIO [SCENARIO ...]

Writes FOLDER/<scenario>.loaded.npy and FOLDER/<scenario>.placement.json (before and after the load).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from pipelines import build, placement, run

import torch_tweak.torch as tt


def main() -> None:
    folder, kinds = Path(sys.argv[1]), sys.argv[2:]
    for kind in kinds:
        torch.manual_seed(123)
        obj = build(kind)
        before = placement(kind, obj)
        # The test's own checkpoints: native artifacts (AOT packages, compiled caches) may load.
        loaded = tt.load(obj, folder / f"{kind}.tt", trust_native_code=True)
        result = run(kind, loaded)
        np.save(folder / f"{kind}.loaded.npy", result)
        (folder / f"{kind}.placement.json").write_text(json.dumps({"before": before, "after": placement(kind, loaded)}))


if __name__ == "__main__":
    main()
