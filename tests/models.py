"""Small models for the tests; every shape is chosen so it does not divide by 2 or 4."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fullshard.gpt import GPT, GPTConfig, lm_loss

__all__ = ["MLP", "Transformer", "lm_loss", "mse_loss"]


class MLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (7, 13, 5, 3)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class Transformer(GPT):
    """A tiny GPT: vocabulary 37, width 12, 3 heads, MLP width 30, sequence 9."""

    def __init__(self, n_blocks: int = 2, checkpoint_mlp: bool = False) -> None:
        super().__init__(GPTConfig(vocab_size=37, dim=12, n_heads=3, hidden=30, n_layers=n_blocks, seq_len=9,
                                   checkpoint_mlp=checkpoint_mlp))


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)
