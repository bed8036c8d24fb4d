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

from ..flat.layout import FlatLayout, split_into_buckets
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


def plan_whole_tensor_buckets(numels_and_shapes: Sequence[tuple[int, tuple]], world_size: int,
                              bucket_numel: int) -> list[list[int]]:
    """Stages 1-2: which parameters of a whole-tensor param group share a bucket.

    [Note: buckets of equal matrices]
    Cutting the group in order, as for element-wise optimizers, gives buckets of
    one or two matrices once matrices are large (a Llama MLP matrix alone passes
    25 MB), and an owner-layout bucket of one matrix is padded to N times its
    size in memory and on the wire. Transformers repeat a few shapes, so each
    bucket here holds a multiple of N matrices of one size (as many as fit
    the size cap, at least N): every rank owns the same number of equal
    matrices and there is no padding. Leftovers (fewer than N of a size) share
    buckets with room for N of the largest of them, balanced by the greedy
    partition. Buckets are ordered
    by when their last gradient arrives (the items' order is backward's), so
    the fixed reduction order of reducer.py still follows backward; a bucket
    then holds gradients of up to N layers' matrices before it is reduced.

    ``numels_and_shapes``: the group's parameters in backward order. Returns
    lists of indices into it.

    >>> plan_whole_tensor_buckets([(6, (2, 3))] * 5 + [(4, (2, 2))], world_size=2, bucket_numel=12)
    [[0, 1], [2, 3], [4, 5]]
    """
    by_size: dict[int, list[int]] = {}  # equal sizes balance as well as equal shapes (W and W.T)
    for index, (numel, _) in enumerate(numels_and_shapes):
        by_size.setdefault(numel, []).append(index)
    buckets, leftovers = [], []
    for numel, indices in by_size.items():
        per_bucket = world_size * max(1, bucket_numel // (world_size * max(1, numel)))
        full = len(indices) // world_size * world_size
        for start in range(0, full, per_bucket):
            buckets.append(indices[start:min(start + per_bucket, full)])
        leftovers += indices[full:]
    leftovers.sort()
    # room for about N of the largest leftovers per bucket, so the greedy partition can balance
    cap = max([bucket_numel] + [world_size * numels_and_shapes[i][0] for i in leftovers])
    for chunk in split_into_buckets([numels_and_shapes[i][0] for i in leftovers], cap):
        buckets.append([leftovers[i] for i in chunk])
    return sorted(buckets, key=max)
