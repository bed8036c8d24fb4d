"""A collective call made on some ranks only is a prompt error naming the call, on every rank.

A rank that stops while the others wait in its collectives is noticed within one 0.5 s
slice plus a store round trip (distributed/channel.py), also by the host wait of device
collectives (NCCL's path, ``Communicator.host_copy``).

Workers: ``partial_call_cases.py``, ``control_plane_cases.py``.
"""

from __future__ import annotations

import pytest

from control_plane_cases import NOTICE_BOUND_S, host_wait_notices_a_stopped_peer, stop_while_others_wait
from partial_call_cases import call_on_every_rank, call_on_rank0_only, evaluate_on_rank0_only
from rank_pool import RankPoolRegistry

NAMES = {"state_dict": "model.state_dict()", "summon": "model.summon_full_params()",
         "full_optimizer_state_dict": "model.full_optimizer_state_dict()"}


@pytest.fixture(scope="module")
def failing_pools():
    """Private pools: after a rank stops, the others' abandoned Gloo work stays queued until the
    collective timeout, and leaving the group waits for it; these pools are killed, not stopped."""
    pools = RankPoolRegistry()
    yield pools
    pools.shutdown_all(graceful=False)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("call, stage, options", [
    ("state_dict", 3, {}),
    ("state_dict", 2, {"param_dtype": "bf16"}),
    ("summon", 3, {}),
    ("full_optimizer_state_dict", 1, {}),
])
def test_call_on_rank0_only_fails_promptly_on_every_rank(failing_pools: RankPoolRegistry, world: int, call: str,
                                                         stage: int, options: dict, tmp_path) -> None:
    spec = dict(stage=stage, call=call, timeout_s=300.0, options=options)
    results = failing_pools.get(world).run(call_on_rank0_only, spec, str(tmp_path / "model.pt"))
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not fail"
        assert NAMES[call] in result["error"], result["error"]
        assert "rank(s) [0]" in result["error"], result["error"]
        assert result["seconds"] < 20, f"rank {rank} failed only after {result['seconds']:.0f}s"
    assert "rank0_only=True" in results[0]["error"] or call != "state_dict"


@pytest.mark.parametrize("stage, options", [(0, {}), (3, {}), (2, {"param_dtype": "bf16"})])
def test_collective_calls_on_every_rank_still_work(rank_pools: RankPoolRegistry, stage: int, options: dict,
                                                   tmp_path) -> None:
    results = rank_pools.get(2).run(call_on_every_rank, dict(stage=stage, options=options),
                                    str(tmp_path / "model.pt"))
    assert all(result["keys"] == results[0]["keys"] and result["equal_to_rank0_only"] for result in results)


def test_state_dict_on_rank0_only_is_fine_where_it_is_local(rank_pools: RankPoolRegistry, tmp_path) -> None:
    """Stage 0 (and fp32 stages 1-2) hold full values: the DDP idiom keeps working there."""
    results = rank_pools.get(2).run(call_on_rank0_only, dict(stage=0, call="state_dict", timeout_s=300.0),
                                    str(tmp_path / "model.pt"))
    assert [result["error"] for result in results] == [None, None]


@pytest.mark.parametrize("world", [2, 3])
def test_stage2_evaluates_on_rank0_alone_between_steps(rank_pools: RankPoolRegistry, world: int) -> None:
    """Stage 2 keeps the whole compute-dtype parameters between steps (ZeRO-2's layout, not
    SHARD_GRAD_OP's): one rank evaluates and reads weights without the others, no collective."""
    results = rank_pools.get(world).run(evaluate_on_rank0_only, dict(stage=2, options={"param_dtype": "bf16"}))
    assert all(result["losses"] == results[0]["losses"] for result in results)
    assert results[0]["alone"] == results[0]["losses"]
    assert all(result["weight_sums"] == results[0]["weight_sums"] for result in results)
    assert len(set(results[0]["weight_sums"])) == 3  # the weights moved at every step


@pytest.mark.parametrize("stage", [1, 3])
def test_a_rank_that_stops_is_noticed_within_a_slice(failing_pools: RankPoolRegistry, stage: int) -> None:
    results = failing_pools.get(3).run(stop_while_others_wait, dict(stage=stage, delay_s=1.0))
    stopped = results[2]["stopped_at"]
    for rank, result in enumerate(results[:2]):
        assert result["error"] is not None and "stopped on purpose for the test" in result["error"], (rank, result)
        assert result["noticed_at"] - stopped < NOTICE_BOUND_S, (rank, result["noticed_at"] - stopped)
        print(f"stage {stage}: rank {rank} noticed the stop after {result['noticed_at'] - stopped:.2f} s")


def test_the_host_wait_of_device_collectives_notices_a_stopped_peer(failing_pools: RankPoolRegistry) -> None:
    results = failing_pools.get(2).run(host_wait_notices_a_stopped_peer, 1.0)
    waited = results[0]
    assert waited["error"] == "a peer stopped while this rank waited", waited
    assert waited["noticed_at"] - results[1]["stopped_at"] < NOTICE_BOUND_S, waited
    print(f"the host wait noticed the stop after {waited['noticed_at'] - results[1]['stopped_at']:.2f} s")
