"""Fresh-process side of the Hugging Face checkpoint tests: build the untuned model, tt.load, run.

    python tests/hf_child.py sd|llm CHECKPOINT OUT.npy
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import torch_tweak.torch as tt
from torch_tweak.tiny_models import run_sd, tiny_llama, tiny_stable_diffusion


def main() -> None:
    kind, checkpoint, out = sys.argv[1:4]
    torch.manual_seed(123)  # weights come from the checkpoint where a backend needs them
    if kind == "sd":
        pipe = tt.load(tiny_stable_diffusion(), checkpoint)
        result = run_sd(pipe, "a cat")
        assert all(isinstance(m, tt.Module) for m in (pipe.unet, pipe.text_encoder)), "modules not restored"
    else:
        model = tt.load(tiny_llama(), checkpoint)
        prompt = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            result = model.generate(prompt, max_new_tokens=6, do_sample=False).numpy()
    np.save(out, result)


if __name__ == "__main__":
    main()
