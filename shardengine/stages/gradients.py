"""How a bucket's gradient is stored and reduced: one class per way, chosen by the stage.

==========================  =====  ======================================================
``KeptAllReduce``           0      persistent full gradient, all-reduced and averaged in place
``KeptReduceScatter``       1      persistent full gradient; its owned slice keeps the reduced sum
``TransientReduceScatter``  2, 3   full gradient only while the bucket is reduced; each rank
                                   keeps its averaged slice (``grad_shard``)
==========================  =====  ======================================================

Each class answers the same questions (``adopts``, ``prepare``, ``give_buffers``, ``store``,
``launch``, ``release``, ``held_bytes`` ...); none inherits another, so each answer is
written once. Each is built by ``wire(GradientSources(...))`` from the few objects it uses
(the communicator, the buckets, the compression, the live-bytes counter, options as data),
and ``connect``ed to the step inside backward, which is made after it. A storage tier
for gradients (offloaded after their reduction, see flat/storage.py) plugs in where a
path keeps the reduced slice (``_keep``).

[Note: gradients live from backward to zero_grad]
``zero_grad(set_to_none=True)`` (torch's default, on the optimizer or the model)
frees every gradient byte the engine holds, flat buffers included (``release``):
what torch does by dropping ``param.grad``, and what keeps the gradients out of
the next forward's activation peak. The next backward allocates again: the
persistent paths when the first gradient of a bucket is stored (or, for a bucket
no gradient reached, when it is reduced: the ranks reduce zeros together), the
transient path as always. ``set_to_none=False`` keeps the storage, zeroed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from ..distributed.compression.collectives import CompressedCollectives
from ..distributed.hybrid import HybridCommunicator
from ..distributed.work import Work
from ..flat import guard
from ..flat.bucket import Buckets, FlatBucket
from ..memory import LiveBytes, nbytes

Compression = Callable[[], Optional[CompressedCollectives]]  # None: exact collectives


@dataclass(frozen=True)
class GradientSources:
    """What any gradient path may use; each class's ``wire`` takes the few it needs.

    ``buckets`` and ``compression`` are read at each call: the plan grows when the
    trainable set changes (replan.py) and compression is made after the gradient path.
    The step inside backward, made after it, is given by ``connect``."""

    comm: HybridCommunicator
    buckets: Buckets                        # every bucket of the plan
    compression: Compression
    live: LiveBytes                         # transient buffers, counted in ``memory_report``
    step_in_backward: bool                  # ``step_in_backward=True``: no slice kept from wrap
    max_inflight_buckets: Optional[int]     # the bound on reductions in flight (stages 2-3)


class Landing(Protocol):
    """What a gradient path tells the step inside backward (in_backward.py)."""

    def landed(self, bucket: FlatBucket) -> None: ...


def _grad_collectives(compression: Compression) -> Optional[CompressedCollectives]:
    """The compressed collectives when gradients are compressed; else None (exact ones)."""
    collectives = compression()
    return collectives if collectives is not None and collectives.grads is not None else None


def _slice_buffer(live: LiveBytes, bucket: FlatBucket) -> torch.Tensor:
    """A transient buffer for this rank's reduced slice (counted in ``memory_report``)."""
    shard = torch.empty(bucket.layout.shard_numel, dtype=bucket.grad_dtype, device=bucket.full_param.device)
    live.add(nbytes(shard))
    return shard


def _reduce_scatter(comm: HybridCommunicator, compression: Compression, bucket: FlatBucket,
                    shard: torch.Tensor) -> Work:
    collectives = _grad_collectives(compression)
    if collectives is not None:
        return collectives.reduce_scatter(bucket, shard)
    return comm.reduce_scatter(shard, bucket.full_grad, async_op=True)


def _adopt_missing(bucket: FlatBucket) -> None:
    """Before an adopted bucket's reduction: absent gradients count as zero, and the
    micro-steps' weights are multiplied in (see flat/bucket.py)."""
    with guard.engine_access():
        bucket.undo_zero_weight()
        for index in range(len(bucket.params)):
            bucket.adopt_grad(index)
        bucket.apply_local_factor()


