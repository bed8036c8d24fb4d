"""Stage 2: the delta over stage 1 (stages/stage1.py) is that full gradients are transient.

A bucket's full gradient exists only while its micro-step's gradients arrive and
its reduce-scatter is in flight; each rank then keeps only its reduced slice.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..distributed.work import Work
from ..flat.bucket import FlatBucket
from ..memory import nbytes
from .stage1 import ShardedOptimizerStates


class ShardedGradients(ShardedOptimizerStates):
    """Stage 2: full gradients live only while their bucket is being reduced."""

    stage = 2
    keeps_full_grads = False
    divides_on_landing = True      # _store_reduced averages each reduce-scatter as it lands

    def _max_inflight(self) -> Optional[int]:
        return self.config.max_inflight_buckets

    def _prepare_grads(self) -> None:
        for bucket in self.buckets:
            if bucket.requires_grad:
                bucket.grad_shard = torch.zeros(bucket.layout.shard_numel, dtype=bucket.grad_dtype,
                                                device=bucket.full_param.device)

    def _launch_enabled(self) -> bool:
        # Skipping the reduction under no_sync() would mean holding a full unsharded
        # gradient across micro-steps: exactly the memory this stage exists to save.
        return True

    def _store_grad(self, bucket: FlatBucket, index: int) -> None:
        had_buffer = bucket.full_grad is not None
        bucket.absorb_grad(index, self._factor)
        if not had_buffer and bucket.full_grad is not None:
            self.live.add(nbytes(bucket.full_grad))

    def _launch_reduction(self, bucket: FlatBucket) -> list[Work]:
        if bucket.full_grad is None:  # no gradient arrived: reduce zeros, ranks must agree
            self.live.add(nbytes(bucket.alloc_full_grad()))
        bucket.zero_unwritten()
        shard = self._temp_shard(bucket)
        work = self._reduce_scatter(bucket, shard)
        return [work.then(lambda: self._store_reduced(bucket, shard))]

    def _store_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        bucket.accumulate_grad_shard(shard.div_(self.world))
        self.live.sub(nbytes(shard) + nbytes(bucket.full_grad))
        bucket.free_full_grad()
        self._mark_reduced(bucket)

    def _reductions_per_step(self, micro_steps: int) -> int:
        return micro_steps  # reduce-scattered every micro-step (see _launch_enabled)

    def _grad_bytes(self) -> int:
        return sum(nbytes(b.grad_shard) for b in self.buckets)
