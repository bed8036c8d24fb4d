"""Activation checkpointing and offload applied by the engine (``activation_checkpointing=``,
``activation_offload=``, or ``activations=se.Activations(...)``; docs/activations.md).

Each policy trains exactly as the same run without it (activation_cases.py: the engine's own
run at the same stage and options is the reference; the engine's run without a policy is in
turn checked against one process by the equivalence tests). The cases are diagonal, not a
cross product: every policy meets every stage and N = 2 and 3, and each of bf16, accumulation
under no_sync, reshard_after_forward=False, prefetch, step_in_backward, a frozen base (LoRA's
shape: recomputation re-reads weights that get no gradient) and torch.compile appears at least
once. ``memory_report()`` measures what each run kept: checkpointing keeps less on the device,
offload moves bytes to the host.
"""
from __future__ import annotations

import pytest

import shardengine as se
from activation_cases import (estimated_and_measured, measured_and_unmeasured, misuse, raised_forward_then_another_model,
                              train_with_and_without)
from peft_cases import train_peft_and_compare
from rank_pool import RankPoolRegistry

CASES = [  # (world, stage, policy, other options of the spec)
    (2, 0, {"activation_checkpointing": "full"}, {}),
    (3, 1, {"activation_checkpointing": "selective:mm"}, {"micro_steps": 2}),
    (2, 2, {"activation_offload": True}, {"options": {"param_dtype": "bf16"}}),
    (3, 3, {"activation_checkpointing": "full"}, {"options": {"reshard_after_forward": False}}),
    (2, 3, {"activation_checkpointing": "every-k:2", "activation_offload": True},
     {"options": {"param_dtype": "bf16", "prefetch": 2}}),
    (2, 3, {"activations": se.Activations(checkpoint="selective:mm/2")}, {"lora": True}),
    (3, 2, {"activation_offload": 2}, {"options": {"step_in_backward": True}}),
    (2, 3, {"activation_checkpointing": "full", "activation_offload": True}, {"compile": "aot_eager", "layers": 2}),
    (3, 0, {"activation_checkpointing": "selective", "activation_offload": 0.5}, {"micro_steps": 2}),
]


def _id(case) -> str:
    world, stage, policy, other = case
    text = "-".join(f"{v}" for v in policy.values()).replace(" ", "")
    return f"N{world}-s{stage}-{text}" + "".join(f"-{k}" for k in other)


@pytest.mark.parametrize("world,stage,policy,other", CASES, ids=[_id(c) for c in CASES])
def test_a_policy_trains_exactly_like_the_run_without_it(rank_pools: RankPoolRegistry, world: int, stage: int,
                                                         policy: dict, other: dict) -> None:
    results = rank_pools.get(world).run(train_with_and_without, {"stage": stage, "policy": policy, **other})
    for rank, result in enumerate(results):
        bad = {k: e for k, e in result["errors"].items() if not e <= 1e-6}
        assert not bad, f"rank {rank}: parameters differ from the run without the policy: {bad}"
        plain_losses, losses = result["losses"]
        assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
        plain, policed = result["reports"][0][-1], result["reports"][1][-1]
        assert plain["peak_host_activations"] == 0 and plain["peak_activations"] > 0
        assert plain["activations"] == policed["activations"] == 0  # nothing kept between steps
        spec = policy.get("activations") or se.Activations(policy.get("activation_checkpointing", "none"),
                                                           policy.get("activation_offload", False))
        if spec.checkpoint in ("full", "every-k:2", "selective:mm", "selective:mm/2") or spec.offload:
            assert policed["peak_activations"] < plain["peak_activations"], (plain, policed)
        if spec.offload:
            assert policed["peak_host_activations"] > 0, policed
        else:
            assert policed["peak_host_activations"] == 0


@pytest.mark.parametrize("case,stage,phrase", [
    ("hf_self_checkpointing", 3, "gradient_checkpointing_disable()"),
    ("user_checkpoint_around_a_block", 0, "recomputed twice"),
    ("no_blocks", 3, "found no blocks"),
])
def test_a_model_checkpointed_twice_or_without_blocks_is_a_clear_error(rank_pools: RankPoolRegistry, case: str,
                                                                       stage: int, phrase: str) -> None:
    message = rank_pools.get(2).run(misuse, {"case": case, "stage": stage})[0]
    assert phrase in message, message


def test_bad_policies_are_config_errors() -> None:
    with pytest.raises(se.ConfigError, match="unknown checkpointing 'some'"):
        se.Activations(checkpoint="some")
    with pytest.raises(se.ConfigError, match="activation offload must be"):
        se.Activations(offload=1.5)
    with pytest.raises(se.ConfigError, match="every-k:0"):
        se.config.ShardConfig(stage=3, activation_checkpointing="every-k:0")
    config = se.config.ShardConfig(stage=3, activation_checkpointing="every-k:2", activation_offload=True)
    assert config.activations == se.Activations("every-k:2", True)


