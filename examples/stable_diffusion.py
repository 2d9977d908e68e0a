"""Tune a (tiny, randomly initialised) Stable Diffusion pipeline: find its heavy modules, wrap, tune.

    python examples/stable_diffusion.py
"""

from __future__ import annotations

import numpy as np

import torch_tweak.torch as tt
from torch_tweak.tiny_models import run_sd, tiny_stable_diffusion


def main() -> None:
    pipe = tiny_stable_diffusion()
    prompts = ["a cat", "a dog"]
    reference = run_sd(pipe, "a cat")

    report = tt.inspect(pipe, prompts, inference_function=lambda p: run_sd(pipe, p), number_of_iterations=2)
    report.describe()
    tt.wrap(pipe, report.get_modules(min_execution_percentage=5))
    print(tt.tune(lambda p: run_sd(pipe, p), prompts, batch_sizes=[1, 2]))

    image = run_sd(pipe, "a cat")
    print("max abs difference to the eager image:", float(np.abs(image - reference).max()))


if __name__ == "__main__":
    main()
