"""Whole-tensor optimizers: which param groups need whole parameters, and their bucket layout.

An optimizer is *whole-tensor* when the update of a parameter reads the whole
parameter's gradient and state, not element by element: ``torch.optim.Muon``
(Newton-Schulz orthogonalization of each momentum matrix) and
``torch.optim.Adafactor`` (row and column second moments of each matrix), and
any class the user declares with the ``whole_tensor_optimizers`` option.

At stages >= 1 their buckets use the owner layout (flat/owner_layout.py): each
parameter lives whole in one rank's shard, so the owner alone computes its
update, once per shard group, and the other ranks receive the result with the
all-gather they run anyway. Element-wise optimizers keep the plain layout
(finer balance, no extra padding). Pieces of a whole-tensor bucket are given
the parameter's real shape (a flat view would look 1-D to Muon and be stepped
unfactored by Adafactor), also at stage 0 when mixed precision steps fp32
masters.

>>> import torch
>>> net = torch.nn.Linear(4, 4)
>>> is_whole_tensor(torch.optim.Muon([net.weight]), declared=())
True
>>> is_whole_tensor(torch.optim.AdamW(net.parameters()), declared=())
False
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..flat.layout import FlatLayout
from ..flat.owner_layout import build_owner_layout

# The update of a parameter reads its whole gradient and state (a matrix function of them).
WHOLE_TENSOR_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name))


def inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers stepped together: a container's members, else ``[optimizer]``."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def is_whole_tensor(optimizer: torch.optim.Optimizer, declared: Sequence[type]) -> bool:
    return isinstance(optimizer, WHOLE_TENSOR_OPTIMIZERS + tuple(declared))


def whole_tensor_groups(optimizer: torch.optim.Optimizer, declared: Sequence[type]) -> frozenset[int]:
    """Indices into ``optimizer.param_groups`` (a container's, concatenated) stepped by a
    whole-tensor optimizer."""
    indices, position = set(), 0
    for inner in inner_optimizers(optimizer):
        count = len(inner.param_groups)
        if is_whole_tensor(inner, declared):
            indices.update(range(position, position + count))
        position += count
    return frozenset(indices)


class BucketLayouts:
    """Lays out an engine's buckets in planning order; every rank plans the same order, so
    every rank computes the same owners."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.owned = [0] * world_size  # elements each rank owns in whole-tensor buckets so far

    def layout(self, shapes: Sequence[Sequence[int]], whole_tensor: bool, steps_whole: bool) -> FlatLayout:
        """The owner layout for a whole-tensor bucket that is sharded; the plain one otherwise."""
        if not whole_tensor or steps_whole:
            return FlatLayout.build(shapes, self.world_size)
        layout = build_owner_layout(shapes, self.world_size, self.owned)
        self.owned = [a + b for a, b in zip(self.owned, layout.loads())]
        return layout


