"""TRL's GRPOTrainer through ``shard_trainer_class`` trains as TRL's GRPOTrainer with DDP at stages 0-3,
N = 2, with (``beta > 0``: a reference sharded forward-only at stage 3) and without a reference model
(workers: grpo_cases.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import grpo_cases as cases  # noqa: E402

TOL = 2e-4
CALL_S = 900


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_grpo_trains_as_with_ddp_at_every_stage(rank_pools, tmp_path, beta) -> None:
    result = rank_pools.get(2).run(cases.grpo_equals_ddp, str(tmp_path), [0, 1, 2, 3], beta, timeout=CALL_S)[0]
    assert result["moved"] > 1e-3, "training did not change the policy: the comparison would be vacuous"
    assert len(result["ddp_rewards"]) == 3, result  # one logged mean reward per step: the comparison below is real
    for stage, found in result["stages"].items():
        assert found["error"] <= TOL, (stage, found["error"])
        assert found["rewards"] == result["ddp_rewards"], (stage, "the same completions were sampled")
        assert found["losses"] == pytest.approx(result["ddp_losses"], rel=1e-5, abs=1e-7), stage
        if beta:
            assert 0 < found["reference_sharded"] <= found["reference_whole"] / 2 * 1.05, stage
