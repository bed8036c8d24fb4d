"""Fine-tuning: frozen parameters anywhere, adapters (LoRA-style and PEFT), at every stage.

Every training case is checked against one process on the global batch (see
``finetune_cases`` / ``peft_cases``), at N = 2 and 3, stages 0-3, in the rank
pool: frozen bases with trainable low-rank adapters with and without
activation checkpointing (reentrant and not), frozen parameters in every
position (a whole unit, half a unit, a tied frozen embedding in the root next
to trainable parameters), PEFT LoRA on Llama and GPT-2 with
``gradient_checkpointing_enable()``, saving the adapter with peft and loading
it back, and the memory a frozen parameter costs (none beyond itself).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine_cases import check_equivalence
from finetune_cases import (LoraNet, memory_of_frozen_base, train_lora_cases, units_held_through_a_lora_step,
                            units_live_during_backward)
from peft_cases import save_and_reload_adapter, train_peft_and_compare, wrapped_save_pretrained
from rank_pool import RankPoolRegistry

STAGES = [0, 1, 2, 3]
CHECKPOINTING = [None, "non_reentrant", "reentrant"]
# (blocks, tied): LoRA blocks (half of each unit frozen); a whole frozen unit between a LoRA
# block and a fully trainable one, with the frozen embedding tied to the head whose bias and
# norm train (the root unit mixes frozen and trainable parameters).
LAYOUTS = [(("lora", "lora"), False), (("lora", "all", "none"), True)]


pytestmark = pytest.mark.prestart(2, 3)  # start-ups overlap (conftest.py)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_lora_style_frozen_bases_train_like_one_process(rank_pools: RankPoolRegistry, world: int,
                                                        stage: int) -> None:
    specs = [dict(stage=stage, blocks=blocks, tied=tied, ckpt=ckpt, steps=2)
             for blocks, tied in LAYOUTS for ckpt in CHECKPOINTING]
    per_rank = rank_pools.get(world).run(train_lora_cases, specs)
    for index, spec in enumerate(specs):
        results = [dict(ranks[index], state={}) for ranks in per_rank]
        try:
            check_equivalence(results, tol=1e-5)
        except AssertionError as error:
            raise AssertionError(f"{spec}: {error}") from None


@pytest.mark.parametrize("ckpt", CHECKPOINTING)
def test_stage3_frees_each_unit_when_its_backward_is_over(rank_pools: RankPoolRegistry, ckpt) -> None:
    """prefetch=0: when a block's input gradient is complete, only the block before it (the
    next in backward) is gathered; frozen units are not held to the end of backward."""
    results = rank_pools.get(2).run(units_live_during_backward,
                                    dict(blocks=["lora", "all", "lora", "all"], ckpt=ckpt))
    for result in results:
        assert result["live_at_block_inputs"], "the probe saw no block backward"
        assert max(result["live_at_block_inputs"]) <= 1, result
        assert result["live_after"] == 0


@pytest.mark.parametrize("world", [2, 3])
def test_a_lora_step_holds_the_unit_computed_and_the_one_prefetched(rank_pools: RankPoolRegistry, world: int) -> None:
    """Stage 3, prefetch 1, four LoRA blocks: no gathered block outlives the forward (autograd's
    saved weights share the storage the engine frees and re-gathers into), and the backward holds
    the block computed and the one prefetched, and at most two blocks' gradients: never a third
    block (a finished block is released before the next one prefetches; see [Note: a unit's
    pre-backward comes last] in stages/unit_backward.py), and not the frozen root either once its
    head's backward is over ([Note: the root unit holds the other units] in stages/unit_scheduler.py)."""
    for result in rank_pools.get(world).run(units_held_through_a_lora_step, 4):
        assert result["after_forward"] < result["block"], result  # the activations only
        two_blocks = 2 * result["block"]
        assert two_blocks <= result["backward_gathered_peak"] <= two_blocks + 2 * result["block_grads"], result


