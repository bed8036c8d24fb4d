"""Korthikanti et al. (2022) activation formula and the logits/loss term."""
import pytest
from hypothesis import given, settings, strategies as st

from memory_estimator.activations import ActivationInputs, activation_bytes, logits_loss_bytes
from memory_estimator.errors import EstimatorInputError
from memory_estimator.stats import Architecture

LLAMA_7B = Architecture(layers=32, hidden=4096, heads=32, vocab=32000)


def test_formula_without_recomputation_keeps_score_matrices():
    s, b, h, a, L = 2048, 2, 4096, 32, 32
    expected = L * s * b * h * (34 + 5 * a * s // h)
    assert activation_bytes(LLAMA_7B, ActivationInputs(b, s, "none", fused_attention=False)) == expected


def test_fused_attention_and_selective_drop_the_score_term():
    fused = activation_bytes(LLAMA_7B, ActivationInputs(1, 4096, "none", fused_attention=True))
    selective = activation_bytes(LLAMA_7B, ActivationInputs(1, 4096, "selective", fused_attention=False))
    assert fused == selective == 32 * 34 * 4096 * 4096


def test_full_checkpointing_keeps_layer_inputs_plus_one_layer():
    s, b, h, a = 4096, 1, 4096, 32
    one_layer = s * b * h * 34 + 5 * a * s * s * b
    assert activation_bytes(LLAMA_7B, ActivationInputs(b, s, "full", fused_attention=False)) == (
        32 * 2 * s * b * h + one_layer)


def test_checkpointing_never_increases_bytes_and_fp32_doubles():
    sizes = [activation_bytes(LLAMA_7B, ActivationInputs(2, 1024, mode, False)) for mode in ("none", "selective", "full")]
    assert sizes[0] > sizes[1] > sizes[2]
    assert activation_bytes(LLAMA_7B, ActivationInputs(2, 1024, fp32_activations=True)) == 2 * activation_bytes(
        LLAMA_7B, ActivationInputs(2, 1024))


def test_logits_are_fp32_values_plus_fp32_grads():
    assert logits_loss_bytes(32000, 2, 4096) == 2 * 4 * 2 * 4096 * 32000


def test_unknown_checkpointing_mode():
    with pytest.raises(EstimatorInputError, match="unknown checkpointing 'partial'"):
        activation_bytes(LLAMA_7B, ActivationInputs(1, 16, "partial"))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 512), st.integers(1, 8192), st.sampled_from(["none", "selective", "full"]), st.booleans())
def test_activation_bytes_grow_linearly_in_micro_batch(micro_batch, seq_len, mode, fused):
    one = activation_bytes(LLAMA_7B, ActivationInputs(1, seq_len, mode, fused))
    assert activation_bytes(LLAMA_7B, ActivationInputs(micro_batch, seq_len, mode, fused)) == micro_batch * one
