"""Training idioms behave as on the unwrapped model (issue: drop-in fidelity, items 2-6).

Against a single-process reference trained in the same process on the global
batch: a parameter with no gradient in a step is left exactly as torch leaves
it (AdamW with weight decay, step counts per parameter), without any option;
``optimizer.step(closure)``; changing the trainable set after ``shard()``;
what ``p.grad`` holds; the optimizer state in torch's own format.
"""

from __future__ import annotations

import pytest

from engine_cases import base_spec_for, check_equivalence, train_and_compare
from fidelity_cases import (flip_requires_grad, gradients_as_users_read_them,
                            load_foreign_local_state, local_optimizer_state, optimizer_state_forms,
                            train_with_closure)
from rank_pool import RankPoolRegistry

STAGES = [0, 1, 2, 3]
TOL = 2e-4


pytestmark = pytest.mark.prestart(2, 3)  # start-ups overlap (conftest.py)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_parameters_without_gradient_are_untouched_by_default(rank_pools: RankPoolRegistry, stage: int,
                                                              world: int) -> None:
    # An auxiliary head: used by every rank (step 0), by no rank (steps 1, 3: AdamW must
    # neither decay it nor advance its step count), by some ranks only (step 2: the average
    # counts the others as zero), and by all again (step 4).
    some = [0] if world == 2 else [0, 2]
    everyone = list(range(world))
    spec = base_spec_for(stage=stage, extra=True, extra_on=[everyone, [], some, [], everyone], steps=5,
                         optimizer="adamw", bucket_mb=0.0005, micro_steps=2, tied=True)
    check_equivalence(rank_pools.get(world).run(train_and_compare, spec))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_step_with_closure(rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    spec = base_spec_for(stage=stage, steps=3, bucket_mb=0.0005)
    for rank, result in enumerate(rank_pools.get(world).run(train_with_closure, spec)):
        bad = {k: e for k, e in result["errors"].items() if not e <= TOL}
        assert not bad, f"rank {rank}: step(closure) differs from torch: {bad}"
        assert all(loss > 0 for loss in result["losses"])  # step(closure) returns the loss


@pytest.mark.parametrize("stage", STAGES)
def test_freezing_for_some_steps_matches_torch(rank_pools: RankPoolRegistry, stage: int) -> None:
    spec = base_spec_for(stage=stage, bucket_mb=0.0005)
    for rank, errors in enumerate(rank_pools.get(3).run(flip_requires_grad, spec)):
        bad = {k: e for k, e in errors.items() if not e <= TOL}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_gradients_as_users_read_them(rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    spec = base_spec_for(stage=stage, bucket_mb=0.0005)
    for rank, result in enumerate(rank_pools.get(world).run(gradients_as_users_read_them, spec)):
        if stage == 0:  # DDP's contract: p.grad is the average over ranks
            assert result["read_grad"] == "ok" and result["grad_error"] <= TOL
            assert result["torch_clip"] == "ok"
        else:  # sharded: a clear error, never a partial or missing gradient read silently
            for idiom in ("read_grad", "torch_clip", "grad_is_none_check"):
                assert result[idiom].startswith("ShardedAccessError"), (rank, idiom, result[idiom])
                assert "model.clip_grad_norm_" in result[idiom]
        assert result["summoned_grad_error"] <= TOL, rank
        assert abs(result["torch_clip_inside"] - result["ref_norm"]) <= TOL * result["ref_norm"]
        assert abs(result["engine_norm"] - result["ref_norm"]) <= TOL * result["ref_norm"]
        assert result["read_grad_after_step"] == "ok"  # the window is over: p.grad is None again


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_state_in_torch_format(rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    spec = base_spec_for(stage=stage, bucket_mb=0.0005, tied=True)
    results = rank_pools.get(world).run(optimizer_state_forms, spec)
    for rank, result in enumerate(results):
        assert result["same_keys"] and result["groups"], rank
        assert result["state_error"] <= TOL, rank
        assert result["plain_loads_full"] == "ok", result["plain_loads_full"]
        assert result["local_round_trip"] == "ok", result["local_round_trip"]
        assert result["load_plain"] == "ok", result["load_plain"]
        assert result["resumed_error"] <= TOL, rank
    steps = {float(s["step"]) for s in results[0]["full"]["state"].values()}
    assert steps == {2.0}


def test_sharded_optimizer_state_of_another_layout_is_refused(rank_pools: RankPoolRegistry) -> None:
    # optimizer.state_dict() at stages >= 1 is this rank's fragments; another layout refuses it
    # and names the full form, which loads anywhere (test above).
    saved = rank_pools.get(2).run(local_optimizer_state, base_spec_for(stage=1))[0]
    for message in rank_pools.get(3).run(load_foreign_local_state, base_spec_for(stage=3), saved):
        assert message.startswith("ConfigError") and "full_optimizer_state_dict" in message
    # stage 0 steps the user's own optimizer over whole parameters: fragments are refused on every
    # rank alike (torch would accept them on one rank and fail inside its step, or hang the others)
    for message in rank_pools.get(2).run(load_foreign_local_state, base_spec_for(stage=0), saved):
        assert message.startswith("ConfigError") and "stage 1" in message and "full_optimizer_state_dict" in message
