"""Analytic activations: Korthikanti et al. (2022) per layer, what families add, checkpointing policies, logits."""
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from memory_estimator.terms.activations import (ActivationInputs, activation_bytes, activation_profile, layer_bytes,
                                          logits_loss_bytes)
from memory_estimator.terms.checkpointing import parse_policy
from memory_estimator.errors import EstimatorInputError
from memory_estimator.model.stats import Architecture

GPT = Architecture(layers=32, hidden=4096, heads=32, vocab=32000)   # Korthikanti's GPT: 4h MLP, LayerNorm, dropout
LLAMA3_8B = Architecture(layers=32, hidden=4096, heads=32, vocab=128256, kv_heads=8, mlp_width=14336,
                         gated_mlp=True, norm="rmsnorm", dropout=False)
POLICIES = ["none", "selective", "full", "every-k:2", "every-k:4", "selective:mm", "selective:mm/2"]


def outside(arch, b, s, c=2):
    """The final norm's input and the LM head's input."""
    norm = (4 + c) * arch.hidden if arch.norm == "rmsnorm" else c * arch.hidden
    return b * s * (norm + c * arch.hidden)


def test_one_layer_is_exactly_korthikanti():
    s, h, a = 2048, 4096, 32
    assert layer_bytes(GPT, s, 2, store_scores=False) == 34 * h
    assert layer_bytes(GPT, s, 2, store_scores=True) == 34 * h + 5 * a * s


def test_all_layers_plus_final_norm_and_head_input():
    s, b = 2048, 2
    expected = 32 * s * b * (34 * 4096 + 5 * 32 * s) + outside(GPT, b, s)
    assert activation_bytes(GPT, ActivationInputs(b, s, "none", fused_attention=False)) == expected


def test_gated_mlp_gqa_and_rmsnorm_per_layer():
    h, f, kv_width = 4096, 14336, 8 * 128
    norms = 2 * (4 + 2) * h                       # fp32 upcast input + normalized output, twice
    attention = 2 * h + 2 * (h + 2 * kv_width) + 2 * h
    mlp = 2 * h + 4 * 2 * f                       # input, then gate, act, up and their product
    assert layer_bytes(LLAMA3_8B, 4096, 2, store_scores=False) == norms + attention + mlp


def test_moe_layer_routes_each_token_to_k_experts():
    dense = Architecture(4, 512, 8, 1000, mlp_width=1024, gated_mlp=True, dropout=False)
    moe = replace(dense, experts=8, experts_per_token=2)
    per_token = layer_bytes(moe, 64, 2, store_scores=False, moe=True) - layer_bytes(dense, 64, 2, store_scores=False)
    # router logits (fp32), then per chosen expert: a dispatched input copy, the gated core, the output
    assert per_token == 4 * 8 + 2 * (2 * 2 * 512 + 4 * 2 * 1024) - 4 * 2 * 1024
    shared = replace(moe, shared_expert_width=2048)
    assert layer_bytes(shared, 64, 2, store_scores=False, moe=True) - layer_bytes(
        moe, 64, 2, store_scores=False, moe=True) == 4 * 2 * 2048


def test_autocast_keeps_norms_and_softmax_in_fp32():
    plain = layer_bytes(GPT, 512, 2, store_scores=True)
    amp = layer_bytes(GPT, 512, 2, store_scores=True, autocast=True)
    assert amp - plain == 2 * (4 - 2) * 4096 + (4 - 2) * 32 * 512


def test_full_checkpointing_keeps_layer_inputs_and_recomputes_one_layer_after_the_logits():
    s, b, h = 4096, 1, 4096
    profile = activation_profile(GPT, ActivationInputs(b, s, "full", fused_attention=False))
    assert profile.stored == 32 * 2 * s * b * h + outside(GPT, b, s)
    assert profile.recompute == s * b * (34 * h + 5 * 32 * s - 2 * h)


def test_every_k_checkpoints_ceil_l_over_k_layers():
    s, b, h = 1024, 1, 4096
    full_layer = s * b * 34 * h
    stored = activation_profile(GPT, ActivationInputs(b, s, "every-k:3")).stored - outside(GPT, b, s)
    assert stored == 11 * s * b * 2 * h + 21 * full_layer  # ceil(32/3) = 11 checkpointed layers


def test_selective_mm_keeps_matmul_outputs_and_mm2_every_second_one():
    s, b, h, f, kv = 1024, 1, 4096, 14336, 1024
    mm = [2 * h, 2 * kv, 2 * kv, 2 * h, 2 * f, 2 * f, 2 * h]   # q, k, v, o, gate, up, down
    base = 2 * h + 2 * h                                       # layer input + attention kernel output
    for policy, kept in (("selective:mm", mm), ("selective:mm/2", mm[::2]), ("selective:op", mm[::2])):
        stored = activation_profile(LLAMA3_8B, ActivationInputs(b, s, policy)).stored - outside(LLAMA3_8B, b, s)
        assert stored == 32 * s * b * (base + sum(kept)), policy


@pytest.mark.parametrize("fused", [True, False])
def test_policies_never_keep_more_than_none_and_full_keeps_least(fused):
    stored = {p: activation_profile(GPT, ActivationInputs(2, 1024, p, fused)).stored for p in POLICIES}
    assert all(stored[p] <= stored["none"] for p in POLICIES)
    assert all(stored["full"] <= stored[p] for p in POLICIES)
    assert stored["every-k:4"] > stored["every-k:2"] > stored["full"]


def test_fp32_activations_double_all_but_the_one_byte_dropout_masks():
    bf16 = layer_bytes(GPT, 256, 2, store_scores=True)
    fp32 = layer_bytes(GPT, 256, 4, store_scores=True)
    masks = 2 * 4096 + 32 * 256  # two hidden-state masks and the attention-probability mask
    assert fp32 - masks == 2 * (bf16 - masks)


def test_logits_buffers_at_the_start_of_backward():
    # c-byte logits, fp32 log-probabilities saved by the loss, and its two fp32 gradients
    assert logits_loss_bytes(32000, 2, 4096) == (2 + 4 + 4 + 4) * 2 * 4096 * 32000
    assert logits_loss_bytes(32000, 2, 4096, compute_bytes=4) == 16 * 2 * 4096 * 32000


@pytest.mark.parametrize("text,message", [
    ("partial", "unknown checkpointing 'partial'"), ("every-k:0", "K must be a whole number >= 1"),
    ("every-k:x", "K must be a whole number"), ("selective:attn", "unknown checkpointing")])
def test_bad_checkpointing_policies(text, message):
    with pytest.raises(EstimatorInputError, match=message):
        parse_policy(text)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 512), st.integers(1, 8192), st.sampled_from(POLICIES), st.booleans())
def test_activation_bytes_grow_linearly_in_micro_batch(micro_batch, seq_len, mode, fused):
    one = activation_bytes(LLAMA3_8B, ActivationInputs(1, seq_len, mode, fused))
    assert activation_bytes(LLAMA3_8B, ActivationInputs(micro_batch, seq_len, mode, fused)) == micro_batch * one
