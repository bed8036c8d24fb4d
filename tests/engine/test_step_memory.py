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

from memory_estimator.engines.shardengine_exact import EngineOptions, _step_buffers, engine_layout, engine_terms
from memory_estimator.terms.precision import precision_policy
from memory_estimator.terms.model_states import plan_spec
from rank_pool import RankPoolRegistry
from step_memory_cases import in_backward_step_working_set, step_working_set
from toy_models import build_model

pytestmark = pytest.mark.prestart(2, 3)

# Many equal blocks in small buckets: one bucket is a small part of the shard.
SPEC = dict(seed=0, vocab=16, dim=24, hidden=[24] * 6, per_rank_batch=2, optimizer="adam",
            bucket_mb=0.004, param_dtype="bf16")
SLACK = 4096  # the step's agreement (a few small tensors) and Adam's per-step scalars
PLANS = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}  # stage 0 steps fp32 masters of whole buckets


def estimated_step_bytes(stage: int, world: int, reduce_dtype=None) -> dict[str, int]:
    with torch.device("meta"):
        module = build_model(SPEC)
    # Stage 2's buckets also end where a unit ends, as the estimator's exact model plans them.
    options = EngineOptions(bucket_mb=SPEC["bucket_mb"], reduce_precision=reduce_dtype)
    layout = engine_layout(module, world, options, cut_at_units=stage == 2)
    return engine_terms(layout, plan_spec(PLANS[stage]), "bf16", "adam", "plain", options).step


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


# Blocks whose buckets' fp32 copies would stand out above SLACK (a block's slice: 4 * 4160 / N B).
FP32_REDUCED = {**SPEC, "dim": 64, "hidden": [64] * 4, "bucket_mb": 0.02, "reduce_dtype": "fp32"}


@pytest.mark.parametrize("world, stage", [(2, 0), (3, 1), (2, 2), (3, 3)])
def test_step_over_fp32_reduced_gradients_copies_none(rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    """bf16 compute reduced in fp32 (FSDP2's MixedPrecisionPolicy(bf16, reduce_dtype=fp32)): the
    reduced gradient already is the master's dtype, so the step reads it in place and allocates
    only Adam's for-loop temporaries over one piece; the estimator counts no fp32 gradient copy."""
    results = rank_pools.get(world).run(step_working_set, {**FP32_REDUCED, "stage": stage})
    with torch.device("meta"):
        module = build_model(FP32_REDUCED)
    options = EngineOptions(bucket_mb=FP32_REDUCED["bucket_mb"], reduce_precision="fp32")
    layout = engine_layout(module, world, options, cut_at_units=stage == 2)
    # The step's own buffers (engine_terms reports the end of backward's where those are larger).
    estimate = _step_buffers(layout, plan_spec(PLANS[stage]), precision_policy("bf16"), "adam", "plain", g=4)
    assert "fp32_master_grads" not in estimate
    largest = max(max(result["largest_piece"]) for result in results)
    assert estimate["optimizer_step_temporaries"] == 2 * 4 * largest  # sqrt and quotient over one piece
    for rank, result in enumerate(results):
        at = result["largest_piece"].index(max(result["largest_piece"]))
        assert 4 * result["shards"][at] > SLACK  # a copy of that bucket's slice would show
        assert result["peak"] <= 2 * 4 * max(result["largest_piece"]) + SLACK, f"rank {rank}"
    assert max(result["peak"] for result in results) >= 2 * 4 * largest


# The step inside backward steps runs of at most STEP_GROUP_BYTES of a bucket's pieces, or of
# its largest piece where that is more. A cap of one fp32 element here: runs as large as a
# bucket's largest piece, each with an fp32 gradient cast for it alone, below a bucket's
# (stage 3: a unit's) shard.
IN_BACKWARD = {**SPEC, "bucket_mb": 0.05, "run_bytes": 4}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_inside_backward_allocates_one_run_at_a_time(rank_pools: RankPoolRegistry, stage: int, world: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from memory_estimator.engines.shardengine_exact import in_backward_step_bytes
    from shardengine.optim import step_groups

    results = rank_pools.get(world).run(in_backward_step_working_set, {**IN_BACKWARD, "stage": stage})
    monkeypatch.setattr(step_groups, "STEP_GROUP_BYTES", IN_BACKWARD["run_bytes"])
    with torch.device("meta"):
        module = build_model(IN_BACKWARD)
    layout = engine_layout(module, world, EngineOptions(bucket_mb=IN_BACKWARD["bucket_mb"]), cut_at_units=stage == 2)
    estimate = sum(in_backward_step_bytes(layout, plan_spec(PLANS[stage]), precision_policy("bf16"), "adam",
                                          "plain", g=2).values())
    assert any(r["largest_piece"] < r["largest_shard"] for r in results), "buckets should hold several pieces"
    for rank, result in enumerate(results):
        # One run's fp32 gradient (at most the largest piece) and Adam's for-loop temporaries
        # (sqrt, quotient, per tensor), where the uncapped step holds one bucket's fp32 gradient.
        assert result["peak"] <= 3 * 4 * result["largest_piece"] + SLACK, f"rank {rank}"
    # The estimator's step term is the largest run's: what the largest rank allocates.
    largest = max(result["peak"] for result in results)
    assert estimate - SLACK <= largest <= estimate + SLACK
