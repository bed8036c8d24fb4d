"""The wrapped model as a module: buffers, attributes, and ranks that fall out of step.

(issue: drop-in fidelity items 7-8; faults item 5.)
"""

from __future__ import annotations

import pytest
import torch

from fidelity_cases import (batchnorm_replicas, ddp_batchnorm_rank0, exception_caught_on_one_rank,
                            extra_forward_on_one_rank)
from rank_pool import RankPoolRegistry


pytestmark = pytest.mark.prestart(2, 3)  # start-ups overlap (conftest.py)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_batchnorm_statistics_follow_rank0_like_ddp(rank_pools: RankPoolRegistry, stage: int) -> None:
    pool = rank_pools.get(3)
    ours = pool.run(batchnorm_replicas, {"stage": stage, "broadcast_buffers": True})
    ddp = pool.run(ddp_batchnorm_rank0, {})[0]
    for rank, result in enumerate(ours):
        assert torch.equal(result["mean"], ours[0]["mean"]) and torch.equal(result["var"], ours[0]["var"])
        assert torch.equal(result["out"], ours[0]["out"]), f"rank {rank}: eval outputs differ"
        assert result["batches"] == 3
    assert torch.allclose(ours[0]["mean"], ddp["mean"], rtol=1e-5, atol=1e-6)
    assert torch.allclose(ours[0]["var"], ddp["var"], rtol=1e-5, atol=1e-6)


def test_broadcast_buffers_false_keeps_each_ranks_own(rank_pools: RankPoolRegistry) -> None:
    ours = rank_pools.get(2).run(batchnorm_replicas, {"stage": 2, "broadcast_buffers": False})
    assert not torch.equal(ours[0]["mean"], ours[1]["mean"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_exception_caught_on_one_rank_stops_every_rank(rank_pools: RankPoolRegistry, stage: int) -> None:
    results = rank_pools.get(2).run(exception_caught_on_one_rank, {"stage": stage, "timeout_s": 20})
    for rank, result in enumerate(results):
        assert result["errors"], f"rank {rank} went on training out of step"
    assert "forward pass raised on rank 1" in results[1]["errors"][0]
    assert "forward pass raised on rank 1" in results[0]["errors"][0] or "peer" in results[0]["errors"][0]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stray_forward_on_one_rank_is_caught_at_the_step(rank_pools: RankPoolRegistry, stage: int) -> None:
    results = rank_pools.get(2).run(extra_forward_on_one_rank, {"stage": stage})
    for rank, result in enumerate(results):
        assert len(result["errors"]) == 1, f"rank {rank}: {result}"
        message = result["errors"][0]
        assert "out of step" in message and "rank 0: 1 optimizer steps, 2 training forward" in message
        assert "rank 1: 1 optimizer steps, 3 training forward" in message
