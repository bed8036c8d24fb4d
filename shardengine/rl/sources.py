"""Where one tensor's full values come from when the weights are streamed: a slot of a flat bucket
(every rank holds the whole bucket, or one slice of it), or a tensor every rank holds whole.

[Note: which copy a stream reads]
The stream's values are the training values (what ``full_state_dict()`` returns: the fp32
masters under mixed precision) cast to the requested dtype. Where that dtype is the compute
dtype and the full compute copy is live (stages 0-2), the compute copy *is* that cast (each
step and each load writes ``cast(master)`` into it), so it is read in place, with no
collective. Otherwise the owners' slices of the training values are read: the fp32 master
where it is a separate copy, else the compute-dtype slice (stage 3 keeps only that). A rank
casts its own slice before sending it, so the wire carries the requested dtype, as stage 3's
gathers cast the master into the gather buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..flat.bucket import FlatBucket


@dataclass(frozen=True, eq=False)
class SlotSource:
    """Parameter ``slot`` of a flat bucket: elements ``[lo, hi)`` of the bucket's flat layout."""

    bucket: FlatBucket
    slot: int

    @property
    def lo(self) -> int:
        return self.bucket.layout.slots[self.slot].offset

    @property
    def hi(self) -> int:
        return self.bucket.layout.slots[self.slot].end

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bucket.layout.slots[self.slot].shape)

    @property
    def training_dtype(self) -> torch.dtype:
        """The dtype ``full_state_dict()`` returns it in."""
        bucket = self.bucket
        return bucket.master.dtype if bucket.master_is_separate else bucket.dtype


@dataclass(frozen=True, eq=False)
class LocalSource:
    """A tensor every rank holds whole (a buffer, a frozen parameter outside the buckets)."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def training_dtype(self) -> torch.dtype:
        return self.tensor.dtype


Source = Union[SlotSource, LocalSource]


@dataclass(frozen=True)
class Held:
    """What this rank holds of a bucket's values for a stream in ``dtype``: flat elements
    ``[start, start + values.numel())`` of the layout; ``whole`` when that is every element."""

    values: torch.Tensor
    start: int
    whole: bool


def held_values(bucket: FlatBucket, dtype: torch.dtype) -> Held:
    """The copy a stream in ``dtype`` reads (see [Note: which copy a stream reads])."""
    padded = bucket.layout.padded_numel
    if dtype == bucket.dtype and bucket.full_params_live:
        return Held(bucket.full_param.detach(), 0, True)
    if bucket.master_is_separate:
        master = bucket.master.detach()
        whole = master.numel() == padded
        return Held(master, 0 if whole else bucket.owned.start, whole)
    if bucket.full_params_live:
        return Held(bucket.full_param.detach(), 0, True)
    return Held(bucket.kept_shard.detach(), bucket.owned.start, False)


def is_collective(source: Source, dtype: Optional[torch.dtype]) -> bool:
    """Whether reading ``source`` in ``dtype`` needs the other ranks' slices (the same answer on
    every rank: it depends on the stage and layout, not on the rank)."""
    if isinstance(source, LocalSource):
        return False
    return not held_values(source.bucket, dtype or source.training_dtype).whole
