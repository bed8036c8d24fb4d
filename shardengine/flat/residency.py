"""Fractional parameter offload: which stage-3 units stay on the device, decided from the plan.

Pure (no tensors allocated; works on a meta-device module), shared by the engine,
which gives each unit's buckets the storage plan of their tier (stages/unit_tiers.py),
and by the memory estimator, which predicts the same split byte for byte.

[Note: which units stay resident]
``Offload(params=f)`` moves at least the fraction ``f`` of the parameter elements
to the host, ``Offload(device_budget=B)`` at most ``B`` bytes of model states per
rank stay on the device. Both keep a *prefix* of the units in **turn order**
resident: the root unit first, then the blocks from the last to the first.

Why that order: a unit on the host costs one host-to-device copy before each of
its gathers, and a copy is free only when it hides under the compute of the unit
before it (the prefetch issues it then). Stage 3 gathers the root at the very
start of forward and again at the very start of backward (its output gradient
arrives first), and the last blocks right at the forward/backward turn, where the
only compute in between is the head and the loss: their copies have nothing to
hide under. The first blocks are gathered in the middle of the forward's and the
backward's streams of compute (in backward after every later block), so their
copies overlap best. Keeping the largest units instead would cut the number of
copies, but not the exposed ones, and in a transformer the blocks are equal
anyway. A prefix (stop at the first unit that does not fit, never skip to a
smaller one) keeps the offloaded units contiguous at the start of the forward,
so the overlap argument holds for every one of them.

Every rank decides alike: the sizes are this rank's shard elements of each
bucket (``FlatLayout.shard_numel``, equal on every rank, padding included) and the
dtypes of the plan, never per-rank counts or live tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .layout import FlatLayout
from .plan import BucketPlan


@dataclass(frozen=True)
class BucketShare:
    """What one bucket of a unit weighs on each rank (from its plan, equal on every rank)."""

    elements: int               # parameter elements, without padding
    shard: int                  # one rank's padded slice (``FlatLayout.shard_numel``)
    trained: bool
    group: Optional[int]        # its optimizer param group (None: in none)
    dtype: torch.dtype          # its parameters' dtype before any cast


def bucket_shares(buckets: Sequence[BucketPlan], world_size: int) -> tuple[BucketShare, ...]:
    """Each planned bucket's :class:`BucketShare` on ``world_size`` ranks."""
    return tuple(BucketShare(sum(p.numel() for p in bucket.params),
                             FlatLayout.build([tuple(p.shape) for p in bucket.params], world_size).shard_numel,
                             bucket.params[0].requires_grad, bucket.group_index, bucket.params[0].dtype)
                 for bucket in buckets)


@dataclass(frozen=True)
class UnitSize:
    """What one unit weighs for the choice (per rank, equal on every rank)."""

    elements: int      # parameter elements of the unit, trained and frozen (for the fraction)
    device_bytes: int  # model-state bytes it holds on the device when resident (for the budget)


def resident_bytes_per_element(trained: bool, param_bytes: int, grad_bytes: int, master_bytes: int,
                               state_elements: int, optimizer_on_device: bool) -> int:
    """Device bytes per shard element of a resident bucket between steps.

    A frozen bucket keeps its shard in the compute dtype (``param_bytes``). A trained one
    keeps its gradient shard (``grad_bytes``) and, unless ``offload_optimizer`` put them on
    the host, its master (``master_bytes``: 4 for a separate fp32 master, else the parameter
    dtype's, the shard being the master) and ``state_elements`` optimizer-state tensors
    shaped like it, in the master's dtype (Adam: 2). Stage 3 keeps no compute copy beside
    a separate master (flat/bucket.py)."""
    if not trained:
        return param_bytes
    if not optimizer_on_device:
        return grad_bytes
    return grad_bytes + master_bytes * (1 + state_elements)


def unit_size(shares: Sequence[BucketShare], bytes_per_element: Callable[[BucketShare], int]) -> UnitSize:
    """One unit's :class:`UnitSize` from its buckets' shares (``bytes_per_element``: by
    :func:`resident_bytes_per_element`, with the bucket's dtypes and optimizer)."""
    return UnitSize(sum(share.elements for share in shares),
                    sum(share.shard * bytes_per_element(share) for share in shares))


def turn_order(count: int) -> list[int]:
    """Unit indices (the plan's order: blocks, then the root last) nearest the
    forward/backward turn first: the root, then the blocks from the last to the first."""
    return [count - 1] + list(range(count - 2, -1, -1)) if count else []


def offloaded_units(sizes: Sequence[UnitSize], fraction: Optional[float] = None,
                    budget: Optional[int] = None) -> frozenset[int]:
    """Indices of the units whose states go to the host: all but the longest prefix, in
    :func:`turn_order`, that keeps at most ``1 - fraction`` of the elements (or at most
    ``budget`` device bytes) on the device. Exactly one of ``fraction``/``budget``.

    >>> sizes = [UnitSize(10, 100)] * 4 + [UnitSize(4, 40)]  # four blocks and the root
    >>> sorted(offloaded_units(sizes, fraction=0.5))  # root + block 3 keep 14 of 44 (block 2: 24 > 22)
    [0, 1, 2]
    >>> sorted(offloaded_units(sizes, budget=250))  # root + blocks 3, 2 keep 240 bytes
    [0, 1]
    """
    if (fraction is None) == (budget is None):
        raise ValueError("give exactly one of fraction and budget")
    if fraction is not None:
        cost = [size.elements for size in sizes]
        cap = (1.0 - fraction) * sum(cost)
    else:
        cost, cap = [size.device_bytes for size in sizes], budget
    kept, used = set(), 0
    for index in turn_order(len(sizes)):
        if used + cost[index] > cap:
            break
        used += cost[index]
        kept.add(index)
    return frozenset(range(len(sizes))) - kept
