"""An LR scheduler built before ``shard()`` reaches the optimizer that steps, at every stage.

Why it is tested: at stages 1-3 ``shard()`` once returned a new optimizer, so a
scheduler (or a logger) holding the user's object silently kept a constant
learning rate. Workers: ``scheduler_cases.py``.
"""

from __future__ import annotations

import pytest

from engine_cases import base_spec_for, check_equivalence
from rank_pool import RankPoolRegistry
from scheduler_cases import scheduler_before_shard, scheduler_resumed_from_checkpoint

STAGES = [0, 1, 2, 3]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("scheduler", ["lambda", "hf_linear_warmup"])
def test_scheduler_built_before_shard_sets_the_learning_rate(rank_pools: RankPoolRegistry, stage: int,
                                                             scheduler: str) -> None:
    spec = base_spec_for(stage=stage, optimizer="adamw", scheduler=scheduler, steps=4)
    results = rank_pools.get(2).run(scheduler_before_shard, spec)
    check_equivalence(results, tol=1e-5)
    for rank, result in enumerate(results):
        assert result["same_object"], f"rank {rank}: shard() did not return the user's optimizer"
        assert result["lrs"] == result["ref_lrs"], f"rank {rank}: stepped with {result['lrs']}"
        assert result["logged"] == result["ref_logged"]
        assert result["scheduler_lr"] == result["ref_scheduler_lr"]
        assert not result["order_warnings"], result["order_warnings"]
    assert results[0]["lrs"][0] != results[0]["lrs"][-1], "the schedule should move the learning rate"


@pytest.mark.parametrize("stage", [0, 3])
def test_scheduler_under_mixed_precision(rank_pools: RankPoolRegistry, stage: int) -> None:
    """With fp32 masters (param_dtype) stage 0 re-points the optimizer too."""
    spec = base_spec_for(stage=stage, optimizer="adamw", scheduler="lambda", steps=3, buffer=False,
                         options={"param_dtype": "bf16"})
    for result in rank_pools.get(2).run(scheduler_before_shard, spec):
        assert result["same_object"]
        assert result["lrs"] == result["ref_lrs"]


@pytest.mark.parametrize("stage", STAGES)
def test_scheduler_and_optimizer_resume_together(rank_pools: RankPoolRegistry, stage: int, tmp_path) -> None:
    spec = base_spec_for(stage=stage, optimizer="adamw", scheduler="lambda")
    for result in rank_pools.get(2).run(scheduler_resumed_from_checkpoint, spec, str(tmp_path)):
        assert result["equal"], "the resumed run differs from the uninterrupted one"
        assert result["lr"] == result["lr2"]
