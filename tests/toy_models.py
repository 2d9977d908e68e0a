"""Tiny models shared by the tests."""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import nn

Pair = collections.namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    score: torch.Tensor | None = None


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    ).eval()


class SeqModel(nn.Module):
    """Token ids + mask → dict output; the sequence length varies independently of the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.proj(self.emb(input_ids))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return {"last_hidden_state": h, "pooled": h.mean(dim=1)}


class KwargsModel(nn.Module):
    """Positional tensor, optional tensor kwarg, float kwarg; namedtuple output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> Pair:
        y = self.lin(x) * scale
        if mask is not None:
            y = y * mask
        return Pair(y, y.sum(dim=-1))


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> Out:
        h = self.lin(x)
        return Out(hidden=h, score=h.max(dim=-1).values)


class Doubler(nn.Module):
    """Calls its child on a doubled batch (like classifier-free guidance)."""

    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(torch.cat([x, x])).chunk(2)[0]


class Pipeline(nn.Module):
    """Two submodules called in sequence."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


class BnCNN(nn.Module):
    """Convolution, batch norm and a linear head (batch norm folds differently in each compiler)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


class PaddedCausalAttention(nn.Module):
    """Causal self-attention over a left-padded batch (batched generation): a pad position's query row sees no key.
    The mask is boolean, or additive (0 and -inf) with ``additive=True``."""

    def __init__(self, additive: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.additive = additive
        self.eval()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool).tril() & attention_mask.bool()[:, None, None, :]
        if self.additive:
            mask = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, float("-inf"))
        return self.out(nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, 16))


def left_padded_call(batch: int, seq: int) -> tuple:
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, : seq // 2] = 0
    return (torch.randn(batch, seq, 16),), {"attention_mask": mask}
