"""Gradients of trainable parameters that no optimizer param group holds, kept across windows.

[Note: a gradient the optimizer does not own]
torch's ``optimizer.zero_grad()`` clears its own parameters' ``.grad`` only, and a
step leaves every ``.grad`` alone: a trainable parameter outside the optimizer keeps
accumulating until ``model.zero_grad()`` (DDP and FSDP2 behave the same). A later
``add_param_group`` of it then steps with everything accumulated so far. The
engine's window, though, normalizes its gradients once (divides by the agreed
divisor D, see [Note: gradient windows] in window.py) and the step or
``zero_grad`` ends it for every bucket.

So a bucket none of whose parameters is in a param group (``outside``) is left
alone by the window's end: its buffers, its ``window_fresh`` and (at stages 1-3)
its guard stay, and a copy of its normalized gradient g is ``carried``. The next
window's reductions add their raw sum r on top (reduction is linear; at stages 0-1
the weighted micro-steps rescale the buffer and undo it before the reduction, so g
passes through), and its normalization divides everything by the new D; adding
(1 - 1/D)·g gives g + r/D, each window normalized by its own divisor as torch's
losses are. ``reopen`` takes the same term back before it multiplies by D. The
copy costs one gradient of those buckets only: none in the ordinary case, where
every trainable parameter is in the optimizer. ``model.zero_grad()`` clears them.
"""

from __future__ import annotations

from typing import Sequence

from ..flat.bucket import FlatBucket


def outside(buckets: Sequence[FlatBucket], grouped: set[int]) -> list[FlatBucket]:
    """The trainable buckets none of whose parameters is in a param group (ids in ``grouped``)."""
    return [b for b in buckets if b.requires_grad and not any(id(p) in grouped for p in b.params)]


def carry(bucket: FlatBucket) -> None:
    """At the window's end: remember the bucket's normalized gradient (none: nothing to carry)."""
    if bucket.window_fresh or bucket.grad_shard is None:
        return
    if bucket.carried is None or bucket.carried.shape != bucket.grad_shard.shape:
        bucket.carried = bucket.grad_shard.clone()
    else:
        bucket.carried.copy_(bucket.grad_shard)


def holding(buckets: Sequence[FlatBucket]) -> set[int]:
    """Ids of the parameters with a carried gradient: they hold one, used in this window or not."""
    return {id(p) for b in buckets if b.carried is not None for p in b.params}


def add_back(buckets: Sequence[FlatBucket], divisor: float) -> None:
    """After the window's gradients were divided by ``divisor``: the carried part undivided."""
    _shift(buckets, 1.0 - 1.0 / divisor)


def take_back(buckets: Sequence[FlatBucket], divisor: float) -> None:
    """Before ``reopen`` multiplies by ``divisor`` again: undo :func:`add_back`."""
    _shift(buckets, 1.0 / divisor - 1.0)


def _shift(buckets: Sequence[FlatBucket], alpha: float) -> None:
    if alpha == 0.0:
        return
    for bucket in buckets:
        if bucket.carried is not None and not bucket.window_fresh and bucket.grad_shard is not None:
            bucket.grad_shard.add_(bucket.carried.to(bucket.grad_shard.device), alpha=alpha)
