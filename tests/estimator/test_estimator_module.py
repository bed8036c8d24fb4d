"""nn.Module input: meta-device counting, tied weights, units, and the traced activations."""
import os

import psutil
import pytest
import torch
from torch import nn

from memory_estimator import estimate
from memory_estimator.errors import EstimatorInputError
from memory_estimator.model.module import (LiveBytesTracker, count_parameters, largest_unit_params, load_module,
                                           traced_activation_bytes)
from shardengine.testing.models import GPT, GPTConfig, build_gpt, example_inputs

# Two GPT-2 blocks of width 128, a tied head, contexts up to 256 tokens.
SMALL = GPTConfig(vocab_size=1024, seq_len=256, n_layer=2, n_head=4, n_embd=128)


def small_gpt() -> GPT:
    return GPT(SMALL)


def test_meta_module_count_equals_real_module_count():
    real = small_gpt()
    meta = load_module(small_gpt).module
    assert all(p.is_meta for p in meta.parameters())
    assert count_parameters(meta) == sum(p.numel() for p in real.parameters()) == count_parameters(real)


def test_tied_parameters_counted_once():
    model = GPT(GPTConfig(vocab_size=1000, seq_len=16, n_layer=1, n_head=2, n_embd=64))
    every_tensor = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert every_tensor - count_parameters(model) == 1000 * 64


def test_real_module_is_converted_without_touching_it():
    real = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    meta = load_module(real).module
    assert meta is not real and all(p.is_meta for p in meta.parameters())
    assert not any(p.is_meta for p in real.parameters())
    assert count_parameters(meta) == 8 * 8 + 8 + 8 * 2 + 2


def test_largest_unit_is_one_block_or_the_rest():
    shape = GPTConfig(vocab_size=50, seq_len=8, n_layer=3, n_head=2, n_embd=32)
    block = sum(p.numel() for p in GPT(shape).blocks[0].parameters())
    assert largest_unit_params(load_module(lambda: GPT(shape)).module) == block
    big_vocab = GPTConfig(vocab_size=5000, seq_len=8, n_layer=3, n_head=2, n_embd=32)
    # Embedding (tied head), positions and final norm are one leftover-free set of units;
    # the 5000×32 embedding is now the largest.
    assert largest_unit_params(load_module(lambda: GPT(big_vocab)).module) == 5000 * 32


def test_live_bytes_tracker_sees_allocations_and_frees():
    with LiveBytesTracker() as tracker:
        a = torch.empty(1000, device="meta")
        b = torch.empty(500, device="meta")
        del a
        c = b * 2
    assert tracker.peak_bytes == 6000 and tracker.live_bytes == 4000
    del b, c


def test_traced_activations_scale_with_micro_batch_and_allocate_nothing():
    meta = load_module(small_gpt).module
    rss_before = psutil.Process(os.getpid()).memory_info().rss
    b2, b4, b8 = (traced_activation_bytes(meta, example_inputs, b, 128, torch.float32) for b in (2, 4, 8))
    assert psutil.Process(os.getpid()).memory_info().rss - rss_before < 64 * 2**20
    # Layer activations alone: 2 blocks × (b·s·h fp32 tensors, at least the 4h MLP input).
    assert b2 > 2 * 2 * 128 * 4 * 128 * 4
    # Affine in the micro-batch: batch-sized tensors scale exactly, weight-sized
    # temporaries (a gradient in flight) are a constant offset.
    assert b8 - b4 == 2 * (b4 - b2) > 0
    assert next(meta.parameters()).dtype == torch.float32  # tracing used a copy


def test_estimate_with_module_factory_string_traces_activations():
    result = estimate(module="shardengine.testing.models:build_gpt", micro_batch=2, seq_len=64, device="T4")
    assert result.activation_source == "traced"
    assert result.params == count_parameters(build_gpt())
    at_forward = [plan for plan in result.plans if plan.peak_moment == "forward"]
    assert at_forward and all(plan.activations > 0 for plan in at_forward)
    assert result.recommended == "ddp" and result.max_micro_batch > 2


def test_module_without_example_inputs_reports_activations_not_estimated():
    result = estimate(module=lambda: nn.Linear(10, 10), device="T4")
    assert result.activation_source == "not estimated" and result.plans[0].activations == 0
    assert any("activations were not estimated" in note for note in result.notes)


def test_bad_module_specs():
    with pytest.raises(EstimatorInputError, match="must look like package.module:build_fn"):
        load_module("shardengine.testing.models")
    with pytest.raises(EstimatorInputError, match="cannot import 'no_such_pkg'"):
        load_module("no_such_pkg:build")
    with pytest.raises(EstimatorInputError, match="not an nn.Module"):
        load_module(lambda: 42)
