"""Tune a sentence-embedding encoder (a tiny BERT built from a config) and compare embeddings.

    python examples/sentence_embeddings.py [--fast]

``--fast`` tries OpenVINO, ONNX Runtime and eager only (no compiler backends), as CI does.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import torch_tweak.torch as tt
from torch_tweak.tiny_models import bert_dataset, tiny_bert
from torch_tweak.torch.backend import ONNXRuntimeBackend, OpenVINOBackend, TorchEagerBackend


def embed(model, batch):
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description="Tune a tiny sentence encoder.")
    parser.add_argument("--fast", action="store_true", help="try OpenVINO, ONNX Runtime and eager only")
    fast = parser.parse_args().fast
    model = tiny_bert()
    sentences = bert_dataset(lengths=(6, 9, 11, 7))
    batch = {"input_ids": torch.randint(1, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    reference = embed(model, batch)

    report = tt.inspect(model, sentences, number_of_iterations=3, warmup_iterations=1)
    report.describe()
    fast_backends = [OpenVINOBackend(), ONNXRuntimeBackend(), TorchEagerBackend()]
    strategy = tt.HighestThroughputStrategy(fast_backends) if fast else None
    encoder = tt.wrap(model, report.get_modules(limit=1), strategy=strategy)
    print(tt.tune(encoder, sentences, batch_sizes=[1, 2]))

    tuned = embed(encoder, batch)
    similarity = torch.nn.functional.cosine_similarity(tuned, reference)
    print("cosine similarity to eager embeddings:", similarity.tolist())

    path = Path(tempfile.mkdtemp()) / "encoder.tt"
    tt.save(encoder, path)
    # A freshly built model; the checkpoint brings the tuned backends. The tuned encoder is still alive: the
    # restored one takes its name, and both keep working.
    restored = tt.load(tiny_bert(), path)
    matches = torch.allclose(embed(restored, batch), tuned, atol=1e-5) and torch.allclose(embed(encoder, batch), tuned)
    print("saved to", path, "- restored model matches:", matches, "- device:", restored.device)
    if not (matches and bool((similarity > 0.99).all())):
        raise SystemExit("The tuned or restored encoder's embeddings differ from eager's.")


if __name__ == "__main__":
    main()
