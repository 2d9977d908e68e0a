"""Tune a (tiny, randomly initialised) Stable Diffusion pipeline: find its heavy modules, wrap, tune.

    python examples/stable_diffusion.py [--fast]

``--fast`` tries OpenVINO and eager only (no compiler backends), as CI does.
"""

from __future__ import annotations

import argparse

import numpy as np

import torch_tweak.torch as tt
from torch_tweak.tiny_models import run_sd, tiny_stable_diffusion
from torch_tweak.torch.backend import OpenVINOBackend, TorchEagerBackend


def main() -> None:
    parser = argparse.ArgumentParser(description="Tune a tiny Stable Diffusion pipeline.")
    parser.add_argument("--fast", action="store_true", help="try OpenVINO and eager only")
    fast = parser.parse_args().fast
    pipe = tiny_stable_diffusion()
    prompts = ["a cat", "a dog"]
    reference = run_sd(pipe, "a cat")

    report = tt.inspect(pipe, prompts, inference_function=lambda p: run_sd(pipe, p), number_of_iterations=2)
    report.describe()
    strategy = tt.HighestThroughputStrategy([OpenVINOBackend(), TorchEagerBackend()]) if fast else None
    tt.wrap(pipe, report.get_modules(min_execution_percentage=0.05), strategy=strategy)
    print(tt.tune(lambda p: run_sd(pipe, p), prompts, batch_sizes=[1, 2]))

    image = run_sd(pipe, "a cat")  # the pipeline still finds its device and dtype from the tuned modules
    difference = float(np.abs(image - reference).max())
    print(f"pipe.device={pipe.device}, pipe.dtype={pipe.dtype}; max abs difference to the eager image: {difference:.2e}")
    if not difference < 0.1:
        raise SystemExit("The tuned pipeline's image differs from eager's.")


if __name__ == "__main__":
    main()
