"""The workloads: models built in code or from configs with random weights, and their inputs.

Every runner, in every environment, builds a workload's module with :func:`build` and then loads the
weights the driver saved once per run (``<run dir>/<workload>.weights.pt``), so all systems run the
very same weights on the very same inputs (``<run dir>/<workload>.inputs.pt``). Needs only torch, plus
transformers for the encoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True)
class Workload:
    """A model, the batch sizes it is measured at and the shape of one sample."""

    name: str
    title: str
    batch_sizes: tuple[int, ...]
    sample_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    vocab: int = 0  # > 0: integer token ids in [1, vocab)


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", "MLP 256-512-256", (1, 32), (256,)),
    "resnet50": Workload("resnet50", "ResNet-50-shaped CNN 224x224", (1, 32), (3, 224, 224)),
    "bert": Workload("bert", "BERT-base-shaped encoder seq 128", (1, 8), (128,), torch.long, vocab=30522),
}
TUNE_BATCHES = {"mlp": [1, 2, 4, 8, 16, 32], "resnet50": [1, 2, 4, 8, 16, 32], "bert": [1, 2, 4, 8]}


class Bottleneck(nn.Module):
    """ResNet bottleneck block (1x1, 3x3, 1x1 convolutions with batch norm and a projection shortcut)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """The ResNet-50 layout (stem, bottleneck stages of 3/4/6/3 blocks, 1000-way head), 25.6 M parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)))


class Encoder(nn.Module):
    """transformers ``BertModel(BertConfig())`` (BERT-base shape) returning ``last_hidden_state`` for token ids."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        self.bert = BertModel(BertConfig(), add_pooling_layer=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).last_hidden_state


def build(name: str, weights: Path | None = None) -> nn.Module:
    """The workload's module in eval mode, with the run's saved weights when ``weights`` is given."""
    torch.manual_seed(0)
    if name == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    elif name == "resnet50":
        model = ResNet50()
    elif name == "bert":
        model = Encoder()
    else:
        raise KeyError(f"unknown workload {name!r}")
    if weights is not None:
        # memory-mapped and assigned, so the weights are not held twice while loading (peak RSS stays the model's)
        model.load_state_dict(torch.load(weights, weights_only=True, mmap=True), assign=True)
    return model.eval()


def sample(workload: Workload, batch: int | None, seed: int) -> torch.Tensor:
    """A random input: one sample (``batch=None``) or a batch."""
    generator = torch.Generator().manual_seed(seed)
    shape = workload.sample_shape if batch is None else (batch, *workload.sample_shape)
    if workload.vocab:
        return torch.randint(1, workload.vocab, shape, generator=generator)
    return torch.randn(shape, generator=generator)


def prepare(run_dir: Path, name: str) -> None:
    """Create the run's weights and inputs of a workload (the driver calls this once per run).

    The CNN's batch-norm statistics are set from one pass in training mode over random images, so the
    activations keep a realistic scale through the 50 layers (random init alone lets them explode).
    """
    workload = WORKLOADS[name]
    model = build(name)
    if name == "resnet50":
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.momentum = None  # cumulative average over the calibration pass
        model.train()
        with torch.no_grad():
            model(sample(workload, 8, seed=99))
        model.eval()
    torch.save(model.state_dict(), run_dir / f"{name}.weights.pt")
    inputs = {str(b): sample(workload, b, seed=10 + b) for b in workload.batch_sizes}
    inputs["tune"] = torch.stack([sample(workload, None, seed=100 + i) for i in range(8)])
    torch.save(inputs, run_dir / f"{name}.inputs.pt")
    numpy_inputs = {f"b{key}": value.numpy() for key, value in inputs.items() if key != "tune"}
    import numpy

    numpy.savez(run_dir / f"{name}.inputs.npz", **numpy_inputs)  # for runners that must not import torch


def load_inputs(run_dir: Path, name: str) -> dict[str, torch.Tensor]:
    """The inputs saved by :func:`prepare`: one batch per measured batch size and 8 tuning samples (``"tune"``)."""
    return torch.load(run_dir / f"{name}.inputs.pt", weights_only=True)
