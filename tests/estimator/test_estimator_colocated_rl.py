"""The estimator's colocated RL plan: a rollout engine's weights, KV cache, activations and the weight
sync's bucket beside each trainer plan, moment by moment (memory_estimator/plan/colocated.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from memory_estimator.api import estimate
from memory_estimator.cli.command import main
from memory_estimator.errors import EstimatorInputError
from memory_estimator.model.stats import Architecture
from memory_estimator.plan.colocated import colocated_rl
from memory_estimator.terms.rollout import RolloutRequest, rollout_terms

LLAMA_8B = "tests/configs/llama-3.1-8b.json"  # 32 layers, 8 KV heads of 128, vocabulary 128256


@pytest.fixture(scope="module")
def llama() -> object:
    return estimate(config=LLAMA_8B, world_size=8, device="H100-80GB")


def test_the_kv_cache_weights_and_logits_follow_the_model_shape(llama) -> None:
    terms = rollout_terms(llama.stats, RolloutRequest(kv_tokens=1000, tensor_parallel=2, decode_batch=10))
    assert terms.kv_cache == 1000 * 2 * 32 * 8 * 128 * 2 // 2  # K and V, every layer, bf16, over 2 ranks
    assert terms.weights == llama.stats.params * 2 // 2
    assert terms.activations >= 10 * 128256 * 4   # the sampler's fp32 logits at least
    fp8 = rollout_terms(llama.stats, RolloutRequest(kv_tokens=1000, kv_dtype="fp8"))
    assert fp8.kv_cache == 1000 * 2 * 32 * 8 * 128
    # the embedding (128256 x 4096 in bf16) is larger than the cap: the stream sends it alone
    assert terms.sync_bucket == 128256 * 4096 * 2


def test_each_moment_adds_the_rollout_to_the_trainer(llama) -> None:
    answer = colocated_rl(llama, RolloutRequest(kv_tokens=65536))
    rollout = answer.rollout
    for plan, trainer in zip(answer.plans, llama.plans):
        resident = rollout.weights + rollout.kv_cache
        assert plan.train > trainer.total + resident * 0.99
        assert plan.generate > rollout.weights + rollout.kv_cache + rollout.activations + trainer.optimizer_states
        assert plan.sync < plan.generate  # a sync bucket is smaller than decoding's activations here
        assert plan.fits == (plan.peak <= plan.usable)
    assert answer.recommended == next(p.name for p in answer.plans if p.fits)
    slept = colocated_rl(llama, RolloutRequest(kv_tokens=65536, sleep="all"))
    assert all(s.train < p.train for s, p in zip(slept.plans, answer.plans))
    assert [s.generate for s in slept.plans] == [p.generate for p in answer.plans]


def test_the_sync_bucket_is_the_streams_bound_for_the_same_model_and_cap() -> None:
    import shardengine as se
    from shardengine.testing.models import build_gpt

    facts = estimate(module="shardengine.testing.models:build_gpt", seq_len=32, device="this-machine").stats
    facts = dataclasses.replace(facts, architecture=Architecture(layers=2, hidden=64, heads=2, vocab=256))
    net = build_gpt()
    model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3)
    for cap in (4096, 1 << 20):
        stream = model.stream_weights(dtype="bf16", bucket_bytes=cap)
        assert rollout_terms(facts, RolloutRequest(kv_tokens=0, sync_bucket_bytes=cap)).sync_bucket == stream.bound_bytes


def test_the_cli_prints_the_colocated_verdict_and_its_json(capsys) -> None:
    flags = ["--config", LLAMA_8B, "--gpus", "8", "--device", "H100-80GB", "--rollout-kv-tokens", "65536"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "colocated RL (rollout in bf16" in out and "colocated: use " in out
    assert main(flags + ["--json"]) == 0
    answer = json.loads(capsys.readouterr().out)["colocated_rl"]
    assert answer["rollout"]["kv_cache"] == 65536 * 2 * 32 * 8 * 128 * 2
    assert {p["peak_moment"] for p in answer["plans"]} <= {"train", "generate", "sync"}
    # a KV cache no device holds: no plan fits beside it (exit 1), though the trainer alone fits
    assert main(flags[:-1] + ["4000000", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["colocated_rl"]["recommended"] is None


@pytest.mark.parametrize("request_, message", [
    (RolloutRequest(kv_tokens=-1), "kv_tokens must be a whole number >= 0"),
    (RolloutRequest(kv_tokens=10, dtype="int4"), "dtype must be one of"),
    (RolloutRequest(kv_tokens=10, sleep="deep"), "sleep must be one of"),
    (RolloutRequest(kv_tokens=10, tensor_parallel=0), "tensor_parallel must be a whole number >= 1"),
])
def test_bad_rollout_requests_are_input_errors(llama, request_, message) -> None:
    with pytest.raises(EstimatorInputError, match=message):
        colocated_rl(llama, request_)


def test_a_model_without_its_shape_cannot_size_a_kv_cache() -> None:
    with pytest.raises(EstimatorInputError, match="needs the model's shape"):
        colocated_rl(estimate(params=7e9, world_size=8), RolloutRequest(kv_tokens=10))
