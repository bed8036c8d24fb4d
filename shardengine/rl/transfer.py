"""One bucket's gathers: each owner's slice of each sharded input, to the ranks that receive.

[Note: owners send their own slices]
A sharded input occupies elements ``[lo, hi)`` of its flat bucket's layout, and rank p of
the shard group holds ``[lo, hi) ∩ owned_range(p)``. Each owner casts its piece straight
into the receiving buffer's matching elements and sends it from there: when every rank of
the group receives, one broadcast per owner piece (in place, as Gloo's all-gather is
issued here anyway: communicator.py); when only some ranks receive, point-to-point sends
to those ranks, and a rank that does not receive allocates nothing but the cast of its
own piece while it is being sent (none when the piece is already in the stream's dtype).
Consecutive parameters of one flat bucket that land consecutively in the bucket's buffer
travel as one range, so a bucket costs about one message per owner per flat bucket it
touches. The transfers are computed from the bucket's plan alone (never from tensors), so
every rank issues the same messages in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..distributed.communicator import Communicator
from ..distributed.work import Work
from ..flat.bucket import FlatBucket
from .packing import BucketPlan, Place
from .sources import LocalSource, SlotSource, held_values

LABEL = "weight_stream"  # the stream's bytes in comm_stats()


@dataclass(frozen=True)
class Transfer:
    """Elements ``[lo, hi)`` of ``bucket``'s values, in ``dtype``, into ``place``."""

    bucket: FlatBucket
    lo: int
    hi: int
    dtype: torch.dtype
    place: Place

    def follows(self, other: "Transfer") -> bool:
        """Whether this range continues ``other``'s, in the source and in the buffer."""
        return (self.bucket is other.bucket and self.dtype == other.dtype and self.lo == other.hi
                and self.place.key == other.place.key and self.place.offset == other.place.offset + other.place.numel)

    def joined(self, other: "Transfer") -> "Transfer":
        place = Place(other.place.kind, other.place.dtype, other.place.offset, other.place.numel + self.place.numel)
        return Transfer(self.bucket, other.lo, self.hi, self.dtype, place)


@dataclass(frozen=True)
class LocalCopy:
    """An input every rank holds whole: copied (cast) into its place on a receiving rank."""

    values: torch.Tensor
    place: Place


def split(plan: BucketPlan) -> tuple[list[Transfer], list[LocalCopy]]:
    """The bucket's collective ranges (consecutive ones joined) and its local copies."""
    transfers: list[Transfer] = []
    copies: list[LocalCopy] = []
    for entry, places in zip(plan.entries, plan.inputs):
        for item, place in zip(entry.inputs, places):
            source = item.source
            if isinstance(source, LocalSource):
                copies.append(LocalCopy(source.tensor, place))
                continue
            held = held_values(source.bucket, item.dtype)
            if held.whole:
                values = held.values[source.lo - held.start:source.hi - held.start]
                copies.append(LocalCopy(values, place))
                continue
            transfer = Transfer(source.bucket, source.lo, source.hi, item.dtype, place)
            if transfers and transfer.follows(transfers[-1]):
                transfer = transfer.joined(transfers.pop())
            transfers.append(transfer)
    return transfers, copies


class TransferIssuer:
    """Issues buckets' transfers over one shard group (see the module's Note).

    ``receivers``: the group ranks that receive (every rank when None).
    """

    def __init__(self, comm: Communicator, receivers: Optional[list[int]], device: torch.device) -> None:
        self.comm, self.device = comm, device
        everyone = list(range(comm.world_size))
        self.receivers = everyone if receivers is None else sorted(receivers)
        self.broadcasting = self.receivers == everyone
        self.receives = comm.rank in self.receivers

    def issue(self, transfers: list[Transfer], buffers: Optional[dict]) -> tuple[list[Work], list[torch.Tensor]]:
        """Start every transfer; returns the works and the send-side tensors to keep until they end.
        ``buffers`` (the bucket's, by place key) is None on a rank that does not receive."""
        works: list[Work] = []
        kept: list[torch.Tensor] = []
        for transfer in transfers:
            self._issue_one(transfer, buffers, works, kept)
        return works, kept

    def _issue_one(self, transfer: Transfer, buffers: Optional[dict], works: list[Work],
                   kept: list[torch.Tensor]) -> None:
        layout, me = transfer.bucket.layout, self.comm.rank
        held = held_values(transfer.bucket, transfer.dtype) if self._owns_any(transfer) else None
        for owner in range(self.comm.world_size):
            start, stop = layout.owned_range(owner)
            a, b = max(transfer.lo, start), min(transfer.hi, stop)
            if a >= b:
                continue
            dest = _view(buffers, transfer.place, a - transfer.lo, b - a) if buffers is not None else None
            mine = held.values[a - held.start:b - held.start] if owner == me else None
            if self.broadcasting:
                if mine is not None:
                    dest.copy_(mine)
                works.append(self.comm.broadcast(dest, src=owner, label=LABEL, async_op=True))
            elif mine is not None:
                payload = self._payload(mine, dest, transfer.dtype, kept)
                works += [self.comm.send(payload, q, LABEL) for q in self.receivers if q != me]
            elif dest is not None:
                works.append(self.comm.recv(dest, owner))

    def _owns_any(self, transfer: Transfer) -> bool:
        start, stop = transfer.bucket.layout.owned_range(self.comm.rank)
        return max(transfer.lo, start) < min(transfer.hi, stop)

    def _payload(self, mine: torch.Tensor, dest: Optional[torch.Tensor], dtype: torch.dtype,
                 kept: list[torch.Tensor]) -> torch.Tensor:
        """What an owner sends: its own copy in the bucket when it receives too, else its slice,
        cast (and moved to the stream's device) only if it must be."""
        if dest is not None:
            dest.copy_(mine)
            return dest
        if mine.dtype == dtype and mine.device == self.device and mine.is_contiguous():
            return mine
        payload = mine.to(device=self.device, dtype=dtype)
        kept.append(payload)
        return payload


def _view(buffers: dict, place: Place, start: int, numel: int) -> torch.Tensor:
    return buffers[place.key][place.offset + start:place.offset + start + numel]
