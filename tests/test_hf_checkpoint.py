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


@pytest.mark.slow
def test_stable_diffusion_tuned_saved_and_loaded_in_a_fresh_process(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("openvino")
    from hf_models import run_sd, tiny_stable_diffusion

    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    pipe = tiny_stable_diffusion()
    expected = run_sd(pipe, "a cat")
    info = tt.inspect(pipe, ["a cat", "a dog"], inference_function=lambda p: run_sd(pipe, p),
                      number_of_iterations=2, warmup_iterations=1)
    openvino = tt.OneBackendStrategy(OpenVINOBackend(OpenVINOBackendConfig(inference_precision="f32")))
    pipe.unet = tt.Module(pipe.unet, name="unet", strategy=openvino)  # by hand; tt.wrap keeps it
    tt.wrap(pipe, info.get_modules(), strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    report = tt.tune(lambda p: run_sd(pipe, p), ["a cat", "a dog"], batch_sizes=[1, 2], ignore_failing_modules=False)
    chosen = {m.name: m.graphs[0].chosen for m in report.modules}
    assert chosen["unet"].startswith("OpenVINOBackend")
    tuned = run_sd(pipe, "a cat")
    np.testing.assert_allclose(tuned, expected, atol=1e-3)
    path = tmp_path / "sd.tt"
    tt.save(pipe, path)
    loaded = run_child("sd", path, tmp_path)
    np.testing.assert_allclose(loaded, tuned, atol=1e-5)
    np.testing.assert_allclose(loaded, expected, atol=1e-3)


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
