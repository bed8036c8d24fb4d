"""Tests of the multi-rank harness itself (tests/rank_pool.py).

Functions that run on the ranks live at module level: workers import them
by name. Shared pools come from the session's ``rank_pools``; tests that
break a pool on purpose use their own ``fragile_pool`` so the shared ones
never restart.
"""

from __future__ import annotations

import os
import time
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from rank_pool import RankError, RankPool, RankPoolError, RankPoolRegistry, RanksUnresponsive, run_local

# Short enough that the hang test is quick, long enough for 2 cores under load.
FRAGILE_COLLECTIVE_TIMEOUT_S = 5.0


# --------------------------------------------------------------------------- functions run on ranks


def rank_identity() -> dict[str, int]:
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "env_rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def all_reduce_rank_plus_one() -> torch.Tensor:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value


def all_reduce_values(values: list[float]) -> tuple[list[float], int]:
    """Each rank contributes values * (rank + 1); also reports its pid."""
    tensor = torch.tensor(values, dtype=torch.float64) * (dist.get_rank() + 1)
    dist.all_reduce(tensor)
    return tensor.tolist(), os.getpid()


def fail_on_rank(failing_rank: int) -> int:
    print(f"rank {dist.get_rank()} checking in")
    if dist.get_rank() == failing_rank:
        raise ValueError(f"deliberate failure on rank {failing_rank}")
    return dist.get_rank()


