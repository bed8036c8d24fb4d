"""A traced module's activations under each checkpointing policy and offload, from one trace.

The estimator traces the module once (fake tensors) and prices every policy unit by unit
(memory_estimator/model/traced_blocks.py). Here the same module is traced again with its
blocks really wrapped in ``torch.utils.checkpoint`` (and torch's selective-checkpoint
contexts saving the matmuls): the priced peak equals the traced one.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memory_estimator import estimate
from memory_estimator.model.module import load_module, traced_activations
from memory_estimator.model.traced_blocks import ATTENTION_OPS, MATMUL_OPS
from shardengine.flat.plan import find_units
from shardengine.testing.models import GPT, GPTConfig, example_inputs

SHAPE = GPTConfig(vocab_size=128, seq_len=256, n_layer=4, n_head=2, n_embd=64)
MICRO_BATCH, SEQ = 2, 256


def inputs(micro_batch: int, seq_len: int):
    return example_inputs(micro_batch, seq_len, vocab_size=SHAPE.vocab_size)


def units(module):
    return [unit for unit, _, _ in find_units(module, None, None)[:-1]]


def _save_matmuls(_ctx, op, *_args, **_kwargs):
    name = op.overloadpacket.__name__
    return CheckpointPolicy.MUST_SAVE if name in MATMUL_OPS | ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(GPT):
    """The GPT with its blocks checkpointed as ``policy`` says (what the engine applies per unit)."""

    def __init__(self, policy: str):
        super().__init__(SHAPE)
        self.policy = policy

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for index, block in enumerate(self.blocks):
            if self.policy == "every-k:2" and index % 2:
                x = block(x)
            elif self.policy == "selective:mm":
                x = checkpoint(block, x, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))
            else:
                x = checkpoint(block, x, use_reentrant=False)
        return self.loss(self.lm_head(self.ln_f(x)), targets)


def traced_peak(build) -> int:
    return traced_activations(load_module(build).module, inputs, MICRO_BATCH, SEQ, torch.float32).peak


@pytest.fixture(scope="module")
def priced():
    return traced_activations(load_module(lambda: GPT(SHAPE)).module, inputs, MICRO_BATCH, SEQ, torch.float32, units)


@pytest.mark.parametrize("policy, tolerance", [("full", 0.01), ("every-k:2", 0.01), ("selective:mm", 0.03)])
def test_each_policy_priced_from_one_trace_equals_the_checkpointed_trace(priced, policy, tolerance):
    measured = traced_peak(lambda: Checkpointed(policy))
    assert priced.profile(policy, False, MICRO_BATCH).stored == pytest.approx(measured, rel=tolerance)
    assert priced.profile(policy, False, MICRO_BATCH).stored < priced.peak


def test_no_policy_is_the_trace_itself_and_scales_with_the_micro_batch(priced):
    assert priced.profile("none", False, MICRO_BATCH).stored == priced.peak
    assert priced.profile("full", False, 2 * MICRO_BATCH).stored == 2 * priced.profile("full", False, MICRO_BATCH).stored


def test_offload_moves_what_each_unit_keeps_to_the_host_but_two_units(priced):
    copies = [unit.host_copies for unit in priced.units]
    assert all(0 < copy <= unit.saved for copy, unit in zip(copies, priced.units))
    offloaded = priced.profile("none", True, MICRO_BATCH)
    assert offloaded.host == sum(copies[:-1])  # the engine never offloads the last unit (backward needs it first)
    # in backward the running unit and the one below it are back on the device
    assert 2 * min(copies) <= offloaded.stored < priced.peak
    both = priced.profile("full", True, MICRO_BATCH)
    assert both.host == sum(unit.inputs for unit in priced.units[:-1])  # checkpointed units keep only their inputs
    assert both.stored <= priced.profile("full", False, MICRO_BATCH).stored


def test_the_estimate_of_a_module_follows_the_checkpointing_and_offload_it_is_given():
    common = dict(module=lambda: GPT(SHAPE), example_inputs=inputs, micro_batch=MICRO_BATCH, seq_len=SEQ,
                  precision="fp32", device="cpu", device_memory_bytes=2**34)
    plain = estimate(**common).plan("zero3")
    full = estimate(**common, checkpointing="full").plan("zero3")
    offloaded = estimate(**common, activation_offload=True).plan("zero3")
    assert full.activations < plain.activations and offloaded.activations < plain.activations
    assert offloaded.host_activations > 0 and offloaded.host_bytes >= offloaded.host_activations
    assert plain.host_activations == 0


ENGINE_POLICIES = [("none", False), ("full", False), ("every-k:2", False), ("selective:mm", False),
                   ("selective:mm/2", False), ("none", True), ("full", True), ("every-k:2", True)]


@pytest.mark.parametrize("stage", [0, 3])
def test_kept_bytes_per_policy_are_the_engines_measured_ones(stage: int) -> None:
    """What the estimator says each policy keeps for backward (device and host) is what the
    engine's memory_report() measures when it applies that policy to the same model (issue 38:
    within 5% on CPU; both count each saved storage once through the same ledger)."""
    import shardengine as se

    with torch.device("meta"):
        meta = GPT(SHAPE)
    traced = traced_activations(meta, inputs, MICRO_BATCH, SEQ, torch.float32, units, device="cpu")
    ids, targets = inputs(MICRO_BATCH, SEQ)
    for checkpointing, offload in ENGINE_POLICIES:
        net = GPT(SHAPE)
        model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage,
                                    activation_checkpointing=checkpointing, activation_offload=offload,
                                    measure_activations=True)
        model(ids, targets).backward()
        optimizer.step()
        report = model.memory_report()
        priced = traced.profile(checkpointing, offload, MICRO_BATCH)
        where = f"{checkpointing}, offload={offload}"
        assert report.peak_activations > 0, where
        assert priced.kept == pytest.approx(report.peak_activations, rel=0.05), where
        assert priced.kept_host == pytest.approx(report.peak_host_activations, rel=0.05, abs=0), where
