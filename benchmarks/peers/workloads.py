"""The workloads: models built in code or from configs with random weights, their inputs and task metrics.

Every runner, in every environment, builds a workload's module with :func:`build` and then loads the
weights the driver saved once per run (``<run dir>/<workload>.weights.pt``), so all systems run the
very same weights on the very same inputs (``<run dir>/<workload>.inputs.pt``). Needs only torch, plus
transformers for the encoder.

Weights: no hub can be reached, so every model is randomly initialised. The default CNN's batch-norm
statistics are then recalibrated on image-like inputs (:func:`images`: smooth random fields with a
roughly 1/f spectrum, normalised with the ImageNet mean and std), so its activations have the scale a
trained network's have on real images; the same CNN with statistics from one batch of white noise and
fed white noise (``resnet50_random``) is kept as the worst case for reduced precision. The encoder is
``BertModel(BertConfig())``, initialised the way the original BERT was (normal, std 0.02; transformers
does this), with no training.

Task metrics (:data:`TASKS`): besides the element-wise error every table reports, each workload is judged
by what its task reads, on held-out inputs (``"eval"``, never the tuning samples): the CNN by top-1
agreement of its logits with eager's, the encoder by the cosine similarity of its CLS and token vectors,
the MLP by relative L2 error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Task:
    """How a workload's output is judged against eager's, and the bound a system must stay within."""

    kind: str  # "classifier", "encoder" or "regression" (see peers.common.task_metrics)
    metric: str  # the key of the runner's task record compared with the bound
    label: str  # the bound's metric, for the tables
    threshold: float
    higher_is_better: bool
    tt_fidelity: dict[str, Any]  # tt.FidelityConfig(**tt_fidelity): the same bound for torch_tweak's fidelity check

    def within(self, value: float | None) -> bool:
        """Whether ``value`` meets the bound (NaN and missing values do not)."""
        if value is None or value != value:
            return False
        return value >= self.threshold if self.higher_is_better else value <= self.threshold

    def describe(self) -> str:
        """``top-1 agreement ≥ 0.99`` style text."""
        return f"{self.label} {'≥' if self.higher_is_better else '≤'} {self.threshold:g}"


TASKS: dict[str, Task] = {
    "classifier": Task("classifier", "top1", "top-1 agreement", 0.99, True,
                       {"metric": "topk", "k": 1, "threshold": 0.99}),
    "encoder": Task("encoder", "cosine", "cosine (min over CLS and token vectors)", 0.99, True,
                    {"metric": "cosine", "threshold": 0.99}),
    "regression": Task("regression", "rel_l2", "relative L2", 0.05, False, {"metric": "rel_l2", "threshold": 0.05}),
}


@dataclass(frozen=True)
class Workload:
    """A model, the batch sizes it is measured at, the shape of one sample and how its outputs are judged."""

    name: str
    title: str
    batch_sizes: tuple[int, ...]
    sample_shape: tuple[int, ...]
    task: str  # key of TASKS
    eval_count: int  # held-out samples for the task metric
    eval_batch: int  # batch size the held-out samples are run at (one every system has already seen)
    inputs: str = "randn"  # "randn", "image" (see images()) or "tokens" (ids in [1, vocab))
    dtype: torch.dtype = torch.float32
    vocab: int = 0


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", "MLP 256-512-256", (1, 32), (256,), "regression", 1024, 32),
    "resnet50": Workload("resnet50", "ResNet-50-shaped CNN 224x224 (BN calibrated on image-like inputs)", (1, 32),
                         (3, 224, 224), "classifier", 100, 1, inputs="image"),
    "resnet50_random": Workload("resnet50_random", "ResNet-50-shaped CNN 224x224, random weights, noise inputs "
                                "(worst case)", (1, 32), (3, 224, 224), "classifier", 100, 1),
    "bert": Workload("bert", "BERT-base-shaped encoder seq 128", (1, 32), (128,), "encoder", 32, 1, inputs="tokens",
                     dtype=torch.long, vocab=30522),
}
CALIBRATION_BATCHES = 4  # batches of 8 image-like inputs that set the default CNN's batch-norm statistics


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
    elif name in ("resnet50", "resnet50_random"):
        model = ResNet50()
    elif name == "bert":
        model = Encoder()
    else:
        raise KeyError(f"unknown workload {name!r}")
    if weights is not None:
        # memory-mapped and assigned, so the weights are not held twice while loading (peak RSS stays the model's)
        model.load_state_dict(torch.load(weights, weights_only=True, mmap=True), assign=True)
    return model.eval()


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def images(count: int, seed: int, size: int = 224) -> torch.Tensor:
    """``count`` image-like inputs (N, 3, size, size), normalised like ImageNet.

    Each image is a sum of smooth random fields at six scales (2 to 64 cells across, bicubic upsampling,
    amplitude falling with the scale, so the spectrum falls off roughly like natural images'), with
    channels partly shared (colour correlation) and a random mean colour, clipped to [0, 1] and
    normalised with the ImageNet mean and std.
    """
    import torch.nn.functional as F  # noqa: N812

    generator = torch.Generator().manual_seed(seed)
    image = torch.zeros(count, 3, size, size)
    for cells, amplitude in ((2, 1.0), (4, 0.7), (8, 0.5), (16, 0.35), (32, 0.25), (64, 0.15)):
        shared = torch.randn(count, 1, cells, cells, generator=generator)
        own = torch.randn(count, 3, cells, cells, generator=generator)
        image += F.interpolate(amplitude * (shared + 0.5 * own), size=(size, size), mode="bicubic",
                               align_corners=False)
    image = image - image.mean(dim=(1, 2, 3), keepdim=True)
    image = image / image.std(dim=(1, 2, 3), keepdim=True) * 0.25 + 0.45
    image = (image + 0.1 * torch.randn(count, 3, 1, 1, generator=generator)).clamp(0, 1)
    return (image - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def sample(workload: Workload, batch: int | None, seed: int) -> torch.Tensor:
    """A random input: one sample (``batch=None``) or a batch."""
    generator = torch.Generator().manual_seed(seed)
    shape = workload.sample_shape if batch is None else (batch, *workload.sample_shape)
    if workload.inputs == "tokens":
        return torch.randint(1, workload.vocab, shape, generator=generator)
    if workload.inputs == "image":
        batch_of = images(1 if batch is None else batch, seed, workload.sample_shape[-1])
        return batch_of[0] if batch is None else batch_of
    return torch.randn(shape, generator=generator)


def _calibrate_batch_norm(model: nn.Module, batches: list[torch.Tensor]) -> None:
    """Set every batch norm's running statistics to the average over ``batches`` (train mode, no grad)."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None  # cumulative average over the calibration batches
    model.train()
    with torch.no_grad():
        for batch in batches:
            model(batch)
    model.eval()


def prepare(run_dir: Path, name: str, tune_samples: int = 8) -> None:
    """Create the run's weights and inputs of a workload (the driver calls this once per run).

    ``resnet50``: batch-norm statistics averaged over :data:`CALIBRATION_BATCHES` batches of 8
    image-like inputs (seeds of their own, neither tuning nor held-out inputs). ``resnet50_random``: one
    pass in training mode over 8 white-noise images, which only keeps the activations from exploding
    through the 50 layers (random init alone lets them grow). Inputs: one batch per measured batch size,
    ``tune_samples`` tuning samples (``"tune"``: what every tuner and quantizer sees as its data) and the held-out
    samples for the task metric (``"eval"``).
    """
    workload = WORKLOADS[name]
    model = build(name)
    if name == "resnet50":
        _calibrate_batch_norm(model, [images(8, seed=1000 + i) for i in range(CALIBRATION_BATCHES)])
    elif name == "resnet50_random":
        _calibrate_batch_norm(model, [sample(workload, 8, seed=99)])
    torch.save(model.state_dict(), run_dir / f"{name}.weights.pt")
    inputs = {str(b): sample(workload, b, seed=10 + b) for b in workload.batch_sizes}
    inputs["tune"] = torch.stack([sample(workload, None, seed=100 + i) for i in range(tune_samples)])
    inputs["eval"] = sample(workload, workload.eval_count, seed=5000)
    torch.save(inputs, run_dir / f"{name}.inputs.pt")
    numpy_inputs = {f"b{key}": value.numpy() for key, value in inputs.items() if key not in ("tune", "eval")}
    import numpy

    numpy.savez(run_dir / f"{name}.inputs.npz", **numpy_inputs)  # for runners that must not import torch


def load_inputs(run_dir: Path, name: str) -> dict[str, torch.Tensor]:
    """The inputs saved by :func:`prepare`: one batch per measured batch size, the tuning samples (``"tune"``)
    and the held-out samples (``"eval"``)."""
    return torch.load(run_dir / f"{name}.inputs.pt", weights_only=True)
