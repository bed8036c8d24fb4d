"""stage="auto"'s choice, estimator side: activations always counted, and every lever searched.

``memory_estimator.auto_plan`` is what ``shard(stage="auto")`` asks on rank 0. These tests ask
it directly (no engine): the inputs it builds for a module, the error when it cannot, and the
levers it picks where nothing less fits. The budgets come from the planner's own candidates
(one search at a large budget: a candidate's device bytes do not depend on the budget).
tests/engine/test_auto_activation_levers.py runs the same choices through shard().
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from auto_cases import LONG, MARGIN, gpt, lever_budgets, long_context_candidates, on_host, request
from memory_estimator import EstimatorInputError, auto_plan

@pytest.fixture(scope="module")
def long_context():
    """Every candidate of the 8-layer GPT at sequence 2048 (device bytes per rank), and the module."""
    return long_context_candidates()


def test_auto_picks_checkpointing_where_nothing_without_it_fits(long_context):
    module, candidates = long_context
    budget = lever_budgets(candidates)["checkpointing"]
    answer = auto_plan(request(module, budget), local_world_size=2)
    assert answer["checkpointing"] != "none" and answer["total_bytes"] <= MARGIN * budget
    assert any(line.startswith("activation checkpointing: ") and "none needs" in line for line in answer["lines"])


def test_auto_picks_activation_offload_where_nothing_without_it_fits(long_context):
    module, candidates = long_context
    budget = lever_budgets(candidates)["offload"]
    answer = auto_plan(request(module, budget), local_world_size=2)
    assert answer["activation_offload"] and answer["total_bytes"] <= MARGIN * budget
    assert answer["host_bytes"] > 0  # the offloaded activations are judged against the host
    assert any(line.startswith("activation offload: on") for line in answer["lines"])


def test_at_the_tightest_budget_auto_checkpoints_offloads_and_moves_parameters_to_the_host(long_context):
    module, candidates = long_context
    tightest = min(candidates, key=lambda run: run.memory_bytes)
    assert tightest.checkpointing != "none" and tightest.activation_offload and on_host(tightest.plan)
    budget = lever_budgets(candidates)["all"]
    answer = auto_plan(request(module, budget), local_world_size=2)
    assert answer["checkpointing"] != "none" and answer["activation_offload"]
    assert answer["offload_params"] or answer["device_budget"], answer
    assert answer["total_bytes"] <= MARGIN * budget


def test_without_the_engines_activation_levers_auto_splits_the_batch_instead():
    """Before the engine checkpoints itself, auto keeps the activation policy as given and uses
    the micro-batch: half the batch per micro-step, twice the accumulation, said in its plan."""
    module = gpt(**LONG)
    full = auto_plan(request(module, 2**40, micro_batch=2, implied=True), activation_levers=False)
    assert (full["micro_batch"], full["grad_accum"]) == (2, 1)
    budget = int(full["total_bytes"] * 0.8 / MARGIN)
    split = auto_plan(request(module, budget, micro_batch=2, implied=True), activation_levers=False)
    assert (split["micro_batch"], split["grad_accum"], split["checkpointing"]) == (1, 2, "none"), split
    assert any("run 2 micro-steps of 1" in line for line in split["lines"])


def test_the_printed_plan_says_what_it_counted_and_each_lever():
    answer = auto_plan(request(gpt(**LONG), 2**40, implied=True))
    heads = [line.split(":")[0] for line in answer["lines"]]
    assert heads[:3] == ["stage", "parameters on the host", "optimizer"]
    assert {"activation checkpointing", "activation offload", "micro-batch", "activations", "estimated"} <= set(heads)
    activations = next(line for line in answer["lines"] if line.startswith("activations:"))
    assert "traced on fake tensors from token ids of micro_batch x seq_len below 256" in activations


class FirstLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_module_whose_inputs_are_not_implied_is_refused_with_what_to_pass():
    with pytest.raises(EstimatorInputError, match="pass example_inputs="):
        auto_plan(request(FirstLinear(), 2**30, seq_len=8, implied=True))


def test_a_module_with_its_own_example_inputs_is_traced_with_them():
    module = FirstLinear()
    module.example_inputs = lambda micro_batch, seq_len: torch.randn(micro_batch, seq_len, 16)
    answer = auto_plan(request(module, 2**30, seq_len=8, implied=True))
    assert "the model's own example_inputs" in answer["activations"]


def test_a_hugging_face_model_is_traced_from_its_config_with_labels():
    """The issue's case: a 4-layer Llama (hidden 256) at micro-batch 2 x 2048 in 754 MiB, where
    auto used to choose ddp on its model states alone. Traced from input_ids and labels built
    from its config, its logits and activations are counted: nothing fits that budget."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=32000,
                                      max_position_embeddings=2048)
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(config)
    states = sum(p.numel() for p in llama.parameters()) * 16  # fp32 AdamW: weights, grads, two moments
    tight = auto_plan(request(llama, 754 * 2**20, micro_batch=2, world_size=1, implied=True),
                     activation_levers=False)
    assert tight["recommended"] is None and min(tight["totals"].values()) > 754 * 2**20
    assert "input_ids and labels" in tight["activations"] and "32,000" in tight["activations"]
    roomy = auto_plan(request(llama, 8 * 2**30, micro_batch=2, world_size=1, implied=True),
                     activation_levers=False)
    assert roomy["recommended"] == "ddp" and roomy["total_bytes"] > states + 2**30  # states and activations
