"""The tests' toy models and optimizers: one ``Net`` of small blocks, one ``make_optimizer``.

``Net`` is Embedding -> ``nn.ModuleList`` of blocks (stage-3 units) -> head, and each
option adds one thing an engine must get right: a tied head, a frozen block, a buffer,
a branch some ranks skip, a block applied twice, bias-free layers, an empty parameter,
residual MLP blocks, a parameter with no ``reset_parameters()`` (its parent initializes
it), a non-persistent buffer computed in ``__init__``. Construction draws from torch's
global RNG in a fixed order (embedding, blocks, extra, head), so a seed gives the same
weights whatever options leave layers out.

>>> net = Net(vocab=7, dim=5, hidden=[3], tied=True)
>>> [name for name, _ in net.named_parameters()]
['embed.weight', 'blocks.0.lin.weight', 'blocks.0.lin.bias', 'blocks.1.lin.weight', 'blocks.1.lin.bias', 'head.bias']
>>> type(make_optimizer(net, "sgd_momentum")).__name__, len(make_optimizer(net, "adam", groups="blocks").param_groups)
('SGD', 2)
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import nn


class Scale(nn.Module):
    """A parameter with no reset_parameters(): its parent initializes it."""

    def __init__(self, dim: int):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Rotary(nn.Module):
    """A non-persistent buffer computed in __init__, and no parameters."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq.repeat(2)


class Block(nn.Module):
    """tanh(Linear(x)), optionally times a ``Scale`` gain."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True, scaled: bool = False):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=bias)
        self.scale = Scale(d_out) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.lin(x))
        return x if self.scale is None else self.scale(x)


class ResidualBlock(nn.Module):
    """x + down(tanh(up(x))), with an odd hidden width (2·width + 1)."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width + 1), nn.Linear(2 * width + 1, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Embedding -> ModuleList of blocks -> head.

    Blocks map ``[dim] + hidden + [dim]`` pairwise (``residual``: every width must be
    ``dim``). ``tied``: the head's weight is the embedding's. ``frozen``: True freezes the
    middle block, an int the block at that index (mod the count). ``buffer``: a ``shift``
    buffer added after the embedding. ``extra``: a root-level layer used only when
    ``forward(..., use_extra=True)`` (a branch that may be skipped). ``shared_twice``:
    block 0 maps dim -> dim and runs twice. ``bias=False``: bias-free blocks and head.
    ``empty``: a 0-element parameter. ``scaled``: blocks end in a ``Scale``. ``rotary``:
    a ``Rotary`` after the embedding.
    """

    def __init__(self, vocab: int, dim: int, hidden: list[int], tied: bool = False,
                 frozen: Union[bool, int, None] = False, buffer: bool = True, extra: bool = False,
                 shared_twice: bool = False, bias: bool = True, empty: bool = False,
                 residual: bool = False, scaled: bool = False, rotary: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        if shared_twice:
            hidden = [dim] + list(hidden)  # block 0 maps dim -> dim so it can repeat
        dims = [dim] + list(hidden) + [dim]
        if residual:
            assert len(set(dims)) == 1, f"residual blocks keep the width: {dims}"
            self.blocks = nn.ModuleList(ResidualBlock(dim) for _ in dims[1:])
        else:
            self.blocks = nn.ModuleList(Block(a, b, bias, scaled) for a, b in zip(dims, dims[1:]))
        self.extra = nn.Linear(dim, dim) if extra else None
        self.rotary = Rotary(dim) if rotary else None
        self.head = nn.Linear(dim, vocab, bias=bias)
        if tied:
            self.head.weight = self.embed.weight
        self._freeze(frozen)
        if buffer:
            self.register_buffer("shift", torch.linspace(-0.1, 0.1, dim))
        else:
            self.shift = None
        self.empty = nn.Parameter(torch.zeros(0)) if empty else None
        self.shared_twice = shared_twice

    def _freeze(self, frozen: Union[bool, int, None]) -> None:
        if frozen is None or frozen is False:
            return
        index = len(self.blocks) // 2 if frozen is True else frozen % len(self.blocks)
        for param in self.blocks[index].parameters():
            param.requires_grad_(False)

    def forward(self, ids: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        x = self.embed(ids)
        if self.shift is not None:
            x = x + self.shift
        if self.rotary is not None:
            x = self.rotary(x)
        if self.shared_twice:
            x = self.blocks[0](x)
        for block in self.blocks:
            x = block(x)
        if use_extra and self.extra is not None:
            x = x + torch.tanh(self.extra(x))
        out = self.head(x)
        return out if self.empty is None else out + self.empty.sum()


def build_model(spec: dict) -> Net:
    """``Net`` from a plain-data spec (vocab, dim, hidden and any of Net's options)."""
    options = ("tied", "frozen", "buffer", "extra", "shared_twice", "bias", "empty")
    return Net(spec["vocab"], spec["dim"], spec["hidden"], **{k: spec[k] for k in options if k in spec})


# --------------------------------------------------------------------------- optimizers

OPTIMIZERS = {  # name: class, hyperparameters of the one-group form
    "sgd": (torch.optim.SGD, {"lr": 1e-2}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    # its state is made in __init__ (not at the first step): a nonzero accumulator shows it is kept
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2, "initial_accumulator_value": 0.1}),
}

