"""ShardStrategy's ``Strategy`` methods answer as Lightning's contract says, after ``trainer.fit``, at
every stage, on 2 Gloo ranks (workers: lightning_api_cases.py). Training equivalence, resuming and
refused combinations are in test_integration_lightning.py."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import lightning_api_cases as cases  # noqa: E402

CALL_S = 600
STAGES = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def answers(rank_pools, tmp_path_factory) -> dict[int, list[dict]]:
    """Every stage's answers, one fit per stage (each test below reads its method's)."""
    return {stage: rank_pools.get(2).run(cases.strategy_answers, stage,
                                         str(tmp_path_factory.mktemp(f"stage{stage}")), timeout=CALL_S)
            for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_lightning_module_state_dict_is_the_full_weights_on_rank_0(answers, stage: int) -> None:
    first, second = answers[stage]
    assert first["final_is_directory"]
    assert first["weights_equal_checkpoint"] and first["weights_shapes_equal_module"]
    assert first["moved"] > 1e-3, "training did not change the weights: the comparison would be vacuous"
    assert second["weights_keys"] == []   # rank 0 only, as FSDPStrategy(state_dict_type="full")


@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_state_is_torchs_format_on_rank_0(answers, stage: int) -> None:
    first, second = answers[stage]
    assert first["optimizer_state_keys"] == ["param_groups", "state"]
    assert first["optimizer_equal_checkpoint"]
    assert first["plain_optimizer_steps"] and set(first["plain_optimizer_steps"]) == {2}
    assert second["optimizer_state_keys"] == []


def test_checkpoint_callbacks_see_the_full_weights_and_optimizer_state(answers) -> None:
    for stage in STAGES:
        first, second = answers[stage]
        assert first["seen_weights"] == {k: tuple(v) for k, v in first["seen_weights"].items()}
        assert sorted(first["seen_weights"]) == first["weights_keys"], stage
        assert first["seen_optimizer_keys"] == [["param_groups", "state"]], stage
        assert second["seen_weights"] == {} and second["seen_optimizer_keys"] == [[]], stage


def test_remove_checkpoint_removes_a_sharded_directory(answers) -> None:
    """ModelCheckpoint(save_top_k=1) removes the worse checkpoint: a directory, removed whole."""
    for stage in STAGES:
        assert len(answers[stage][0]["checkpoint_files"]) == 1, answers[stage][0]["checkpoint_files"]


def test_reduce_broadcast_all_gather_and_test_step(answers) -> None:
    for stage in STAGES:
        first, second = answers[stage]
        assert first["reduce_sum"] == second["reduce_sum"] == 3.0
        assert first["broadcast"] == second["broadcast"] == "from rank 0"
        assert first["all_gather"] == second["all_gather"] == [0, 1]
        assert first["test_loss"] == second["test_loss"] and first["test_loss"] > 0   # test_step, synced
