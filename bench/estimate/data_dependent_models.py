"""Models whose memory follows their data, written as users write them: a top-2 mixture-of-experts
language model (each expert runs on the tokens routed to it: ``torch.where(chosen == e)``,
``index_add_``) and an MLP over the rows a boolean mask selects (``x[keep]``). The meta device
cannot run either (``nonzero`` has no size without values); ``bench/plan/sharded_door.py`` asks
``distmem.estimate`` about them and measures the same step."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MoELM", "MaskedMLP", "build", "example", "loss"]


class Expert(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    def __init__(self, d: int, hidden: int, experts: int, top: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(experts))
        self.top = top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm(x).reshape(-1, d)
        weights, chosen = torch.topk(self.router(h).softmax(-1), self.top, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
        return x + out.reshape(b, s, d)


class MoELM(nn.Module):
    def __init__(self, vocab: int, d: int, hidden: int, layers: int, experts: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MoEBlock(d, hidden, experts) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class MaskedMLP(nn.Module):
    """Scores only the rows whose first feature is positive (padding, invalid or filtered samples)."""

    def __init__(self, d: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, hidden), nn.ReLU(),
                                                                          nn.Linear(hidden, d))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = x[:, 0] > 0
        return self.layers(x[keep])


def build(name: str, dry: bool = False) -> nn.Module:
    if name == "moe_lm":
        return MoELM(1000, 64, 128, 2, 4) if dry else MoELM(32000, 1024, 2816, 4, 8)
    return MaskedMLP(32, 64, 2) if dry else MaskedMLP(1024, 4096, 4)


def example(name: str, batch: int, dry: bool = False, device: Any = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if name == "moe_lm":
        return torch.randint(0, 1000 if dry else 32000, (batch, 64 if dry else 512), generator=g).to(device)
    return torch.randn(batch, 32 if dry else 1024, generator=g).to(device)


def loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy for the LM (its targets are the batch), the mean square otherwise."""
    if batch.dtype == torch.long:
        logits = out[:, :-1].reshape(-1, out.shape[-1]).float()
        return torch.nn.functional.cross_entropy(logits, batch[:, 1:].reshape(-1))
    return out.float().pow(2).mean()
