"""The pipeline scenarios of tests/test_pipelines.py, shared with its fresh-process child.

Each scenario builds a tiny model from a config (random weights, nothing downloaded), wraps the modules that
matter and runs the pipeline: a diffusers text-to-image pipeline, a transformers ``generate`` loop and a
sentence encoder with mean pooling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import torch_tweak.torch as tt
from torch_tweak.tiny_models import bert_dataset, run_sd, tiny_bert, tiny_llama, tiny_stable_diffusion

SCENARIOS = ("sd", "llm", "encoder")
PROMPT = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
BATCH = {"input_ids": torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(4)),
         "attention_mask": torch.ones(2, 9, dtype=torch.long)}


def build(kind: str) -> Any:
    """The untuned pipeline or model of scenario ``kind``."""
    return {"sd": tiny_stable_diffusion, "llm": tiny_llama, "encoder": tiny_bert}[kind]()


def run(kind: str, obj: Any) -> np.ndarray:
    """One inference of the scenario; returns its result as an array."""
    if kind == "sd":
        return run_sd(obj, "a cat")
    with torch.no_grad():
        if kind == "llm":  # without a KV cache: backends that export a graph cannot return transformers' caches
            return obj.generate(PROMPT, max_new_tokens=5, do_sample=False, use_cache=False).numpy()
        hidden = obj(**BATCH).last_hidden_state
        mask = BATCH["attention_mask"].unsqueeze(-1).float()
        return ((hidden * mask).sum(1) / mask.sum(1)).numpy()


def placement(kind: str, obj: Any) -> dict[str, str]:
    """What the ecosystem asks a pipeline or model about where it lives."""
    if kind == "sd":
        answers = {"pipe.device": obj.device, "pipe.dtype": obj.dtype, "unet.device": obj.unet.device,
                   "unet.dtype": obj.unet.dtype, "text_encoder.device": obj.text_encoder.device}
    else:
        answers = {"model.device": obj.device, "model.dtype": obj.dtype}
    first = next(iter((obj.unet if kind == "sd" else obj).parameters()))
    answers["first parameter"] = f"{first.device}/{first.dtype}"
    return {k: str(v) for k, v in answers.items()}


def wrap_and_tune(kind: str, obj: Any, strategy: Callable[[], tt.TuneStrategy],
                  only: set[str] | None = None) -> tuple[Any, tt.TuningReport]:
    """Wrap the scenario's modules with ``strategy()`` each and tune them over a few inputs; for the pipeline,
    the modules ``tt.inspect`` finds (those named in ``only``, if given)."""
    if kind == "sd":
        prompts = ["a cat", "a dog"]
        info = tt.inspect(obj, prompts, inference_function=lambda p: run_sd(obj, p), number_of_iterations=1,
                          warmup_iterations=1)
        modules = [m for m in info.get_modules() if only is None or m.name in only]
        tt.wrap(obj, modules, strategy=strategy())
        return obj, tt.tune(lambda p: run_sd(obj, p), prompts, batch_sizes=[1])
    if kind == "llm":
        llm = tt.Module(obj, name="llm", strategy=strategy())
        report = tt.tune(lambda ids: llm.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False),
                         [PROMPT[0]], batch_sizes=[1])  # sequence lengths 6, 7, 8
        return llm, report
    encoder = tt.Module(obj, name="encoder", strategy=strategy())
    return encoder, tt.tune(encoder, bert_dataset(lengths=(6, 9, 11)), batch_sizes=[1, 2])
