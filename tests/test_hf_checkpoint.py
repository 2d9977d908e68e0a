"""Hugging Face pipelines end to end: inspect → wrap → tune → save → load in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_tweak.torch as tt
from torch_tweak.torch.backend import TorchEagerBackend

pytest.importorskip("transformers")
CHILD = Path(__file__).with_name("hf_child.py")


def run_child(kind: str, checkpoint: Path, tmp_path: Path) -> np.ndarray:
    out = tmp_path / f"{kind}.npy"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(CHILD), kind, str(checkpoint), str(out)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)


# Stable Diffusion after tt.save / tt.load in a fresh process, with every backend: tests/test_pipelines.py.


def test_llm_generate_same_tokens_after_loading_in_a_fresh_process(tmp_path):
    from hf_models import tiny_llama

    model = tiny_llama()
    prompt = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    strategy = tt.OneBackendStrategy(TorchEagerBackend())
    llm = tt.Module(model, name="llm", strategies=[strategy, strategy])
    tt.tune(lambda ids: llm.generate(ids, max_new_tokens=3, do_sample=False),
            [torch.randint(0, 100, (5,)) for _ in range(2)], batch_sizes=[1, 2])
    path = tmp_path / "llm.tt"
    tt.save(llm, path)
    assert np.array_equal(run_child("llm", path, tmp_path), expected.numpy())
