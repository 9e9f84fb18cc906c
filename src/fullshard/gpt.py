"""A GPT-style decoder used by the benchmarks, the tests and the trainer.

Token and position embeddings, pre-norm blocks (causal self-attention, GELU
MLP), a final LayerNorm and an output head tied to the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    dim: int = 256
    n_heads: int = 4
    hidden: int = 1024
    n_layers: int = 12
    seq_len: int = 128
    checkpoint_mlp: bool = False  # recompute each block's MLP in backward (non-reentrant)
    checkpoint_blocks: bool = False  # recompute each whole block in backward (non-reentrant)

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.dim, self.n_heads, self.hidden, self.n_layers, self.seq_len) < 1:
            raise ValueError(f"GPTConfig: every size must be positive: {self}")
        if self.dim % self.n_heads:
            raise ValueError(f"GPTConfig: dim {self.dim} is not divisible by n_heads {self.n_heads}")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, cfg.dim))
        self.checkpoint_mlp = cfg.checkpoint_mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        if self.checkpoint_mlp:
            return x + checkpoint(self.mlp, h, use_reentrant=False)
        return x + self.mlp(h)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm scales."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.cfg.checkpoint_blocks else block(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``tokens`` (batch, seq + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
