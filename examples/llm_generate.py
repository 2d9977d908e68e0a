"""Tune a causal language model's `generate` loop: prefill and decode are separate graphs.

    python examples/llm_generate.py
"""

from __future__ import annotations

import torch

import torch_tweak.torch as tt
from torch_tweak.tiny_models import tiny_llama
from torch_tweak.torch.backend import TorchEagerBackend, TorchInductorBackend


def main() -> None:
    model = tiny_llama()
    prompt = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=8, do_sample=False)

    prefill = tt.OneBackendStrategy(TorchEagerBackend())
    decode = tt.FirstWinsStrategy([TorchInductorBackend(), TorchEagerBackend()])
    llm = tt.Module(model, name="llm", strategies=[prefill, decode])

    def generate(input_ids: torch.Tensor) -> torch.Tensor:
        return llm.generate(input_ids, max_new_tokens=4, do_sample=False)

    print(tt.tune(generate, [torch.randint(0, 100, (6,)) for _ in range(2)], batch_sizes=[1, 2]))
    with torch.no_grad():
        tokens = llm.generate(prompt, max_new_tokens=8, do_sample=False)
    print("same tokens as eager:", torch.equal(tokens, reference), "- model.device:", llm.device)
    if not torch.equal(tokens, reference):
        raise SystemExit("The tuned model generated other tokens than eager.")


if __name__ == "__main__":
    main()
