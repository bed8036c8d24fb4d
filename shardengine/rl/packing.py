"""Entries packed into buckets under a byte cap, and where each tensor lands in its bucket's buffers.

[Note: the cap counts everything a bucket holds]
A bucket's cost is what it holds at its peak on a receiving rank: its outputs, the inputs
staged beside them (a merged weight's W in its training dtype, the adapters, a quantized
weight's codes) and the largest temporary one entry's formation allocates (a LoRA delta, a
dequantized weight). Buckets are packed greedily in stream order up to a limit; the
stream gathers the next bucket while the current one is consumed only when both together
fit the cap (stream.py), so with ``overlap`` the limit is half the cap. An entry costing
more than the limit is a bucket of its own and is never overlapped with another that
would push the pair past the cap: the most a rank holds at once is the larger of the cap
and the costliest single entry (:func:`peak_bound`).

Each input gets a :class:`Place`: the output buffer of its dtype when it lands in the
output itself, else a staging buffer of its dtype, at consecutive offsets, so that
consecutive parameters of one flat bucket travel as one message (transfer.py).

>>> pack([3, 3, 5, 1, 9, 1], limit=6, cost=sum)
[[3, 3], [5, 1], [9], [1]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import torch

from .entries import Entry

OUT, STAGED = "out", "staged"
Item = TypeVar("Item")


@dataclass(frozen=True)
class Place:
    """Elements ``[offset, offset + numel)`` of the bucket buffer ``(kind, dtype)``."""

    kind: str
    dtype: torch.dtype
    offset: int
    numel: int

    @property
    def key(self) -> tuple[str, torch.dtype]:
        return self.kind, self.dtype


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: its entries, where each entry's output and inputs land, and its buffers' sizes."""

    index: int
    entries: tuple[Entry, ...]
    outputs: tuple[Place, ...]                  # per entry
    inputs: tuple[tuple[Place, ...], ...]       # per entry, per input
    sizes: dict = field(default_factory=dict)   # (kind, dtype) -> elements

    @property
    def out_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def cost(self) -> int:
        return bucket_cost(self.entries)

    @property
    def held_bytes(self) -> int:
        """What the bucket holds once formed (its outputs and staged inputs), until it is released."""
        return sum(e.nbytes + sum(i.nbytes for i in e.staged) for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [name for entry in self.entries for name in entry.names]


def bucket_cost(entries: Sequence[Entry]) -> int:
    """Bytes a bucket of ``entries`` holds at its peak (see the Note)."""
    if not entries:
        return 0
    held = sum(e.nbytes + sum(i.nbytes for i in e.staged) for e in entries)
    return held + max(e.transient_bytes for e in entries)


def pack(items: Sequence[Item], limit: int, cost: Callable[[list], int] = bucket_cost) -> list[list[Item]]:
    """Consecutive items in buckets whose ``cost`` stays within ``limit``; an item over it alone."""
    buckets: list[list[Item]] = []
    current: list[Item] = []
    for item in items:
        if current and cost(current + [item]) > limit:
            buckets.append(current)
            current = []
        current.append(item)
    if current:
        buckets.append(current)
    return buckets


def plan_bucket(index: int, entries: Sequence[Entry]) -> BucketPlan:
    """Places for every output and input of ``entries``, packed end to end per buffer."""
    sizes: dict = {}

    def take(kind: str, dtype: torch.dtype, numel: int) -> Place:
        offset = sizes.get((kind, dtype), 0)
        sizes[(kind, dtype)] = offset + numel
        return Place(kind, dtype, offset, numel)

    outputs, inputs = [], []
    for entry in entries:
        out = take(OUT, entry.dtype, entry.numel)
        outputs.append(out)
        places = [out if entry.direct and k == 0 else take(STAGED, i.dtype, i.numel)
                  for k, i in enumerate(entry.inputs)]
        inputs.append(tuple(places))
    return BucketPlan(index, tuple(entries), tuple(outputs), tuple(inputs), sizes)


def peak_bound(plans: Sequence[BucketPlan], cap: int) -> int:
    """The most bytes the stream holds at once on a receiving rank: the cap, or one bucket over it."""
    return max([cap] + [p.cost for p in plans])
