"""The trainable set changes after ``shard()`` and training stays exact.

Unfreezing a block frozen at wrap (with its param group given at wrap, or added
later with ``add_param_group``), freezing a block, and ``add_param_group`` over
parameters that trained in no group: each made between steps, identically to an
unwrapped reference on the global batch. Parameters and the optimizer state in
torch's format must match after further steps, at every stage, N = 2 and 3
(workers in trainable_set_cases.py).
"""

from __future__ import annotations

import pytest

from engine_cases import base_spec_for, check_equivalence
from rank_pool import RankPoolRegistry
from trainable_set_cases import add_param_group_on_rank0_only, change_inside_window, train_changing_trainable_set, unfreeze_after_forward

STAGES = [0, 1, 2, 3]
SCENARIOS = ["unfreeze", "unfreeze_new_group", "freeze", "add_group"]


def _spec(stage: int, scenario: str, **overrides) -> dict:
    # Small buckets (~131 floats): several per group, so re-planning meets bucket boundaries.
    return base_spec_for(stage=stage, scenario=scenario, steps=4, change_at=2, hidden=[5, 3, 4],
                         bucket_mb=0.0005, **overrides)


def _check(results: list[dict], tol: float, state_tol: float, replans: int) -> None:
    check_equivalence(results, tol=tol)
    for rank, result in enumerate(results):
        bad = {k: e for k, e in result["state_errors"].items() if not (isinstance(e, float) and e <= state_tol)}
        assert not bad, f"rank {rank}: optimizer state differs from torch's: {bad}"
        assert all(result["groups"]), f"rank {rank}: param group hyperparameters differ from torch's"
        assert len(result["replans"]) == replans, result["replans"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_changing_the_trainable_set_matches_torch(rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    pool = rank_pools.get(world)
    for scenario in SCENARIOS:
        # Freezing needs no re-plan; add_param_group at stage 0 goes to the user's own optimizer.
        replans = 0 if scenario == "freeze" or (scenario == "add_group" and stage == 0) else 1
        _check(pool.run(train_changing_trainable_set, _spec(stage, scenario)), 2e-6, 2e-5, replans)


@pytest.mark.parametrize("stage", [1, 3])
def test_changing_the_trainable_set_under_bf16(rank_pools: RankPoolRegistry, stage: int) -> None:
    # bf16 compute against the fp32 reference: within the dtype's tolerance
    # (test_engine_precision.py's bound); every rank must still agree exactly.
    for scenario in ["unfreeze", "unfreeze_new_group", "add_group"]:
        spec = _spec(stage, scenario, buffer=False, options={"param_dtype": "bf16"})
        _check(rank_pools.get(2).run(train_changing_trainable_set, spec), 3e-2, 1e-1, 1)


@pytest.mark.parametrize("stage", STAGES)
def test_unfreezing_between_micro_steps_is_refused(rank_pools: RankPoolRegistry, stage: int) -> None:
    for result in rank_pools.get(2).run(change_inside_window, base_spec_for(stage=stage)):
        assert result.startswith("ConfigError") and "between optimizer steps" in result, result


@pytest.mark.parametrize("stage", [0, 3])
def test_unfreezing_after_the_forward_trains_from_the_next_step(rank_pools: RankPoolRegistry, stage: int) -> None:
    check_equivalence(rank_pools.get(2).run(unfreeze_after_forward, base_spec_for(stage=stage)), tol=2e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_ranks_changing_the_set_differently_fail_at_the_step(rank_pools: RankPoolRegistry, stage: int) -> None:
    # add_param_group over parameters already bucketed changes no collective, only the plan.
    for result in rank_pools.get(2).run(add_param_group_on_rank0_only, base_spec_for(stage=stage)):
        assert result.startswith("CollectiveError") and "trainable set" in result, result
