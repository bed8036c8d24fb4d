"""An exception inside forward: training goes on where the ranks are still in step (issue 39, item 8).

FSDP2's test_reset_iter_state_after_exception, restated: the forward raises, the loop catches it
and trains on. See [Note: an exception inside forward] in shardengine/stages/failure.py; a training
forward that raised on some ranks only stops every rank (tests/engine/test_fidelity_model.py).
"""

from __future__ import annotations

import pytest

from peer_exception_cases import train_through_exceptions
from rank_pool import RankPoolRegistry

pytestmark = pytest.mark.prestart(2, 3)


def _check_trained_on(results: list[dict], raising: list[int]) -> None:
    for rank, result in enumerate(results):
        assert result["message"] is None, f"rank {rank} stopped: {result['message']}"
        assert result["caught"] == (["bad batch"] if rank in raising else []), rank
        assert result["error"] < 1e-5, f"rank {rank}: {result}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_training_forward_raising_on_every_rank_recovers(rank_pools: RankPoolRegistry, stage: int,
                                                         world: int) -> None:
    raising = list(range(world))
    _check_trained_on(rank_pools.get(world).run(
        train_through_exceptions, {"stage": stage, "ranks": raising, "eval": False}), raising)


@pytest.mark.parametrize("stage,world", [(3, 2), (3, 3), (0, 2), (2, 3)])
def test_evaluation_forward_raising_on_one_rank_recovers(rank_pools: RankPoolRegistry, stage: int,
                                                         world: int) -> None:
    """At stage 3 the others' gathers of that forward were served by the rank that raised."""
    _check_trained_on(rank_pools.get(world).run(
        train_through_exceptions, {"stage": stage, "ranks": [1], "eval": True}), [1])


@pytest.mark.parametrize("stage", [1, 3])
def test_training_forward_raising_on_one_rank_stops_every_rank(rank_pools: RankPoolRegistry, stage: int) -> None:
    for rank, result in enumerate(rank_pools.get(3).run(
            train_through_exceptions, {"stage": stage, "ranks": [1], "eval": False})):
        assert result["message"] is not None, f"rank {rank} trained on out of step"
        assert "forward pass raised on rank 1" in result["message"] or "peer" in result["message"], result
