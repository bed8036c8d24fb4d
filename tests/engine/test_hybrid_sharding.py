"""Hybrid sharding (``shard_group_size=k``): shard within groups of k ranks, replicate across them.

The property users rely on is the same as for plain sharding: training equals a
single process on the global batch (parameters and the clipping norm), for
N in {2, 4}, every k dividing N and stages 1-3, with accumulation and clipping.
The clipping norm is the sharp test of the groups: the replicas hold the same
shards, so a norm summed over all N ranks would count every element N/k times.

Bytes per group are checked in test_engine_comm.py, memory in test_engine_memory.py,
the estimator in test_estimator_engine_agreement.py and test_time_model_estimator.py,
checkpoints in test_checkpoint_resharding.py, two "nodes" in test_multinode.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

import shardengine as se
from engine_cases import base_spec_for, batch, check_equivalence, train_and_compare
from rank_pool import rank_world
from toy_models import build_model
from rank_pool import RankPoolRegistry
from shardengine.errors import ConfigError
from shardengine.config import ShardConfig, resolve_shard_group_size

LAYOUTS = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]  # (N, k): every k dividing N


pytestmark = pytest.mark.prestart(2, 4)  # start-ups overlap (conftest.py)


@st.composite
def hybrid_specs(draw) -> tuple[int, dict]:
    world, k = draw(st.sampled_from(LAYOUTS))
    spec = base_spec_for(
        seed=draw(st.integers(0, 2**16)), vocab=draw(st.sampled_from([5, 11, 13])),
        dim=draw(st.sampled_from([3, 5, 8])),
        hidden=draw(st.lists(st.sampled_from([1, 2, 5, 7, 13]), min_size=1, max_size=3)),
        tied=draw(st.booleans()), frozen=draw(st.booleans()), stage=draw(st.sampled_from([1, 2, 3])),
        optimizer=draw(st.sampled_from(["sgd_momentum", "adam", "adamw"])), micro_steps=draw(st.integers(1, 3)),
        steps=2, max_norm=draw(st.sampled_from([0.05, 1e3])), per_rank_batch=draw(st.integers(1, 3)),
        bucket_mb=draw(st.sampled_from([25.0, 0.0005])), collectives=draw(st.sampled_from(["auto", "native"])),
        options={"shard_group_size": k})
    return world, spec


# Pinned: both hybrid layouts of 4 ranks at stage 3 with every feature, and stage 2 with many
# small buckets and active clipping.
@example(example=(4, base_spec_for(stage=3, hidden=[13, 2, 7], tied=True, frozen=True, optimizer="adamw",
                                   micro_steps=3, max_norm=0.05, per_rank_batch=1,
                                   options={"shard_group_size": 2})))
@example(example=(4, base_spec_for(stage=2, hidden=[11], frozen=True, micro_steps=2, max_norm=0.05,
                                   bucket_mb=0.0005, options={"shard_group_size": 1})))
@settings(max_examples=8)
@given(example=hybrid_specs())
def test_hybrid_sharding_matches_single_process_reference(rank_pools: RankPoolRegistry,
                                                          example: tuple[int, dict]) -> None:
    world, spec = example
    check_equivalence(rank_pools.get(world).run(train_and_compare, spec))


# --------------------------------------------------------------------------- the option


def test_group_size_resolution() -> None:
    assert resolve_shard_group_size(None, 4, 2) == 4          # plain sharding
    assert resolve_shard_group_size(2, 4, None) == 2
    assert resolve_shard_group_size(4, 4, None) == 4          # one group: plain sharding
    assert resolve_shard_group_size("node", 8, 4) == 4
    assert resolve_shard_group_size("node", 1, None) == 1     # one process: nothing to split
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        resolve_shard_group_size(3, 4, None)
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        resolve_shard_group_size(8, 4, None)
    with pytest.raises(ConfigError, match="shard_group_size=4 does not divide the world size 6"):
        resolve_shard_group_size("node", 6, 4)                # 4 ranks per node, 6 in all
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        resolve_shard_group_size("node", 4, None)


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "nodes"])
def test_bad_group_sizes_are_refused(value) -> None:
    with pytest.raises(ConfigError, match="shard_group_size must be an int >= 1, 'node' or None"):
        ShardConfig(stage=1, shard_group_size=value)


def shard_with(stage: int, option, local_world_size=None) -> dict:
    """Rank worker: shard with ``shard_group_size=option`` (a list: one value per rank) under the
    given ``LOCAL_WORLD_SIZE``, train one step; the group size used, or the error."""
    torch.set_num_threads(1)
    rank, world = rank_world()
    if isinstance(option, list):
        option = option[rank]
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    try:
        spec = base_spec_for(seed=1)
        torch.manual_seed(1)
        net = build_model(spec)
        model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage,
                                    shard_group_size=option)
    except ConfigError as error:
        return {"error": str(error)}
    finally:
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    ids, targets = batch(spec, 0, 0, world)
    F.cross_entropy(model(ids[rank::world]), targets[rank::world]).backward()
    optimizer.step()
    return {"group": model.shard_group_size, "step_bytes": model.step_stats().bytes_by_group}


def test_node_means_the_launchers_ranks_per_node(rank_pools: RankPoolRegistry) -> None:
    for result in rank_pools.get(4).run(shard_with, 3, "node", 2):
        assert result["group"] == 2 and result["step_bytes"]["inter_group"] > 0, result


def test_stage_0_replicates_everything_whatever_the_group_size(rank_pools: RankPoolRegistry) -> None:
    """Nothing is sharded at stage 0: groups of k would replicate what all ranks replicate, so the
    option is accepted (a script may pass it at every stage) and changes nothing."""
    for result in rank_pools.get(4).run(shard_with, 0, 2):
        assert result["group"] == 4
        assert result["step_bytes"]["inter_group"] == result["step_bytes"]["intra_group"] == 0


def test_group_size_errors_are_raised_on_every_rank(rank_pools: RankPoolRegistry) -> None:
    for result in rank_pools.get(4).run(shard_with, 1, 3):
        assert "shard_group_size=3 does not divide the world size 4" in result["error"]
    # Ranks that disagree (e.g. 'node' on nodes of different sizes) are caught before any group forms.
    for result in rank_pools.get(4).run(shard_with, 1, [2, 2, 4, 4]):
        assert "called shard() differently" in result["error"] and "shard_group_size" in result["error"]