class _KeptFullGradient:
    """What the two persistent-gradient paths share: autograd adds into the bucket."""

    def __init__(self, comm: HybridCommunicator, buckets: Buckets, compression: Compression, live: LiveBytes):
        self.comm, self.buckets, self.compression, self.live = comm, buckets, compression, live
        self.in_backward: Optional[Landing] = None  # connect()

    @classmethod
    def wire(cls, sources: GradientSources) -> "_KeptFullGradient":
        return cls(sources.comm, sources.buckets, sources.compression, sources.live)

    def connect(self, in_backward: Landing) -> None:
        """The step inside backward, made after this path: told of each reduced slice."""
        self.in_backward = in_backward

    def prepare(self) -> None:
        """At wrap: every bucket's full gradient, persistent (``param.grad`` may view it)."""
        for bucket in self.buckets():
            bucket.alloc_full_grad()

    def adopts(self, bucket: FlatBucket) -> bool:
        """``param.grad`` can be a view into the bucket (same dtype, persistent buffer)."""
        return bucket.grad_dtype == bucket.dtype

    def give_buffers(self, bucket: FlatBucket) -> None:
        bucket.alloc_full_grad()  # persistent; param.grad may be views into it

    def store(self, bucket: FlatBucket, index: int, factor: float) -> None:
        bucket.alloc_full_grad()  # zeros again after zero_grad(set_to_none=True) freed it
        if self.adopts(bucket):
            bucket.adopt_grad(index)  # its weight factor is applied before the reduction
        else:
            bucket.absorb_grad(index, factor)

    def release(self, bucket: FlatBucket) -> None:
        """``zero_grad(set_to_none=True)``: the persistent gradient and its reduced part go."""
        bucket.free_full_grad()
        bucket.grad_shard = None

    def max_inflight(self) -> Optional[int]:
        return None  # the full gradients are kept anyway: no buffer to bound

    def reductions_per_step(self, micro_steps: int) -> int:
        return 1  # no_sync() defers the reduction to the last micro-step

    def held_bytes(self) -> int:
        return sum(nbytes(b.full_grad) for b in self.buckets())


class KeptAllReduce(_KeptFullGradient):
    """Stage 0: the whole bucket is all-reduced and averaged in place."""

    collective = "all_reduce"

    def launch(self, bucket: FlatBucket) -> list[Work]:
        bucket.alloc_full_grad()  # no gradient reached it since zero_grad freed it: reduce zeros
        if self.adopts(bucket):
            _adopt_missing(bucket)
        grad, collectives = bucket.full_grad, _grad_collectives(self.compression)
        work = collectives.all_reduce(bucket) if collectives is not None else \
            self.comm.all_reduce(grad, async_op=True)
        world = self.comm.world_size
        return [work.then(lambda: self._keep(bucket, grad.div_(world)))]

    def _keep(self, bucket: FlatBucket, reduced: torch.Tensor) -> None:
        # In place: the next micro-step's local gradients add onto the average, and the
        # next all-reduce then yields the sum of averages (reduction is linear).
        bucket.grad_shard = reduced
        bucket.window_fresh = False


