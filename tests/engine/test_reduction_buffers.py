"""Stages 2-3 allocate a bucket's flat gradient at its reduction, in every precision.

bf16 compute reduced in fp32 (FSDP2's ``MixedPrecisionPolicy(bf16, reduce_dtype=fp32)``) and
weighted micro-steps keep each bucket's gradients as autograd made them until the bucket is
complete, then add them into the fp32 buffer in arrival order ([Note: a bucket's buffer at its
reduction] in shardengine/stages/gradients.py). Checked: no buffer exists before its bucket's
last gradient, and the result is bit for bit stage 0's, where every gradient is added into
the persistent fp32 buffer the moment it arrives, a tied weight's two gradients included.
"""

from __future__ import annotations

import pytest
import torch

from engine_cases import base_spec_for
from rank_pool import RankPoolRegistry
from reduction_buffer_cases import train

SPEC = base_spec_for(hidden=[6, 5, 4], tied=True, buffer=False, optimizer="adamw", steps=2, bucket_mb=0.0005,
                     options={"param_dtype": "bf16", "reduce_dtype": "fp32"})


@pytest.mark.parametrize("world", [2, 3])
def test_fp32_reduction_of_bf16_gradients_allocates_at_the_reduction_and_sums_as_stage_0(
        rank_pools: RankPoolRegistry, world: int) -> None:
    pool = rank_pools.get(world)
    reference = pool.run(train, {**SPEC, "stage": 0})[0]["state"]
    for stage in (2, 3):
        for rank, result in enumerate(pool.run(train, {**SPEC, "stage": stage})):
            assert result["buffers"] > 2 * SPEC["steps"], "the model should span several buckets"
            assert result["early"] == 0, f"stage {stage} rank {rank}: a flat gradient before its last gradient"
            for name, tensor in reference.items():
                if world == 2:  # two addends: every reduction sums them in the same order
                    assert torch.equal(result["state"][name], tensor), f"stage {stage} rank {rank}: {name}"
                else:
                    torch.testing.assert_close(result["state"][name], tensor, rtol=1e-5, atol=1e-6,
                                               msg=f"stage {stage} rank {rank}: {name}")
