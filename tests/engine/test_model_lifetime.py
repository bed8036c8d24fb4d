"""Dropping a sharded model frees it: its engine, buffers, process group and the group's threads.

A process that shards model after model (a sweep, a notebook, this test suite) must not
keep every one of them alive. Workers: ``lifetime_cases.py``.
"""

from __future__ import annotations

import pytest

from lifetime_cases import drop_models
from rank_pool import RankPoolRegistry


@pytest.mark.parametrize("world", [2, 3])
def test_dropped_models_free_their_engine_and_threads(rank_pools: RankPoolRegistry, world: int) -> None:
    for result in rank_pools.get(world).run(drop_models, [0, 1, 2, 3], 3):
        assert result["engines_alive"] == [], result
        # Twelve models later the process holds no more threads than after the first one
        # (each leaked Gloo group used to keep four).
        assert result["threads_after"] <= result["threads_before"], result
