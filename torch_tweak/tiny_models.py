"""Tiny models for demos, examples and tests, built offline with random weights (no downloads).

Hugging Face models are built from configs; ``transformers`` and ``diffusers`` are imported only by the
functions that need them (install ``torch-tweak[hf]``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np
    from diffusers import StableDiffusionPipeline
    from transformers import BertModel, CLIPTokenizer, LlamaForCausalLM


def tiny_bert() -> BertModel:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    return BertModel(config).eval()


def bert_dataset(lengths: Sequence[int] = (6, 9, 11, 7)) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, 100, (n,), generator=generator), "attention_mask": torch.ones(n, dtype=torch.long)}
            for n in lengths]


def tiny_llama() -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def _tiny_clip_tokenizer() -> CLIPTokenizer:
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    # the tokenizer reads both files when it is built and keeps what it read, so the folder goes with the call
    with tempfile.TemporaryDirectory(prefix="tiny_clip_tokenizer_") as folder:
        with open(os.path.join(folder, "vocab.json"), "w") as f:
            json.dump(vocab, f)
        with open(os.path.join(folder, "merges.txt"), "w") as f:
            f.write("#version: 0.2\n")
        return CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"),
                             model_max_length=16)


def tiny_stable_diffusion() -> StableDiffusionPipeline:
    """A StableDiffusionPipeline with a 2-layer CLIP text encoder, a tiny UNet and a tiny VAE."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    tokenizer = _tiny_clip_tokenizer()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16, projection_dim=32)).eval()
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, norm_num_groups=8, attention_head_dim=8).eval()
    vae = AutoencoderKL(
        block_out_channels=(8, 16), in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8, sample_size=16).eval()
    scheduler = DDIMScheduler(num_train_timesteps=100, clip_sample=False)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_sd(pipe: StableDiffusionPipeline, prompt: str | list[str]) -> np.ndarray:
    """Two denoising steps at 16x16 with a fixed seed; returns the image array."""
    generator = torch.Generator().manual_seed(0)
    return pipe(prompt, num_inference_steps=2, height=16, width=16, generator=generator, output_type="np").images


class SmallEncoder(torch.nn.Module):
    """A 2-layer transformer encoder over token ids, returning a dict like Hugging Face encoders."""

    def __init__(self, vocab_size: int = 100, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pool = torch.nn.Linear(dim, dim)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        return {"last_hidden_state": hidden, "pooler_output": torch.tanh(self.pool(hidden[:, 0]))}


def small_encoder() -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """The demo transformer encoder (eval mode, fixed seed) and sample sentences of a few lengths."""
    torch.manual_seed(0)
    return SmallEncoder().eval(), bert_dataset(lengths=(16, 16, 24, 24))