def test_the_estimator_prices_each_policy_no_lower_than_the_engine_keeps(rank_pools: RankPoolRegistry) -> None:
    # The estimator's activation term is the traced live peak (saved tensors plus the step's
    # transient buffers); the engine's ledger counts the saved tensors alone. Measured here: the
    # estimate is 0.98x (offload alone: the engine holds the block it prefetches beside the one
    # in backward) to 1.33x (full checkpointing: the recomputation's transients) of the ledger's.
    for row in rank_pools.get(2).run(estimated_and_measured, {"stage": 0})[0]:
        assert 0.95 * row["measured"] <= row["estimated"] <= 1.5 * row["measured"], row
        assert row["measured_host"] <= row["estimated_host"], row
        assert (row["measured_host"] > 0) == row["offload"], row


@pytest.mark.parametrize("world,stage,activations", [
    (2, 3, {"activation_checkpointing": "full", "activation_offload": True}),
    (3, 3, {"activation_checkpointing": "selective:mm"}),
    (2, 1, {"activation_checkpointing": "every-k:2"}),
], ids=["N2-s3-full-offload", "N3-s3-selective:mm", "N2-s1-every-k:2"])
def test_a_hugging_face_llama_with_lora_trains_like_one_process_under_a_policy(
        rank_pools: RankPoolRegistry, world: int, stage: int, activations: dict) -> None:
    # peft's LoRA on a tiny LlamaForCausalLM: the engine recomputes decoder layers whose base
    # weights are frozen (re-gathered at stage 3) and the adapters match one process without any
    pytest.importorskip("peft")
    case = dict(family="llama", stage=stage, activations=activations)
    for result in rank_pools.get(world).run(train_peft_and_compare, case):
        worst = max(result["adapter_errors"].values())
        assert result["all_moved"] and result["frozen_equal"]
        assert worst <= 1e-5, f"adapter rel. error {worst}"


@pytest.mark.parametrize("stage,policy", [(0, {"measure_activations": True}), (3, {"activation_offload": True})],
                         ids=["s0-measured", "s3-offload"])
def test_a_forward_that_raised_leaves_no_scope_behind(rank_pools: RankPoolRegistry, stage: int, policy: dict) -> None:
    # the saved-tensor scopes are popped by always-called forward hooks: a forward that raised
    # must not leave its hooks to take the next forward's tensors (of any model)
    for result in rank_pools.get(2).run(raised_forward_then_another_model, {"stage": stage, "policy": policy}):
        assert result["raised"] and result["other"] > 0 and result["first"] == 0, result


@pytest.mark.parametrize("world,stage", [(2, 0), (3, 3)], ids=["N2-s0", "N3-s3"])
def test_without_a_policy_no_saved_tensor_hook_runs_and_the_report_says_not_measured(
        rank_pools: RankPoolRegistry, world: int, stage: int) -> None:
    # DDP and FSDP2 put no Python call on each saved tensor: without a policy neither does the
    # engine, and memory_report() says the activations were not measured (never "0 bytes");
    # measure_activations=True counts them and changes no number of the training
    for result in rank_pools.get(world).run(measured_and_unmeasured, {"stage": stage}):
        plain, measured = result["unmeasured"], result["measured"]
        assert plain["hooks_seen"] == [False, False] and measured["hooks_seen"] == [True, True]
        assert all(plain["report"][k] is None for k in ("activations", "peak_activations", "host_activations",
                                                         "peak_host_activations")), plain["report"]
        assert "activations not measured (se.Activations(measure=True))" in plain["text"]
        assert measured["report"]["peak_activations"] > 0 and measured["report"]["activations"] == 0
        assert measured["report"]["peak_host_activations"] == 0 and "not measured" not in measured["text"]
        assert max(result["errors"].values()) == 0.0, result["errors"]
        states = lambda report: {k: v for k, v in report.items() if "activations" not in k}  # noqa: E731
        assert states(plain["report"]) == states(measured["report"])


def test_measure_activations_is_a_policy_field_and_a_flat_keyword() -> None:
    assert se.config.ShardConfig(stage=1, measure_activations=True).activations == se.Activations(measure=True)
    assert se.config.ShardConfig(stage=1).measure_activations is False
    assert se.Activations(checkpoint="full").measured and not se.Activations().measured
    with pytest.raises(se.ConfigError, match="measure_activations must be True or False"):
        se.Activations(measure="yes")
