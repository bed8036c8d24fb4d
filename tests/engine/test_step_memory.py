"""The optimizer step's working set is one bucket's worth, and the estimator says so.

The engine steps torch's optimizers one flat bucket at a time ([Note: a bounded step] in
shardengine/optim/bucketed_step.py): what the step allocates at once is one bucket's fp32
master gradient (mixed precision) plus Adam's for-loop temporaries over one piece of it
(``sqrt`` and the quotient, torch's default on CPU), never an fp32 copy of the whole shard.
The peak is measured at the allocator (shardengine.testing.allocator_tracker) on the second
step, after the first created the optimizer state.
"""

from __future__ import annotations

import pytest
import torch

from memory_estimator.engines.shardengine_exact import EngineOptions, engine_layout, engine_terms
from memory_estimator.terms.model_states import plan_spec
from rank_pool import RankPoolRegistry
from step_memory_cases import step_working_set
from toy_models import build_model

pytestmark = pytest.mark.prestart(2, 3)

# Many equal blocks in small buckets: one bucket is a small part of the shard.
SPEC = dict(seed=0, vocab=16, dim=24, hidden=[24] * 6, per_rank_batch=2, optimizer="adam",
            bucket_mb=0.004, param_dtype="bf16")
SLACK = 4096  # the step's agreement (a few small tensors) and Adam's per-step scalars
PLANS = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}  # stage 0 steps fp32 masters of whole buckets


def estimated_step_bytes(stage: int, world: int) -> dict[str, int]:
    with torch.device("meta"):
        module = build_model(SPEC)
    layout = engine_layout(module, world, EngineOptions(bucket_mb=SPEC["bucket_mb"]))
    return engine_terms(layout, plan_spec(PLANS[stage]), "bf16", "adam", "plain").step


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_allocates_one_bucket_at_a_time(rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    results = rank_pools.get(world).run(step_working_set, {**SPEC, "stage": stage})
    estimate = estimated_step_bytes(stage, world)
    for rank, result in enumerate(results):
        shards = result["shards"]
        assert len(shards) > 2, "the test model should span several buckets"
        per_bucket = max(4 * shard + 2 * 4 * piece for shard, piece in zip(shards, result["largest_piece"]))
        assert result["peak"] <= per_bucket + SLACK, f"rank {rank}"
        # One step over everything holds an fp32 copy of the whole shard at once.
        assert result["peak"] < 4 * sum(shards), f"rank {rank}"
        # The estimator's late working set (the step's, or the last reductions' where they are
        # larger): the largest bucket's master gradient and temporaries, at least.
        if "fp32_master_grads" in estimate:
            assert estimate["fp32_master_grads"] == 4 * max(shards)
        assert 4 * max(shards) <= result["peak"] <= sum(estimate.values()) + SLACK, f"rank {rank}"
