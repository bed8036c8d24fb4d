"""The optimizer step inside backward (``step_in_backward=True``, stages 1-3).

Training with the option equals training without it bit for bit, on the same ranks and
data: every reduced slice is divided by the same agreed divisor (uneven batches included)
and stepped by the same per-bucket step ([Note: the step inside backward] in
shardengine/stages/in_backward.py); a parameter no rank used is left alone, as torch
leaves it. Gradients exist only while their bucket is in flight and none after backward.
What cannot be combined with it is a ConfigError naming the conflict.
"""

from __future__ import annotations

import pytest
import torch

import shardengine as se
from rank_pool import RankPoolRegistry
from step_in_backward_cases import misuse_in_training, train_in_small_runs, train_with_and_without
from toy_models import build_model, make_optimizer

pytestmark = pytest.mark.prestart(2, 3)

SPEC = dict(seed=3, vocab=11, dim=7, hidden=[5, 3, 4], per_rank_batch=3, optimizer="adamw",
            bucket_mb=0.0005, steps=3, extra=True, uneven=True,
            buffer=False)  # an fp32 buffer would meet bf16 activations
PRECISIONS = {"fp32": {}, "bf16": {"param_dtype": "bf16"},
              "bf16-reduced-in-fp32": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}


def assert_trained_as_after_backward(results: list[dict]) -> None:
    """Each rank's states equal the step after backward's, three steps with their hooks ran, and
    no gradient byte was held after any backward."""
    for rank, result in enumerate(results):
        assert result["states_equal"], f"rank {rank}: max difference {result['max_diff']}"
        assert result["steps"] == (3, 3) and result["hooks_ran"] == 3, f"rank {rank}"
        assert result["grads_after_backward"] == [0, 0, 0], f"rank {rank}: gradient bytes held after backward"


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_step_in_backward_equals_step_after_backward(rank_pools: RankPoolRegistry, world: int, stage: int,
                                                     precision: str) -> None:
    # The optional layer: used by rank 0 only, by no rank (it must not be stepped), by all.
    spec = {**SPEC, "stage": stage, "options": PRECISIONS[precision],
            "extra_on": [[0], [], list(range(world))]}
    results = rank_pools.get(world).run(train_with_and_without, spec)
    assert_trained_as_after_backward(results)
    for rank, result in enumerate(results):
        assert all(result["grad_attrs_none"]), f"rank {rank}"
    for rank, result in enumerate(results[1:], start=1):
        assert all(torch.equal(t, results[0]["state"][k]) for k, t in result["state"].items()), f"rank {rank}"


@pytest.mark.parametrize("world, precision", [(2, "bf16-reduced-in-fp32"), (3, "fp32")])
def test_step_in_backward_without_resharding_after_forward(rank_pools: RankPoolRegistry, world: int,
                                                           precision: str) -> None:
    # Stage 3 as SHARD_GRAD_OP (units kept gathered from forward to the end of their backward):
    # the step inside backward runs where each unit's slice lands, after the unit is freed.
    spec = {**SPEC, "stage": 3, "options": {**PRECISIONS[precision], "reshard_after_forward": False},
            "extra_on": [[0], [], list(range(world))]}
    assert_trained_as_after_backward(rank_pools.get(world).run(train_with_and_without, spec))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_step_in_capped_runs_equals_step_after_backward(rank_pools: RankPoolRegistry, world: int,
                                                         stage: int) -> None:
    # A cap of one fp32 element: runs as large as a bucket's largest piece (a weight's or a
    # bias's fragment), each with a gradient cast for it alone; the result is the one step
    # over the bucket.
    spec = {**SPEC, "stage": stage, "options": PRECISIONS["bf16"], "extra_on": [[0], [], list(range(world))],
            "run_bytes": 4}
    results = rank_pools.get(world).run(train_in_small_runs, spec)
    for rank, result in enumerate(results):
        assert result["states_equal"], f"rank {rank}: max difference {result['max_diff']}"
        assert result["grads_after_backward"] == [0, 0, 0], f"rank {rank}"


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_gradients_exist_only_in_flight(rank_pools: RankPoolRegistry, world: int, stage: int) -> None:
    # Every rank uses every parameter: each slice is stepped and freed where it lands, so
    # when a bucket lands the engine holds that bucket's slice and nothing else.
    spec = {**SPEC, "stage": stage, "extra": False, "options": {"param_dtype": "bf16"}}
    for rank, result in enumerate(rank_pools.get(world).run(train_with_and_without, spec)):
        shards = result["shard_bytes"]
        assert len(shards) > 2, "the model should span several buckets"
        assert max(result["held_on_landing"]) <= max(shards) < sum(shards), f"rank {rank}"
        assert result["grads_after_backward"] == [0, 0, 0], f"rank {rank}"


@pytest.mark.parametrize("case, phrase", [
    ("clip", "clip_grad_norm_()"), ("no_sync", "no_sync()"), ("join", "model.join()"),
    ("second_backward", "a second backward before optimizer.step()"),
    ("zero_grad_before_step", "zero_grad() between backward and optimizer.step()"),
])
def test_conflicting_calls_raise_config_error(rank_pools: RankPoolRegistry, case: str, phrase: str) -> None:
    for message in rank_pools.get(2).run(misuse_in_training, case):
        assert phrase in message and "step_in_backward=True" in message


class _MyAdamW(torch.optim.AdamW):
    pass


def _shard_with(optimizer_of, **options) -> None:
    torch.manual_seed(0)
    net = build_model(dict(vocab=7, dim=5, hidden=[3]))
    se.shard(net, optimizer_of(net), step_in_backward=True, **options)


@pytest.mark.parametrize("optimizer_of, options, phrase", [
    (lambda net: make_optimizer(net, "adam"), {"stage": 0}, "stage 0"),
    (lambda net: make_optimizer(net, "adam"), {"stage": 2, "param_dtype": "fp16"}, "fp16 loss scaling"),
    (lambda net: make_optimizer(net, "adam"), {"stage": 2, "offload_optimizer": True}, "offload_optimizer"),
    (lambda net: _MyAdamW(net.parameters()), {"stage": 2}, "_MyAdamW"),
    (lambda net: torch.optim.Adafactor(net.parameters()), {"stage": 3}, "whole-tensor optimizer"),
])
def test_conflicting_options_raise_config_error_at_shard(optimizer_of, options: dict, phrase: str) -> None:
    with pytest.raises(se.ConfigError, match="step_in_backward=True") as raised:
        _shard_with(optimizer_of, **options)
    assert phrase in str(raised.value)
