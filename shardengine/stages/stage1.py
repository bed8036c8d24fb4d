"""Stage 1: the delta over stage 0 (stages/base.py) is that each rank steps only its slice.

Gradients are reduce-scattered so every rank gets the reduced sum of the slice it
owns; the optimizer (re-pointed at those slices) steps only them; the updated
parameters are all-gathered after the step.
"""

from __future__ import annotations

import torch

from ..distributed.work import Work
from ..flat.bucket import FlatBucket
from ..distributed.hybrid import GroupBytes
from ..memory import nbytes
from .base import DataParallel


class ShardedOptimizerStates(DataParallel):
    """Stage 1: reduce-scatter gradients; step only the owned slice; all-gather params."""

    stage = 1
    guards_params = True
    steps_whole = False
    grads_replicated = False
    divides_on_landing = False     # the owned slice keeps the reduced sum until the step
    normalizes_each_backward = False

    @property
    def rebuilds_optimizer(self) -> bool:
        return True  # the optimizer steps only the owned slices

    def _launch_reduction(self, bucket: FlatBucket) -> list[Work]:
        self._adopt_missing(bucket)
        owned_grad = bucket.full_grad[bucket.owned]
        # The full gradient is persistent here, so reduce into its own owned slice when the
        # communicator can do that without a buffer (Gloo's all-reduce); else via a slice-sized one.
        in_place = self.comm.reduces_in_place or self._compresses_grads
        shard = owned_grad if in_place else self._temp_shard(bucket)
        work = self._reduce_scatter(bucket, shard)
        return [work.then(lambda: self._store_reduced(bucket, shard))]

    def _temp_shard(self, bucket: FlatBucket) -> torch.Tensor:
        shard = torch.empty(bucket.layout.shard_numel, dtype=bucket.grad_dtype,
                            device=bucket.full_param.device)
        self.live.add(nbytes(shard))
        return shard

    def _reduce_scatter(self, bucket: FlatBucket, shard: torch.Tensor) -> Work:
        if self._compresses_grads:
            return self.compression.reduce_scatter(bucket, shard)
        return self.comm.reduce_scatter(shard, bucket.full_grad, async_op=True)

    def _store_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        # The owned slice of the persistent full gradient keeps the reduced *sum* and the
        # rest is zeroed, so a further micro-step adds local gradients on top and the next
        # reduce-scatter yields the running sum; it is divided by N once, at the step.
        owned_grad = bucket.full_grad[bucket.owned]
        if shard.data_ptr() != owned_grad.data_ptr():
            owned_grad.copy_(shard)
            self.live.sub(nbytes(shard))
        bucket.full_grad[:bucket.owned.start].zero_()
        bucket.full_grad[bucket.owned.stop:].zero_()
        bucket.grad_shard = owned_grad
        self._mark_reduced(bucket)

    def ring_model_bytes(self, micro_steps: int) -> GroupBytes:
        reduced = self._gradient_bytes("reduce_scatter")
        return (self._reductions_per_step(micro_steps) * reduced + self._gather_bytes(self._stepped_buckets())
                + self.control_bytes(micro_steps))

    def _reductions_per_step(self, micro_steps: int) -> int:
        return 1  # no_sync() defers the reduction to the last micro-step

    def _sync_params_after_step(self) -> None:
        works = [self.comm.all_gather(b.full_param, b.param_shard, async_op=True)
                 for b in self._stepped_buckets()]
        for work in works:
            work.wait()
