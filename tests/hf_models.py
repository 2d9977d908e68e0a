"""Tiny Hugging Face models for the tests (see torch_tweak.tiny_models)."""

from torch_tweak.tiny_models import bert_dataset, run_sd, tiny_bert, tiny_llama, tiny_stable_diffusion

__all__ = ["bert_dataset", "run_sd", "tiny_bert", "tiny_llama", "tiny_stable_diffusion"]
