"""Activation offload: what a block saves goes to host memory in forward and comes back a block
ahead of its backward.

[Note: activation offload]
torchtune's ``OffloadActivations`` is the model: a block's saved tensors are copied
to pinned host memory as forward saves them, on a side stream, and each is brought
back before backward needs it. Here, per block (activations/blocks.py):

* forward: the block's pack hook copies each saved tensor of at least
  ``MIN_OFFLOAD_BYTES`` (torchtune's threshold) to the host, unless it is a
  parameter (or a view of one: the engine's flat buffers are not activations) or
  not dense (an ``expand``ed mask would be materialized); a tensor saved twice by
  the same block (``x`` read by q, k and v) is copied once. Under CUDA the copy runs
  on the engine's host-copy stream after the compute stream's work so far, and the
  device original stays referenced until the copy's event has completed (the
  caching allocator would reuse its block otherwise; streams.py's InFlight);
* backward: the first time a block's saved tensor is needed, all of that block's
  copies are brought back (if the block above did not already), and the copies of
  the block below are started on the side stream: one block ahead, as FSDP2
  prefetches one unit ahead. A brought-back copy is allocated from the compute
  stream (the side stream first waits for it), written on the side stream, and
  the compute stream waits for that copy's event just before autograd reads it.
  Device copies of a block are dropped when backward reaches the block below.

Off CUDA the same steps run as plain copies (on a CPU "host" and "device" are
the same memory; the mechanism, the exactness and the accounting are what is
exercised). The last block is never offloaded: backward needs it first.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from ..activation_rules import copied_to_host
from ..distributed.streams import CommStreams, InFlight
from .ledger import ActivationLedger, Token
from .saved import Kept, check_version, keep


def host_empty_like(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor of ``tensor``'s shape and strides (it is dense)."""
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu",
                               pin_memory=pin)


