"""Built-in demo models and the ``torch-tweak demo`` run."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """A mini ResNet-like classifier for 3x32x32 images."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


def small_cnn() -> tuple[nn.Module, list[torch.Tensor]]:
    """The demo CNN (eval mode, fixed seed) and a few sample images."""
    torch.manual_seed(0)
    model = SmallCNN().eval()
    return model, [torch.randn(3, 32, 32) for _ in range(4)]
