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

import shardengine as se
from engine_cases import misuse, shard_expecting_error, skip_backward_on_rank1
from rank_pool import RankError, RankPool, RankPoolRegistry

CASES = [
    # (case, phrase the message must contain)
    ("stage=5", r"stage must be one of"),
    ("stage=two", r"stage must be one of"),
    ("stage=True", r"stage must be one of"),
    ("stage=-1", r"stage must be one of"),
    ("unknown_option", r"unknown option.*bukcet_mb"),
    ("negative_bucket_mb", r"bucket_mb must be > 0"),
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
