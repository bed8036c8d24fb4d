"""A backward pass that raises halfway stops the engine with a clear error at the next call.

Reductions were launched for the buckets (units) whose gradients came before the failure and
not for the others, so the ranks' collectives no longer pair up; at stage 3 units were gathered
for a backward that never ended. The next engine call says so, at every world size, rather than
reading freed buffers or reporting a second gradient ([Note: a backward that raised] in
shardengine/stages/failure.py).
"""

from __future__ import annotations

import pytest

from backward_failure_cases import next_call_after_failed_backward
from rank_pool import RankPoolRegistry

MIXED = {"param_dtype": "bf16", "reduce_dtype": "fp32"}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_after_a_failed_backward_the_next_call_says_to_rebuild_and_resume(stage: int) -> None:
    message = next_call_after_failed_backward(stage, {})
    assert "a backward pass raised before it finished" in message and "resume from the last checkpoint" in message


@pytest.mark.parametrize("stage", [2, 3])
def test_after_a_failed_backward_every_rank_stops_instead_of_mispairing(rank_pools: RankPoolRegistry,
                                                                         stage: int) -> None:
    for message in rank_pools.get(2).run(next_call_after_failed_backward, stage, MIXED):
        assert "a backward pass raised before it finished" in message, message
