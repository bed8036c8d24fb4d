"""The control plane: no store traffic while training, O(1) per announced call, stopped peers noticed fast.

* A training step (forward, backward, ``no_sync`` accumulation, ``clip_grad_norm_``,
  ``step``, ``zero_grad``) and an eval forward send nothing to the rendezvous store at
  stages 0-3 (the default store wrapped and counted, the groups' backend included).
* An announced collective call sends the same few requests per rank at N = 2 and 3.
* A rank that stops while the others wait in its collectives is noticed within one
  0.5 s slice plus a store round trip (distributed/channel.py), the host wait of
  device collectives (``host_copy``, NCCL's path) included: in
  ``test_partial_collectives.py``, whose pools survive a stopped rank.
* A rank killed outright (SIGKILL) is noticed at once (``dead_peer_cases.py``, its own
  processes: the rank pool does not survive a killed worker).

Workers: ``control_plane_cases.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from control_plane_cases import NOTICE_BOUND_S, count_store_requests
from rank_pool import RankPoolRegistry, scripts_pythonpath

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [{"stage": 0, "micro_steps": 2}, {"stage": 1}, {"stage": 2, "options": {"param_dtype": "bf16"}},
           {"stage": 3, "micro_steps": 2}]


@pytest.fixture(scope="module")
def counted(rank_pools: RankPoolRegistry) -> dict[int, list[list[dict]]]:
    return {world: rank_pools.get(world).run(count_store_requests, CONFIGS) for world in (2, 3)}


@pytest.mark.parametrize("world", [2, 3])
def test_a_training_step_sends_nothing_to_the_store(counted, world: int) -> None:
    for rank, per_config in enumerate(counted[world]):
        for config, found in zip(CONFIGS, per_config):
            assert found["steps"] == [], (world, rank, config, found["steps"])


def test_an_announced_call_costs_the_same_few_requests_at_any_world_size(counted) -> None:
    for index, config in enumerate(CONFIGS):
        per_rank = {world: [len(ranks[index]["announced"]) for ranks in counted[world]] for world in (2, 3)}
        if config["stage"] in (0, 1):  # state_dict() is local there: no announcement at all
            assert per_rank == {2: [0, 0], 3: [0, 0, 0]}, per_rank
            continue
        # set, compare_set, add, wait, get: five; the last rank to arrive also sets the done key
        assert all(sorted(counts) == [5] * (len(counts) - 1) + [6] for counts in per_rank.values()), per_rank


def test_a_killed_rank_is_noticed_at_once(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": scripts_pythonpath()}
    done = subprocess.run([sys.executable, os.path.join(HERE, "dead_peer_cases.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    killed_at = float((tmp_path / "killed").read_text())
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert result["error"] is not None and "timeout is 300s" in result["error"], result
        assert result["noticed_at"] - killed_at < NOTICE_BOUND_S, (rank, result["noticed_at"] - killed_at)
        print(f"rank {rank} noticed the killed rank after {result['noticed_at'] - killed_at:.2f} s")