def all_reduce_on_rank_zero_only() -> int:
    """A collective only rank 0 calls: rank 0 must hit the collective timeout."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def sleep_on_rank(sleeping_rank: int, seconds: float) -> int:
    if dist.get_rank() == sleeping_rank:
        time.sleep(seconds)
    return dist.get_rank()


def exit_on_rank(dying_rank: int) -> int:
    if dist.get_rank() == dying_rank:
        os._exit(3)
    return dist.get_rank()


def abort_at_exit_on_rank(aborting_rank: int) -> int:
    """Leave an abort for interpreter exit: what a Gloo thread without the GIL does."""
    import atexit
    if dist.get_rank() == aborting_rank:
        atexit.register(os.abort)
    return dist.get_rank()


def non_leaf_tensor() -> torch.Tensor:
    leaf = torch.ones(2, requires_grad=True)
    return leaf * 2


def process_group_state() -> tuple[bool, int]:
    initialized = dist.is_available() and dist.is_initialized()
    return initialized, dist.get_world_size() if initialized else 1


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fragile_pool() -> Iterator[RankPool]:
    """A private 2-rank pool with a short collective timeout, for tests that break it."""
    pool = RankPool(2, collective_timeout_s=FRAGILE_COLLECTIVE_TIMEOUT_S)
    yield pool
    pool.shutdown(graceful=False)


# --------------------------------------------------------------------------- shared pools


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_per_rank_in_rank_order(rank_pools: RankPoolRegistry, world_size: int) -> None:
    infos = rank_pools.get(world_size).run(rank_identity)
    assert [info["rank"] for info in infos] == list(range(world_size))
    for rank, info in enumerate(infos):
        assert info["world_size"] == info["local_world_size"] == world_size
        assert info["env_rank"] == info["local_rank"] == rank
        assert info["threads"] == 1
    assert len({info["pid"] for info in infos}) == world_size


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_sums_across_the_pool(rank_pools: RankPoolRegistry, world_size: int) -> None:
    results = rank_pools.get(world_size).run(all_reduce_rank_plus_one)
    expected = world_size * (world_size + 1) / 2
    assert [tensor.item() for tensor in results] == [expected] * world_size


def test_rank_exception_carries_traceback_and_pool_keeps_working(rank_pools: RankPoolRegistry) -> None:
    pool = rank_pools.get(3)
    pids_before, restarts_before = pool.pids(), pool.restarts
    with pytest.raises(RankError) as caught:
        pool.run(fail_on_rank, 1)
    error = caught.value
    assert list(error.failures) == [1]
    assert error.failures[1].exc_type == "ValueError"
    assert "fail_on_rank" in error.failures[1].traceback
    assert "deliberate failure on rank 1" in str(error)
    assert "rank 1 checking in" in str(error)  # the failing call's output is in the message
    assert error.results == [0, None, 2]
    # No collective was left half-done, so the pool is kept, not restarted.
    assert pool.run(fail_on_rank, -1) == [0, 1, 2]
    assert (pool.pids(), pool.restarts) == (pids_before, restarts_before)


def test_results_are_detached_cpu_tensors(rank_pools: RankPoolRegistry) -> None:
    (result,) = rank_pools.get(1).run(non_leaf_tensor)
    assert result.device.type == "cpu" and not result.requires_grad
    assert result.tolist() == [2.0, 2.0]


def test_run_local_has_no_process_group_while_pool_of_one_has(rank_pools: RankPoolRegistry) -> None:
    assert run_local(process_group_state) == [(False, 1)]
    assert rank_pools.get(1).run(process_group_state) == [(True, 1)]


def test_functions_workers_cannot_import_are_rejected(rank_pools: RankPoolRegistry) -> None:
    with pytest.raises(TypeError, match="module-level function"):
        rank_pools.get(1).run(lambda: 1)


_pids_seen_by_examples: list[list[int]] = []


@settings(max_examples=20)
@given(values=st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=8))
def test_hypothesis_examples_reuse_the_same_workers(rank_pools: RankPoolRegistry, values: list[float]) -> None:
    world_size = 2
    results = rank_pools.get(world_size).run(all_reduce_values, values)
    expected = [value * 3 for value in values]  # ranks contribute 1x and 2x
    for reduced, _pid in results:
        assert reduced == pytest.approx(expected)
    _pids_seen_by_examples.append([pid for _reduced, pid in results])
    assert _pids_seen_by_examples[-1] == _pids_seen_by_examples[0]


def test_hypothesis_test_ran_many_examples_in_one_pool() -> None:
    # Runs after the @given test (file order): all its examples saw one set of workers.
    assert len(_pids_seen_by_examples) >= 10
    assert len({tuple(pids) for pids in _pids_seen_by_examples}) == 1


# --------------------------------------------------------------------------- failures that break a pool


def test_collective_on_one_rank_times_out_and_pool_restarts(fragile_pool: RankPool) -> None:
    pids_before, restarts_before = fragile_pool.pids(), fragile_pool.restarts
    started = time.monotonic()
    with pytest.raises(RankError) as caught:
        fragile_pool.run(all_reduce_on_rank_zero_only, timeout=60)
    assert time.monotonic() - started < FRAGILE_COLLECTIVE_TIMEOUT_S + 10
    assert list(caught.value.failures) == [0]
    assert "Timed out" in caught.value.failures[0].message
    assert "out of step" in str(caught.value)
    assert fragile_pool.restarts == restarts_before + 1
    assert fragile_pool.run(sleep_on_rank, -1, 0) == [0, 1]
    assert set(fragile_pool.pids()).isdisjoint(pids_before)


def test_rank_past_call_timeout_is_named_and_pool_restarts(fragile_pool: RankPool) -> None:
    restarts_before = fragile_pool.restarts
    with pytest.raises(RanksUnresponsive) as caught:
        fragile_pool.run(sleep_on_rank, 1, 60, timeout=2)
    assert (caught.value.silent_ranks, caught.value.dead_ranks) == ([1], [])
    assert "rank(s) [1] did not answer within 2 s" in str(caught.value)
    assert fragile_pool.restarts == restarts_before + 1
    assert fragile_pool.run(sleep_on_rank, -1, 0) == [0, 1]


def test_dead_rank_is_named_and_pool_restarts(fragile_pool: RankPool) -> None:
    restarts_before = fragile_pool.restarts
    with pytest.raises(RanksUnresponsive) as caught:
        fragile_pool.run(exit_on_rank, 0, timeout=60)
    assert caught.value.dead_ranks == [0]
    assert "exit codes {0: 3}" in str(caught.value)
    assert fragile_pool.restarts == restarts_before + 1
    assert fragile_pool.run(exit_on_rank, -1) == [0, 1]


def test_worker_aborting_at_exit_fails_the_shutdown(fragile_pool: RankPool) -> None:
    """The session's pools are stopped this way at the end: an abnormal exit fails the session."""
    assert fragile_pool.run(abort_at_exit_on_rank, 1) == [0, 1]
    with pytest.raises(RankPoolError, match=r"rank 1 exited with code -6 when stopped") as caught:
        fragile_pool.shutdown()
    assert "rank 0" not in str(caught.value)
    assert fragile_pool.run(sleep_on_rank, -1, 0) == [0, 1]  # restarts on next use