@pytest.mark.parametrize("param_dtype", [None, "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_frozen_parameters_cost_no_gradient_or_optimizer_state(rank_pools: RankPoolRegistry, stage: int,
                                                               param_dtype) -> None:
    """grads and optimizer_states are the trainable elements' bytes (plus padding), from the plan:
    AdamW keeps 2 fp32 states per owned element, plus the fp32 master of the slice under param_dtype."""
    results = rank_pools.get(3).run(memory_of_frozen_base, dict(stage=stage, param_dtype=param_dtype))
    for result in results:
        report, grad_bytes = result["report"], 2 if param_dtype else 4
        assert result["frozen"] > 10 * result["trainable"]  # mostly frozen: the test means something
        held = result["padded"] if stage <= 1 else result["shard"]
        assert report["grads"] == grad_bytes * held
        owned = result["trainable"] if stage == 0 else result["owned"]
        masters = 0 if not param_dtype else 4 * (result["padded"] if stage == 0 else result["shard"])
        assert report["optimizer_states"] == 8 * owned + masters
        assert report["comm_buffers"] == 0
    predicted = estimated_model_states(stage, param_dtype, world=3)
    for key, value in predicted.items():  # the estimator's figure is the largest rank's
        assert value == max(result["report"][key] for result in results), key


def estimated_model_states(stage: int, param_dtype, world: int) -> dict:
    from memory_estimator import estimate

    torch.manual_seed(0)
    net = LoraNet(blocks=("lora", "all", "lora"), tied=True)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    plan = estimate(module=net, world_size=world, precision=param_dtype or "fp32", optimizer=optimizer,
                    device_memory_bytes=10**15).plan(["ddp", "zero1", "zero2", "zero3"][stage])
    return {"params": plan.params, "grads": plan.grads, "optimizer_states": plan.optimizer_states}


PEFT_CASES = [
    dict(family="llama"),
    dict(family="llama", checkpointing="non_reentrant"),
    dict(family="llama", checkpointing="reentrant"),
    dict(family="gpt2", checkpointing="reentrant"),
    dict(family="gpt2", checkpointing="non_reentrant"),
    # a trained head beside the adapters (PEFT's modules_to_save; SEQ_CLS does it for its score):
    # the root's only trainable parameters are the head's, computed before the frozen final norm's
    # backward reads its weight for the last block's gradient
    dict(family="llama", modules_to_save=["lm_head"]),
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_peft_lora_trains_like_one_process(rank_pools: RankPoolRegistry, world: int, stage: int) -> None:
    pool = rank_pools.get(world)
    for case in PEFT_CASES:
        for result in pool.run(train_peft_and_compare, dict(case, stage=stage)):
            worst = max(result["adapter_errors"].values())
            assert result["all_moved"] and result["frozen_equal"], case
            assert worst <= 1e-5, f"{case}: adapter rel. error {worst}"


BF16_CASES = {
    # bf16 compute, fp32 masters, against one process doing the same (peft_cases)
    "llama-compute": dict(family="llama", param_dtype="bf16", checkpointing="reentrant"),
    "gpt2-compute": dict(family="gpt2", param_dtype="bf16", checkpointing="non_reentrant"),
    # a frozen base held in bf16 with fp32 adapters (peft upcasts them), no param_dtype
    "llama-bf16-base": dict(family="llama", base_dtype="bf16", checkpointing="non_reentrant"),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", sorted(BF16_CASES))
@pytest.mark.parametrize("stage", STAGES)
def test_peft_lora_in_bf16_matches_a_bf16_reference(rank_pools: RankPoolRegistry, stage: int, case: str,
                                                    world: int) -> None:
    """Tolerance: bf16 rounds at 2^-8 = 3.9e-3 relative. The ranks' gradients are reduced in
    bf16, and a bf16 matmul on this CPU rounds differently for a 2-row slice than for the
    6-row global batch, so the gradients agree to about one bf16 rounding; after SGD steps
    (see peft_cases.make_optimizer) the adapters agree to a fraction of that."""
    case = dict(BF16_CASES[case], stage=stage, optimizer="sgd")
    for result in rank_pools.get(world).run(train_peft_and_compare, case):
        worst = max(result["adapter_errors"].values())
        assert result["all_moved"] and result["frozen_equal"]
        assert worst <= 4e-3, f"{case}: adapter rel. error {worst}"


@pytest.mark.parametrize("family,stage,world", [("llama", 3, 2), ("llama", 3, 3), ("gpt2", 3, 2),
                                                ("llama", 0, 2), ("gpt2", 2, 3)])
def test_peft_adapter_saves_and_loads_back(rank_pools: RankPoolRegistry, tmp_path, family: str, stage: int,
                                           world: int) -> None:
    folder = str(tmp_path / "adapter")
    results = rank_pools.get(world).run(save_and_reload_adapter, dict(family=family, stage=stage, folder=folder))
    result = results[0]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["files"])
    assert result["saved_keys"] and all(".lora_" in key for key in result["saved_keys"])
    with open(os.path.join(folder, "adapter_config.json")) as file:
        assert json.load(file)["r"] == 4
    for rank_result in results:
        # only the adapter buckets were gathered (the frozen base is many times larger)
        if stage == 3:
            assert 0 < rank_result["gathered_bytes"] <= rank_result["adapter_bytes"]
        else:
            assert rank_result["gathered_bytes"] == 0
    assert result["reload_err"] <= 1e-5
    assert result["merged_err"] <= 1e-5 and result["consolidated_merged_err"] <= 1e-5
    assert result["merged_type"] != "PeftModel"


@pytest.mark.parametrize("stage", STAGES)
def test_model_save_pretrained_writes_the_hf_folder(rank_pools: RankPoolRegistry, tmp_path, stage: int) -> None:
    """A Hugging Face user's ``model.save_pretrained(dir)`` on the wrapped model: the same
    folder as ``se.save_pretrained``, loading to the trained values; refused arguments name
    themselves and write nothing."""
    results = rank_pools.get(2).run(wrapped_save_pretrained, dict(family="llama", stage=stage, root=str(tmp_path)))
    result = results[0]
    assert result["equal"]
    assert "config.json" in result["files"] and "model.safetensors.index.json" in result["files"]
    for key, value in result["trained"].items():
        assert torch.equal(result["written"][key], value), key
    for name, message in result["refused"].items():
        assert message is not None and name in message, (name, message)
    assert not result["exists_refused"]