# groups="blocks": the blocks and the rest with different lr and weight decay (base lr, per group)
BLOCK_GROUPS = {
    "sgd": (0.1, {"lr": 0.05}, {"lr": 0.1}),
    "sgd_momentum": (0.1, {"lr": 0.05, "weight_decay": 0.01}, {"lr": 0.1, "weight_decay": 0.0}),
    "adam": (1e-2, {"lr": 3e-3, "weight_decay": 0.05}, {"lr": 1e-2, "weight_decay": 0.0}),
    "adamw": (1e-2, {"lr": 3e-3, "weight_decay": 0.05}, {"lr": 1e-2, "weight_decay": 0.0}),
    "adagrad": (1e-2, {"lr": 3e-3, "weight_decay": 0.05}, {"lr": 1e-2, "weight_decay": 0.0}),
}


def make_optimizer(target: Union[nn.Module, Iterable[nn.Parameter]], name: str = "adamw", *,
                   lr: Optional[float] = None, groups: Optional[str] = None) -> torch.optim.Optimizer:
    """The optimizer ``name`` (sgd, sgd_momentum — also spelt sgd-momentum, as the estimator
    does —, adam, adamw, adagrad) over a model or an iterable of parameters.

    ``groups``: None, one param group; ``"blocks"``, the parameters under ``blocks.`` and
    the rest as two groups with their own lr and weight decay (``BLOCK_GROUPS``);
    ``"head_bias"``, the head's bias alone, at lr 5e-3 and no weight decay. ``lr``
    replaces the base learning rate.
    """
    cls, defaults = OPTIMIZERS[name.replace("-", "_")]
    defaults = {**defaults, **({} if lr is None else {"lr": lr})}
    if groups is None:
        params = target.parameters() if isinstance(target, nn.Module) else target
        return cls(params, **defaults)
    named = list(target.named_parameters())
    if groups == "blocks":
        base_lr, block_group, rest_group = BLOCK_GROUPS[name.replace("-", "_")]
        param_groups = [{"params": [p for n, p in named if n.startswith("blocks.")], **block_group},
                        {"params": [p for n, p in named if not n.startswith("blocks.")], **rest_group}]
        return cls(param_groups, **{**defaults, "lr": base_lr if lr is None else lr})
    if groups == "head_bias":
        param_groups = [{"params": [p for n, p in named if n != "head.bias"]},
                        {"params": [target.head.bias], "lr": 5e-3, "weight_decay": 0.0}]
        return cls(param_groups, **defaults)
    raise ValueError(f"unknown param-group recipe {groups!r}")
