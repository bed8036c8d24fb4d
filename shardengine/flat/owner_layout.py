"""Owner layout: a flat buffer whose shards hold whole parameters.

The plain layout (layout.py) packs parameters end to end and cuts the buffer
into N equal slices, so a parameter may straddle ranks. That is exact for
element-wise optimizers only. Muon orthogonalizes each momentum *matrix*;
Adafactor keeps row and column statistics of each matrix: both need every
element of a parameter on the rank that steps it.

Here each parameter is given to one *owner* rank, and rank r's region of the
buffer, ``[r * shard_numel, (r + 1) * shard_numel)``, holds its parameters end
to end followed by padding up to the largest rank's load. Every collective of
the stages (reduce-scatter, all-gather) still moves N equal shards, so nothing
else in the engine changes: a reduce-scatter delivers each owner the whole
reduced gradient of its parameters, its optimizer steps them whole (once per
shard group), and the all-gather returns the updated matrices to everyone.

[Note: greedy partition by size]
Parameters are assigned largest first, each to the least-loaded rank (ties:
the lowest rank), as ``ZeroRedundancyOptimizer`` does; "load" counts what a
rank owns in the buckets planned before this one too, so the optimizer state
and the Newton-Schulz work spread over the ranks even when each bucket holds
one matrix (a stage-3 unit). The padded shard is the bucket's largest load,
so the bytes sent grow by ``N * max_load / total`` over the element-sharded
layout (up to N times for a bucket of one matrix). Within a region
parameters keep their bucket order.

>>> layout = build_owner_layout([(4, 4), (2, 3), (5,)], world_size=2)
>>> [s.offset for s in layout.slots], layout.shard_numel, layout.owners
([0, 16, 22], 16, (0, 1, 1))
>>> [(f.slot, f.param_start, f.param_end) for f in layout.fragments(1)]
[(1, 0, 6), (2, 0, 5)]
>>> layout.padding_spans()
[(27, 32)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .layout import FlatLayout, ParamSlot, split_into_buckets


def owner_partition(numels: Sequence[int], world_size: int,
                    prior_loads: Optional[Sequence[int]] = None) -> list[int]:
    """The owner rank of each item: largest first, to the least-loaded rank.

    ``prior_loads``: what each rank already owns in earlier buckets, so that many
    small buckets (stage-3 units of one matrix each) do not all land on rank 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = list(prior_loads) if prior_loads is not None else [0] * world_size
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += numels[index]
    return owners


@dataclass(frozen=True)
class OwnerLayout(FlatLayout):
    """A :class:`FlatLayout` whose rank regions each hold whole parameters (see module doc)."""

    owners: tuple[int, ...] = ()
    region_numel: int = 0  # the padded shard: the largest rank's load

    @property
    def numel(self) -> int:
        return sum(slot.numel for slot in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.region_numel * self.world_size

    @property
    def shard_numel(self) -> int:
        return self.region_numel

    def loads(self) -> list[int]:
        """Real (unpadded) elements each rank owns."""
        loads = [0] * self.world_size
        for slot, owner in zip(self.slots, self.owners):
            loads[owner] += slot.numel
        return loads

    def padding_spans(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each region's padding."""
        return [(r * self.region_numel + load, (r + 1) * self.region_numel)
                for r, load in enumerate(self.loads()) if load < self.region_numel]


def build_owner_layout(shapes: Sequence[Sequence[int]], world_size: int,
                       prior_loads: Optional[Sequence[int]] = None) -> OwnerLayout:
    """Place each parameter whole in its owner's region (see [Note: greedy partition by size])."""
    numels = [math.prod(shape) for shape in shapes]
    owners = owner_partition(numels, world_size, prior_loads)
    loads = [0] * world_size
    for numel, owner in zip(numels, owners):
        loads[owner] += numel
    region = max(loads) if loads else 0
    filled = [0] * world_size
    slots = []
    for shape, numel, owner in zip(shapes, numels, owners):
        slots.append(ParamSlot(tuple(shape), owner * region + filled[owner], numel))
        filled[owner] += numel
    return OwnerLayout(tuple(slots), world_size, tuple(owners), region)


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
