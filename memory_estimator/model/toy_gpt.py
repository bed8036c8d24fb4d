"""A small GPT-style model for examples, tests and the traced benchmark.

``memory-estimator --module memory_estimator.model.toy_gpt:build`` estimates it; because this
module defines ``example_inputs(micro_batch, seq_len)``, activations are traced.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTShape:
    vocab: int = 1024
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    max_seq_len: int = 256


class Block(nn.Module):
    """Pre-norm transformer block: fused-attention (SDPA) + 4h GELU MLP."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.norm_attn = nn.LayerNorm(shape.hidden)
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.proj = nn.Linear(shape.hidden, shape.hidden)
        self.norm_mlp = nn.LayerNorm(shape.hidden)
        self.up = nn.Linear(shape.hidden, 4 * shape.hidden)
        self.down = nn.Linear(4 * shape.hidden, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm_attn(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm_mlp(x))))


class ToyGPT(nn.Module):
    """GPT-2-like decoder with a tied LM head; ``forward`` returns the mean LM loss."""

    def __init__(self, shape: GPTShape = GPTShape()) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(shape.vocab, shape.hidden)
        self.position_embedding = nn.Embedding(shape.max_seq_len, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: one tensor, counted once

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def build() -> ToyGPT:
    """Zero-argument factory for ``--module memory_estimator.model.toy_gpt:build``."""
    return ToyGPT()


def example_inputs(micro_batch: int, seq_len: int) -> torch.Tensor:
    """Token ids of the requested shape (created on the ambient device: meta when traced)."""
    return torch.zeros(micro_batch, min(seq_len, GPTShape.max_seq_len), dtype=torch.long)
