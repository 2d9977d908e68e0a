"""Fresh-process side of the Hugging Face checkpoint tests: build the untuned model, tt.load, run.

    python tests/hf_child.py llm CHECKPOINT OUT.npy
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import torch_tweak.torch as tt
from torch_tweak.tiny_models import tiny_llama


def main() -> None:
    kind, checkpoint, out = sys.argv[1:4]
    if kind != "llm":
        raise SystemExit(f"unknown kind {kind!r} (only llm)")
    torch.manual_seed(123)  # weights come from the checkpoint where a backend needs them
    model = tt.load(tiny_llama(), checkpoint)
    prompt = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        result = model.generate(prompt, max_new_tokens=6, do_sample=False).numpy()
    np.save(out, result)


if __name__ == "__main__":
    main()
