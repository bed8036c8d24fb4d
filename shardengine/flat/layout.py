"""Flat-buffer layout: where each parameter lives and which slice each rank owns.

Pure arithmetic, no tensors and no communication, so every rule here is
checked by property tests (``tests/engine/test_layout.py``).

A *flat buffer* packs a list of parameters end to end and is padded with zeros
to a multiple of the world size N, so it splits into N equal, contiguous
*shards*; rank r owns elements ``[r * shard_numel, (r + 1) * shard_numel)``.
Collectives then always move whole, equal-sized shards, which is what
reduce-scatter and all-gather need.

>>> layout = FlatLayout.build([(2, 3), (5,)], world_size=4)
>>> layout.numel, layout.padded_numel, layout.shard_numel
(11, 12, 3)
>>> layout.owned_range(1)
(3, 6)
>>> [(f.slot, f.param_start, f.param_end) for f in layout.fragments(1)]
[(0, 3, 6)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of ``world_size`` that holds ``numel`` elements."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return math.ceil(numel / world_size) * world_size


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in a flat buffer."""

    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter that falls inside one rank's shard.

    ``param_start:param_end`` index the flattened parameter;
    ``shard_start`` is where that piece begins inside the shard.
    """

    slot: int
    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class FlatLayout:
    """Parameters packed end to end, padded to a multiple of ``world_size``."""

    slots: tuple[ParamSlot, ...]
    world_size: int

    @staticmethod
    def build(shapes: Iterable[Sequence[int]], world_size: int) -> "FlatLayout":
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        slots, offset = [], 0
        for shape in shapes:
            numel = math.prod(shape)
            slots.append(ParamSlot(tuple(shape), offset, numel))
            offset += numel
        return FlatLayout(tuple(slots), world_size)

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (no padding)."""
        return self.slots[-1].end if self.slots else 0

    @property
    def padded_numel(self) -> int:
        return padded_numel(self.numel, self.world_size)

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def padding_spans(self) -> list[tuple[int, int]]:
        """``[start, end)`` of the elements that belong to no parameter (here: the tail)."""
        return [(self.numel, self.padded_numel)] if self.padding else []

    def owned_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the flat buffer that ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def fragments(self, rank: int) -> list[Fragment]:
        """Pieces of parameters inside ``rank``'s shard, in buffer order.

        Padding is never part of a fragment; zero-sized parameters have none.
        """
        start, end = self.owned_range(rank)
        pieces = []
        for index, slot in enumerate(self.slots):
            lo, hi = max(slot.offset, start), min(slot.end, end)
            if lo < hi:
                pieces.append(Fragment(index, lo - slot.offset, hi - slot.offset, lo - start))
        return pieces


def split_into_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Group consecutive items into buckets of at most ``bucket_numel`` elements.

    An item larger than the cap gets a bucket of its own: parameters are never
    split across buckets. Returns lists of item indices, covering every item
    once, in order.

    >>> split_into_buckets([4, 4, 4, 10, 1], bucket_numel=8)
    [[0, 1], [2], [3], [4]]
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        if current and filled + numel > bucket_numel:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numel
    if current:
        buckets.append(current)
    return buckets