class KeptReduceScatter(_KeptFullGradient):
    """Stage 1: reduce-scatter; the owned slice of the persistent gradient keeps the sum."""

    collective = "reduce_scatter"

    def launch(self, bucket: FlatBucket) -> list[Work]:
        bucket.alloc_full_grad()  # no gradient reached it since zero_grad freed it: reduce zeros
        if self.adopts(bucket):
            _adopt_missing(bucket)
        owned_grad = bucket.full_grad[bucket.owned]
        # The full gradient is persistent here, so reduce into its own owned slice when the
        # communicator can do that without a buffer (Gloo's all-reduce); else via a slice-sized one.
        in_place = self.comm.reduces_in_place or _grad_collectives(self.compression) is not None
        shard = owned_grad if in_place else _slice_buffer(self.live, bucket)
        work = _reduce_scatter(self.comm, self.compression, bucket, shard)
        return [work.then(lambda: self._keep(bucket, shard))]

    def _keep(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        # The owned slice keeps the reduced *sum* and the rest is zeroed, so a further
        # micro-step adds local gradients on top and the next reduce-scatter yields the
        # running sum; it is divided by N once, at the step.
        owned_grad = bucket.full_grad[bucket.owned]
        if shard.data_ptr() != owned_grad.data_ptr():
            owned_grad.copy_(shard)
            self.live.sub(nbytes(shard))
        bucket.full_grad[:bucket.owned.start].zero_()
        bucket.full_grad[bucket.owned.stop:].zero_()
        bucket.grad_shard = owned_grad
        bucket.window_fresh = False
        self.in_backward.landed(bucket)


class TransientReduceScatter:
    """Stages 2-3: a bucket's full gradient lives only while its reduce-scatter is in flight.

    [Note: a bucket's buffer at its reduction]
    The flat full gradient is allocated whole, so allocating it at a bucket's first
    gradient held the bytes of every gradient still to come from the start of the
    unit's backward, where the activations peak. Instead each ``param.grad`` stays as
    autograd made it until the bucket is complete, and is copied in (and dropped) at
    the launch, as FSDP2 copies a unit's gradients into its reduce-scatter input: until
    then only the gradients computed so far exist. The values are the same. A gradient
    already in ``grad_dtype`` with batch weight 1 waits in ``param.grad``: a parameter
    reached twice is summed there by autograd in ``grad_dtype``, as the copy would add
    it. Any other (bf16 compute reduced in fp32, a weighted micro-step) waits taken
    out of ``param.grad`` (``stashed``), so that a second arrival is a tensor of its
    own and is added in ``grad_dtype`` at the launch, in arrival order, as absorbing
    it at once did. Absorbing at once allocated the fp32 buffer (twice a bf16 unit's
    gradient) at the unit's first gradient, beside the previous unit's reduction still
    in flight: both full buffers through the unit's backward, where FSDP2 holds the
    one in flight and the bf16 gradients computed so far.
    """

    collective = "reduce_scatter"

    def __init__(self, comm: HybridCommunicator, buckets: Buckets, compression: Compression, live: LiveBytes,
                 step_in_backward: bool, max_inflight_buckets: Optional[int]):
        self.comm, self.buckets, self.compression, self.live = comm, buckets, compression, live
        self.step_in_backward, self.max_inflight_buckets = step_in_backward, max_inflight_buckets
        self.in_backward: Optional[Landing] = None  # connect()
        self.deferred: dict[FlatBucket, set[int]] = {}
        self.stashed: dict[FlatBucket, list[tuple[int, torch.Tensor, float]]] = {}

    @classmethod
    def wire(cls, sources: GradientSources) -> "TransientReduceScatter":
        return cls(sources.comm, sources.buckets, sources.compression, sources.live,
                   sources.step_in_backward, sources.max_inflight_buckets)

    def connect(self, in_backward: Landing) -> None:
        """The step inside backward, made after this path: told of each reduced slice."""
        self.in_backward = in_backward

    def adopts(self, bucket: FlatBucket) -> bool:
        return False  # the full gradient is transient: param.grad cannot view it

    def prepare(self) -> None:
        """At wrap: each trainable bucket's reduced slice, zero (with the step inside backward,
        none: each slice exists only from its landing to its step)."""
        if self.step_in_backward:
            return
        for bucket in self.buckets():
            if bucket.requires_grad:
                self.give_buffers(bucket)

    def give_buffers(self, bucket: FlatBucket) -> None:
        if bucket.grad_shard is None:
            bucket.grad_shard = torch.zeros(bucket.layout.shard_numel, dtype=bucket.grad_dtype,
                                            device=bucket.grad_device)

    def store(self, bucket: FlatBucket, index: int, factor: float) -> None:
        # [Note: a bucket's buffer at its reduction]
        param = bucket.params[index]
        if factor == 1.0 and param.grad.dtype == bucket.grad_dtype:
            self.deferred.setdefault(bucket, set()).add(index)
            return
        grad, param.grad = param.grad, None
        self.stashed.setdefault(bucket, []).append((index, grad, factor))
        self.live.add(nbytes(grad))

    def _absorb_stashed(self, bucket: FlatBucket) -> None:
        stash = self.stashed.pop(bucket, [])
        stash.reverse()
        while stash:  # popped one by one: each gradient is freed as soon as it is copied in
            index, grad, factor = stash.pop()
            bucket.absorb_tensor(index, grad, factor)
            self.live.sub(nbytes(grad))
            del grad

    def max_inflight(self) -> Optional[int]:
        return self.max_inflight_buckets

    def release(self, bucket: FlatBucket) -> None:
        """``zero_grad(set_to_none=True)``: the reduced slice goes (the full gradient is gone
        already, after each reduction); the next reduction adopts its result afresh."""
        bucket.grad_shard = None
        self.deferred.pop(bucket, None)  # only left by a backward that never completed
        for _, grad, _ in self.stashed.pop(bucket, ()):
            self.live.sub(nbytes(grad))

    def reductions_per_step(self, micro_steps: int) -> int:
        return micro_steps  # reduce-scattered every micro-step (StageSpec.reduces_every_micro_step)

    def held_bytes(self) -> int:
        return sum(nbytes(b.grad_shard) for b in self.buckets())

    def launch(self, bucket: FlatBucket) -> list[Work]:
        # [Note: a bucket's buffer at its reduction]: allocated now, whole, and filled with the
        # gradients that waited; slots none reached are zeroed (a bucket no gradient reached is
        # all zeros: the ranks reduce it together).
        self.live.add(nbytes(bucket.alloc_unwritten_grad()))
        for index in sorted(self.deferred.pop(bucket, ())):
            bucket.absorb_grad(index, 1.0)
        self._absorb_stashed(bucket)
        bucket.zero_unwritten()
        shard = _slice_buffer(self.live, bucket)
        work = _reduce_scatter(self.comm, self.compression, bucket, shard)
        return [work.then(lambda: self._keep(bucket, shard))]

    def _keep(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        bucket.accumulate_grad_shard(shard.div_(self.comm.world_size))
        self.live.sub(nbytes(shard) + nbytes(bucket.full_grad))
        # Freed here, on this thread, now: the backend's handle of the finished collective
        # holds the buffer too, and may drop it last, on its own thread, later.
        bucket.full_grad.untyped_storage().resize_(0)
        bucket.free_full_grad()
        bucket.window_fresh = False
        self.in_backward.landed(bucket)