class HostMover:
    """Copies between the device and host memory: pinned, on a side stream with events under
    CUDA; plain copies elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = CommStreams(device)
        self.in_flight = InFlight()  # device originals whose copy to the host is still running

    def to_host(self, tensor: torch.Tensor, token: Token) -> tuple[torch.Tensor, Optional[Any]]:
        self.in_flight.release_finished()
        streams = self.streams
        host = host_empty_like(tensor, pin=streams.enabled)
        with streams.run_on(streams.host_copy):
            host.copy_(tensor, non_blocking=streams.enabled)
        event = streams.record(streams.host_copy)
        if event is not None:
            self.in_flight.hold(event, tensor, token)  # see the Note: the block must not be reused
        return host, event

    def to_device(self, host: torch.Tensor, after: Optional[Any]) -> tuple[torch.Tensor, Optional[Any]]:
        streams = self.streams
        target = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=self.device)
        with streams.run_on(streams.host_copy):
            streams.wait(after, streams.host_copy)
            target.copy_(host, non_blocking=streams.enabled)
        return target, streams.record(streams.host_copy)

    def ready(self, event: Optional[Any]) -> None:
        """The compute stream waits for a copy to the device before reading it."""
        self.streams.wait(event)


class HostCopy:
    """One saved tensor on the host, and (while its block's backward runs) back on the device."""

    __slots__ = ("host", "host_token", "to_host_event", "source", "version", "back", "back_event")

    def __init__(self, mover: HostMover, ledger: ActivationLedger, tensor: torch.Tensor):
        self.host, self.to_host_event = mover.to_host(tensor, ledger.keep(tensor))
        self.host_token = ledger.keep(self.host, on_host=True)
        self.source = weakref.ref(tensor)  # for the in-place check while the original lives
        self.version = tensor._version
        self.back: Optional[torch.Tensor] = None
        self.back_event: Optional[Any] = None

    def bring_back(self, mover: HostMover, ledger: ActivationLedger) -> None:
        if self.back is None:
            self.back, self.back_event = mover.to_device(self.host, self.to_host_event)
            ledger.keep_while_alive(self.back)

    def unpack(self, mover: HostMover, ledger: ActivationLedger) -> torch.Tensor:
        check_version(self.source(), self.version)
        self.bring_back(mover, ledger)
        mover.ready(self.back_event)
        return self.back


class Moved:
    """What a block's pack hook returns for an offloaded tensor."""

    __slots__ = ("copy", "stash")

    def __init__(self, copy: HostCopy, stash: "BlockStash"):
        self.copy, self.stash = copy, stash

    def unpack(self) -> torch.Tensor:
        self.stash.reached()
        return self.copy.unpack(self.stash.mover, self.stash.ledger)


class StashedKept(Kept):
    """A tensor a block keeps on the device; unpacking it tells the block its backward began."""

    __slots__ = ("stash",)

    def __init__(self, kept: Kept, stash: "BlockStash"):
        super().__init__(kept.tensor, kept.token)
        self.version, self.stash = kept.version, stash

    def unpack(self) -> torch.Tensor:
        self.stash.reached()
        return super().unpack()


class BlockStash:
    """One block's forward in one pass: what it moved to the host, in order."""

    def __init__(self, forward_pass: "ForwardPass", offloads: bool):
        self.forward_pass, self.offloads = forward_pass, offloads
        self.mover, self.ledger = forward_pass.mover, forward_pass.ledger
        self.index = len(forward_pass.stashes)
        self.copies: list[HostCopy] = []
        self._by_view: dict[tuple, tuple[weakref.ref, HostCopy]] = {}
        self.backward_reached = False

    def hooks(self):
        return self.pack, _unpack

    def pack(self, tensor: torch.Tensor) -> Any:
        if not self.offloads or not self._movable(tensor):
            return StashedKept(keep(self.ledger, tensor, self.forward_pass.host_device), self)
        storage = tensor.untyped_storage()
        key = (id(storage), tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()), tensor.dtype)
        found = self._by_view.get(key)
        if found is None or found[0]() is not storage:  # a freed storage's id may be reused
            found = (weakref.ref(storage), HostCopy(self.mover, self.ledger, tensor))
            self._by_view[key] = found
            self.copies.append(found[1])
        return Moved(found[1], self)

    def _movable(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.mover.device and copied_to_host(tensor)

    def reached(self) -> None:
        if not self.backward_reached:
            self.backward_reached = True
            self.forward_pass.backward_reached(self.index)

    def bring_back(self) -> None:
        for copy in self.copies:
            copy.bring_back(self.mover, self.ledger)

    def drop_device_copies(self) -> None:
        for copy in self.copies:
            copy.back = copy.back_event = None


def _unpack(packed: Any) -> torch.Tensor:
    return packed.unpack()


class ForwardPass:
    """One training forward of the model: its blocks' stashes in the order they ran.

    A stash lives as long as autograd holds one of its tensors (each packed tensor
    refers to it); the pass refers to them weakly, so a block whose backward is over
    frees its host copies at once, with no reference cycle to wait for."""

    def __init__(self, mover: HostMover, ledger: ActivationLedger, host_device: bool):
        self.mover, self.ledger, self.host_device = mover, ledger, host_device
        self.stashes: list[weakref.ref] = []

    def open_block(self, offloads: bool) -> BlockStash:
        stash = BlockStash(self, offloads)
        self.stashes.append(weakref.ref(stash))
        return stash

    def backward_reached(self, index: int) -> None:
        """Backward needs block ``index`` now: bring it back, start the one below, drop the one above."""
        self.mover.in_flight.release_finished()
        for neighbour, act in ((index, BlockStash.bring_back), (index - 1, BlockStash.bring_back),
                               (index + 1, BlockStash.drop_device_copies)):
            stash = self.stashes[neighbour]() if 0 <= neighbour < len(self.stashes) else None
            if stash is not None:
                act(stash)
