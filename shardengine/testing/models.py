"""Small reference models shipped with shardengine.

They serve the example, the benchmarks, the tests and the memory estimator's
validation, so they are deliberately plain:

* :class:`GPT` - a GPT-2 style decoder. ``model.blocks`` is the repeated unit
  (one :class:`Block` per layer) that stage 3 wraps.
* :class:`MLP` - a stack of Linear layers of arbitrary (odd, prime) widths,
  handy for exercising padding and partitioning.

Both build under ``torch.device("meta")``: ``__init__`` only creates parameters,
and ``GPT.reset_parameters`` (deterministic, per-parameter seeded) skips meta
tensors, so it can fill them in after ``to_empty``.

Example::

    model = build_gpt("tiny", vocab_size=96, seq_len=64)
    idx, targets = example_inputs(micro_batch=4, seq_len=64, vocab_size=96)
    loss = lm_loss(model(idx), targets)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# name -> (n_layer, n_head, n_embd, default seq_len). The size in the name is
# the approximate parameter count of the transformer blocks (12 * L * E**2),
# i.e. without embeddings, which depend on the vocabulary.
_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 2, 64, 64),  # ~0.1M
    "1m": (4, 4, 128, 128),  # ~0.8M
    "10m": (6, 6, 384, 256),  # ~10.6M
    "27m": (10, 8, 480, 256),  # ~27.7M
    "50m": (10, 10, 640, 512),  # ~49.2M
    "100m": (14, 12, 768, 512),  # ~99.1M
}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`. ``seq_len`` is the block size (max context)."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    tie_embeddings: bool = True
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")

    @classmethod
    def preset(cls, name: str, vocab_size: int = 256, **overrides) -> "GPTConfig":
        """A named size (``tiny``, ``10m``, ``27m``, ``50m``, ``100m``); any field can be overridden."""
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}")
        n_layer, n_head, n_embd, seq_len = _PRESETS[name]
        fields = dict(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        fields.update(overrides)
        return cls(**fields)

    @staticmethod
    def preset_names() -> list[str]:
        return list(_PRESETS)

    def num_params(self) -> int:
        """Exact parameter count of ``GPT(self)``; a tied embedding counts once."""
        e, b = self.n_embd, int(self.bias)
        layer_norm = e + b * e
        linear = lambda n_in, n_out: n_in * n_out + b * n_out  # noqa: E731
        block = 2 * layer_norm + linear(e, 3 * e) + linear(e, e) + linear(e, 4 * e) + linear(4 * e, e)
        embeddings = self.vocab_size * e + self.seq_len * e
        head = 0 if self.tie_embeddings else self.vocab_size * e
        return embeddings + self.n_layer * block + layer_norm + head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = self.qkv(x).split(e, dim=2)
        # (b, t, e) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, e // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, e))


class FeedForward(nn.Module):
    """The transformer MLP: E -> 4E -> GELU -> E."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.out_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer layer: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """GPT-2 style language model; ``forward(idx)`` returns logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config, self.seed = cfg, seed
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Share the token embedding with the output head (when ``tie_embeddings``).

        ``Module.to_empty`` unties them (it rebuilds each module's parameters
        separately); ``reset_parameters`` calls this again.
        """
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Fixed init: N(0, 0.02) weights, residual projections N(0, 0.02/sqrt(2L)), zero biases, unit LayerNorm.

        Each parameter draws from its own CPU generator seeded by (``seed``,
        its index), so values are identical on every rank and device, ignore
        the global RNG, and do not depend on which other parameters are still
        on the meta device: materialize with ``to_empty(device=...)``, then
        call ``reset_parameters()``. Meta tensors are skipped.
        """
        self.tie_weights()
        base = (self.seed if seed is None else seed) * 1_000_003
        done: set[int] = set()  # a tied weight is drawn once
        for module_name, module in self.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) not in done and not p.is_meta:
                    gen = torch.Generator().manual_seed(base + len(done))
                    p.copy_(self._init_weights(module_name, module, name, p.shape, gen))
                done.add(id(p))

    def _init_weights(
        self, module_name: str, module: nn.Module, name: str, shape: torch.Size, gen: torch.Generator
    ) -> torch.Tensor:
        """Initial value (on CPU) of parameter ``name`` of ``module``."""
        if name == "bias":
            return torch.zeros(shape, device="cpu")
        if isinstance(module, nn.LayerNorm):
            return torch.ones(shape, device="cpu")
        residual = module_name.endswith("out_proj")  # projections that add into the residual stream
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02
        return torch.empty(shape, device="cpu").normal_(0.0, std, generator=gen)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab); with ``targets``, the mean loss instead.

        The loss form lets ``example_inputs`` (which returns ``(idx, targets)``)
        be fed straight in, e.g. by the memory estimator's traced mode.
        """
        t = idx.size(1)
        if t > self.config.seq_len:
            raise ValueError(f"sequence of length {t} exceeds seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else lm_loss(logits, targets)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_gpt(
    preset: str = "tiny", vocab_size: int = 256, seq_len: int | None = None, seed: int = 0, **overrides
) -> GPT:
    """A :class:`GPT` of a named preset; builds on the current default device (meta works)."""
    if seq_len is not None:
        overrides["seq_len"] = seq_len
    return GPT(GPTConfig.preset(preset, vocab_size=vocab_size, **overrides), seed=seed)


def example_inputs(
    micro_batch: int, seq_len: int, vocab_size: int = 256, seed: int = 0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids ``(idx, targets)``, each (micro_batch, seq_len); targets are idx shifted by one.

    The defaults match :func:`build_gpt`, so ``memory-estimator --module
    shardengine.testing.models:build_gpt --seq-len 64`` traces ``model(idx, targets)``.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (micro_batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


class MLP(nn.Module):
    """Linear layers of the given widths with GELU in between (none after the last).

    ``MLP([7, 13, 5])`` is Linear(7, 13) -> GELU -> Linear(13, 5). ``self.layers``
    is the repeated unit.
    """

    def __init__(self, sizes: Sequence[int], bias: bool = True) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"an MLP needs at least an input and an output size, got {list(sizes)}")
        self.sizes = tuple(sizes)
        self.layers = nn.ModuleList(nn.Linear(i, o, bias=bias) for i, o in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x

    def num_params(self) -> int:
        """Exact parameter count, computed from the sizes."""
        bias = int(self.layers[0].bias is not None)
        return sum(i * o + bias * o for i, o in zip(self.sizes[:-1], self.sizes[1:]))


def build_mlp(sizes: Sequence[int] = (31, 97, 13, 7), bias: bool = True) -> MLP:
    """A small :class:`MLP`; the default widths are prime, to exercise uneven sharding."""
    return MLP(sizes, bias=bias)
