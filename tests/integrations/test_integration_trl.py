"""TRL's SFTTrainer through ``shard_trainer_class`` against the same trainer with DDP, 2 Gloo ranks
(workers: trl_cases.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import trl_cases as cases  # noqa: E402

TOL = 2e-4
CALL_S = 600  # Trainer objects are heavy: a first call imports the trainer libraries on each rank


def check(result: dict) -> None:
    assert result["moved"] > 1e-3, "training did not change the parameters: the comparison would be vacuous"
    for stage, found in result["stages"].items():
        assert found["error"] <= TOL, (stage, found["error"])
        # the logged loss and grad_norm of every step (ShardTrainer's training_step and _get_grad_norm)
        assert len(found["losses"]) == len(result["ddp_losses"]) > 0
        for got, want in zip(found["losses"], result["ddp_losses"]):
            assert got == pytest.approx(want, rel=1e-5), (stage, found["losses"], result["ddp_losses"])


def test_sft_on_padded_variable_length_texts_trains_as_with_ddp_at_every_stage(rank_pools, tmp_path) -> None:
    """SFTConfig's defaults (bf16 autocast, loss over the tokens of all ranks), accumulation and clipping."""
    check(rank_pools.get(2).run(cases.sft_equals_ddp, str(tmp_path), [0, 1, 2, 3], gradient_accumulation_steps=2,
                                max_grad_norm=0.5, timeout=CALL_S)[0])


def test_sft_in_fp32_with_per_rank_token_means_trains_as_with_ddp(rank_pools, tmp_path) -> None:
    check(rank_pools.get(2).run(cases.sft_equals_ddp, str(tmp_path), [3], bf16=False,
                                average_tokens_across_devices=False, timeout=CALL_S)[0])


@pytest.mark.parametrize("stage", [3])
def test_dpo_with_a_reference_model_shards_it_and_trains_as_with_ddp(rank_pools, tmp_path, stage) -> None:
    """DPOTrainer(ref_model=...): the policy at stage 3 and the reference sharded forward-only at stage 3
    (each rank holds about half of it) train as TRL's DPOTrainer with DDP and a whole reference per rank."""
    for result in rank_pools.get(2).run(cases.dpo_equals_ddp, str(tmp_path), stage, timeout=CALL_S):
        assert result["moved"] > 1e-3, "training did not change the policy: the comparison would be vacuous"
        assert result["error"] <= TOL, result["error"]
        assert result["losses"] == pytest.approx(result["ddp_losses"], rel=1e-5)
        assert result["reference_unchanged"]
        assert 0 < result["reference_sharded"] <= result["reference_whole"] / 2 * 1.05
