"""Forward-only sharded models: ``se.shard(model, None, stage=s)`` on a frozen model.

* A frozen reference sharded at stage 3 (and 0) gives the unsharded model's logits,
  under ``torch.no_grad()`` and in grad mode, and holds only its shard between forwards.
* A DPO-style loop (policy at stage 3 and a frozen reference at stage 3 in one process,
  a hand-written DPO loss) trains like one process on the global batch.
* A model with trainable parameters is refused, naming them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import forward_only_cases as cases  # noqa: E402
from rank_pool import RankPoolRegistry, run_local  # noqa: E402


@pytest.mark.parametrize("world,stage", [(2, 3), (3, 3), (2, 0)])
def test_a_frozen_reference_gives_the_unsharded_logits(rank_pools: RankPoolRegistry, world: int, stage: int) -> None:
    for result in rank_pools.get(world).run(cases.reference_logits, stage):
        assert result["optimizer"] is None
        assert result["error"] <= 1e-6 and result["graded_error"] <= 1e-6
        assert not result["graded_requires_grad"]
        if stage == 3:
            assert result["held"] <= result["full"] / world + 1024


@pytest.mark.parametrize("world", [2, 3])
def test_dpo_with_policy_and_reference_at_stage_3_trains_like_one_process(rank_pools: RankPoolRegistry,
                                                                          world: int) -> None:
    results = rank_pools.get(world).run(cases.dpo_loop, 3)
    for result in results:
        assert max(result["errors"].values()) <= 1e-5, result["errors"]
        assert result["moved"] > 0 and result["reference_unchanged"]
    mean = [sum(r["losses"][s] for r in results) / world for s in range(cases.STEPS)]
    assert mean == pytest.approx(results[0]["ref_losses"], rel=1e-5)


def test_a_model_with_trainable_parameters_is_refused_without_an_optimizer() -> None:
    message = run_local(cases.refused_trainable)[0]
    assert "shard(model, None)" in message and "model.embed_tokens.weight" in message
    assert "requires_grad_(False)" in message
