"""Misuse gets a clear error that says what to change, never a hang.

Single-process cases run in-process (``run_local``: no process group). The
cross-rank cases run on pools: ranks that disagree on the model must all get
a ConfigError; a rank that skips a collective must make the other rank fail
with CollectiveError once the engine's ``timeout_s`` expires. That last case
leaves the ranks out of step, so it uses a private pool, shut down after.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import shardengine as se
from engine_cases import (Block, _small, misuse, shard_disagreeing, shard_expecting_error,
                          skip_backward_on_rank1)
from rank_pool import RankError, RankPool, RankPoolRegistry

CASES = [
    # (case, phrase the message must contain)
    ("stage=5", r"stage must be one of"),
    ("stage=two", r"stage must be one of"),
    ("stage=True", r"stage must be one of"),
    ("stage=-1", r"stage must be one of"),
    ("unknown_option", r"unknown option.*bukcet_mb"),
    ("negative_bucket_mb", r"bucket_mb must be a finite number > 0"),
    ("bad_collectives", r"collectives must be one of.*'nccl'"),
    ("foreign_param", r"not a parameter of the model"),
    ("wrap_twice_module", r"already wrapped"),
    ("wrap_twice_sharded", r"already wrapped"),
    ("lbfgs1", r"element-wise"),
    ("lbfgs2", r"element-wise"),
    ("lbfgs3", r"element-wise"),
    ("stepped_optimizer1", r"already has state"),
    ("stepped_optimizer2", r"already has state"),
    ("stepped_optimizer3", r"already has state"),
    ("meta_stage0", r"meta device.*stage=3"),
    ("meta_stage1", r"meta device.*stage=3"),
    ("meta_stage2", r"meta device.*stage=3"),
]


@pytest.mark.parametrize("case,phrase", CASES, ids=[case for case, _ in CASES])
def test_misuse_raises_config_error(case: str, phrase: str) -> None:
    with pytest.raises(se.ConfigError, match=phrase) as caught:
        misuse(case)
    assert isinstance(caught.value, ValueError)  # ConfigError is a ValueError


@pytest.mark.parametrize("case", ["lbfgs0", "meta_stage3"])
def test_accepted_cases(case: str) -> None:
    """LBFGS is fine at stage 0 (whole tensors on every rank); a meta model is fine at stage 3."""
    misuse(case)


NAN, INF = float("nan"), float("inf")
FINITE = "must be a finite number > 0"
BAD_OPTIONS = [
    # (shard() keyword arguments, phrase the ConfigError must contain)
    ({"bucket_mb": INF}, f"bucket_mb {FINITE}"), ({"bucket_mb": NAN}, f"bucket_mb {FINITE}"),
    ({"bucket_mb": "25"}, f"bucket_mb {FINITE}"), ({"bucket_mb": True}, f"bucket_mb {FINITE}"),
    ({"bucket_mb": 0}, f"bucket_mb {FINITE}"), ({"bucket_mb": 1e305}, f"bucket_mb {FINITE} and <="),
    ({"timeout_s": "10"}, f"timeout_s {FINITE}"), ({"timeout_s": -1}, f"timeout_s {FINITE}"),
    ({"timeout_s": INF}, f"timeout_s {FINITE}"), ({"timeout_s": 1e20}, f"timeout_s {FINITE} and <="),
    ({"wrap": 5}, "wrap must be nn.Module subclasses"), ({"wrap": "Block"}, "wrap must be nn.Module subclasses"),
    ({"wrap": [Block, 3]}, "wrap must be nn.Module subclasses"),
    ({"wrap_min_params": 0}, "wrap_min_params must be an int >= 1"),
    ({"wrap_min_params": "100"}, "wrap_min_params must be an int >= 1"),
    ({"wrap_min_params": 1.5}, "wrap_min_params must be an int >= 1"),
    ({"param_init_fn": 3}, "param_init_fn must be callable"),
    ({"allow_unknown_optimizer": "yes"}, "allow_unknown_optimizer must be True or False"),
    ({"max_inflight_buckets": 0}, "max_inflight_buckets must be an int >= 1"),
    ({"max_inflight_buckets": 2.0}, "max_inflight_buckets must be an int >= 1"),
    ({"param_dtype": "int8"}, "param_dtype must be one of"),
    ({"param_dtype": torch.int64}, "param_dtype must be one of"),
    ({"reduce_dtype": 16}, "reduce_dtype must be one of"),
    ({"param_dtype": "fp16", "loss_scale": INF}, f"loss_scale {FINITE} or 'dynamic'"),
    ({"param_dtype": "fp16", "loss_scale": True}, f"loss_scale {FINITE} or 'dynamic'"),
    ({"param_dtype": "fp16", "loss_scale": "static"}, f"loss_scale {FINITE} or 'dynamic'"),
    ({"initial_loss_scale": "65536"}, f"initial_loss_scale {FINITE}"),
    ({"initial_loss_scale": NAN}, f"initial_loss_scale {FINITE}"),
    ({"offload_optimizer": 1}, 'offload_optimizer must be True, False or "disk"'),
    ({"prefetch": -1}, "prefetch must be an int >= 0"), ({"prefetch": 1.0}, "prefetch must be an int >= 0"),
    ({"reshard_after_forward": None}, "reshard_after_forward must be True or False"),
    ({"collectives": ["auto"]}, "collectives must be one of"),
    ({"find_unused_parameters": "no"}, "find_unused_parameters must be True or False"),
    ({"stage": 1.0}, "stage must be one of"), ({"stage": "1"}, "stage must be one of"),
    ({"config": {"stage": 1}}, "config must be a ShardConfig"),
    ({"micro_batch": 0}, "micro_batch must be an int >= 1"), ({"seq_len": "128"}, "seq_len must be an int >= 1"),
    ({"example_inputs": 5}, "example_inputs must be callable"),
    ({"memory_budget_bytes": "1e9"}, f"memory_budget_bytes {FINITE}"),
    ({"memory_budget_bytes": -5}, f"memory_budget_bytes {FINITE}"),
]


@pytest.mark.parametrize("options,phrase", BAD_OPTIONS, ids=[repr(o) for o, _ in BAD_OPTIONS])
def test_wrong_option_type_or_value_is_a_config_error(options: dict, phrase: str) -> None:
    net = _small()
    with pytest.raises(se.ConfigError) as caught:
        se.shard(net, torch.optim.Adam(net.parameters()), **{"stage": 1, **options})
    assert phrase in str(caught.value)


@pytest.mark.parametrize("model,phrase", [
    (lambda x: x, "model must be a torch.nn.Module instance, got function"),
    (nn.Linear, "model must be a torch.nn.Module instance, got the class Linear"),
])
def test_something_else_than_a_module_is_a_config_error(model, phrase: str) -> None:
    with pytest.raises(se.ConfigError, match=phrase):
        se.shard(model, lambda params: torch.optim.Adam(params), stage=1)


def test_shard_config_checks_its_fields_when_built_directly() -> None:
    with pytest.raises(se.ConfigError, match="bucket_mb must be a finite number > 0, got 'x'"):
        se.config.ShardConfig(bucket_mb="x")
    assert se.config.ShardConfig(stage=2, bucket_mb=1, timeout_s=5).bucket_mb == 1.0


DISAGREEMENT_PHRASES = {
    "stage": "stage: rank 0 has 1, rank 1 has 2",
    "collectives": "option collectives: rank 0 has 'auto', rank 1 has 'native'",
    "param_dtype": "option param_dtype: rank 0 has None, rank 1 has torch.bfloat16",
    "wrap": "option wrap: rank 0 has None, rank 1 has (toy_models.Block,)",
    "units": "stage-3 wrap units: rank 0 has blocks.0, blocks.1, <root>, rank 1 has <root>",
    "param_init_fn": "option param_init_fn: rank 0 has engine_cases._init_a, rank 1 has engine_cases._init_b",
    "timeout_s": "option timeout_s: rank 0 has None, rank 1 has 10.0",
    "find_unused_parameters": "option find_unused_parameters: rank 0 has False, rank 1 has True",
    "optimizer": "optimizer class: rank 0 has torch.optim.adam.Adam, rank 1 has torch.optim.sgd.SGD",
    "lr": "optimizer param group 0 lr: rank 0 has 0.001, rank 1 has 0.01",
    "bad_option_on_one_rank": "shard() failed on rank(s) [1]",
}


@pytest.mark.parametrize("case", list(DISAGREEMENT_PHRASES))
def test_ranks_calling_shard_differently_all_get_a_config_error(rank_pools: RankPoolRegistry, case: str) -> None:
    """Caught by one exchange before any group is created: no abort, no timeout, no silent divergence."""
    pool = rank_pools.get(2)
    restarts = pool.restarts
    rank0, rank1 = pool.run(shard_disagreeing, case)
    assert rank0["is_config_error"] and rank1["is_config_error"], (rank0, rank1)
    assert DISAGREEMENT_PHRASES[case] in rank0["message"], rank0["message"]
    if case == "bad_option_on_one_rank":  # the failing rank raises its own error; rank 0 names it
        assert "bucket_mb must be a finite number > 0, got '25'" in rank0["message"]
        assert rank1["message"].startswith("bucket_mb must be a finite number > 0")
    else:
        assert rank1["message"] == rank0["message"]
    assert max(rank0["seconds"], rank1["seconds"]) < 5
    assert pool.restarts == restarts, "the ranks' collectives got out of step"


def test_ranks_disagreeing_on_shapes_fail_on_every_rank(rank_pools: RankPoolRegistry) -> None:
    pool = rank_pools.get(2)
    restarts = pool.restarts
    results = pool.run(shard_expecting_error, "ranks_disagree")
    for rank, result in enumerate(results):
        assert result["is_config_error"], f"rank {rank}: {result}"
        # Names the differing entry and both shapes.
        assert "blocks.0.lin.weight" in result["message"], result["message"]
        assert "(3, 5)" in result["message"] and "(4, 5)" in result["message"], result["message"]
    assert pool.restarts == restarts, "the ranks' collectives got out of step"


@pytest.fixture(scope="module")
def timeout_pool():
    """Private pool: the timeout case leaves its ranks' collectives out of step."""
    pool = RankPool(2, collective_timeout_s=20)
    yield pool
    pool.shutdown(graceful=False)


@pytest.mark.parametrize("stage", [0, 3])
def test_rank_skipping_backward_gives_collective_error_not_hang(timeout_pool: RankPool, stage: int) -> None:
    timeout_pool.wait_ready()  # the previous case tore the pool down: time the engine, not the restart
    started = time.monotonic()
    try:
        results = timeout_pool.run(skip_backward_on_rank1, 3.0, stage, timeout=60)
    except RankError as error:  # an escape through the worker is also an error, not a hang
        results = error.results
        pytest.fail(f"unexpected failure outside the step: {error}")
    elapsed = time.monotonic() - started
    rank0, rank1 = results
    assert rank1["error"] is None
    assert rank0["is_collective_error"], rank0
    assert "timeout" in rank0["message"].lower() and "skipped" in rank0["message"], rank0["message"]
    assert rank0["seconds"] < 10, rank0
    assert elapsed < 20
