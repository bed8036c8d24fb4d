"""The disk tier: ``offload_optimizer="disk"`` trains bit for bit like in memory, reports the
bytes of each tier, round-trips checkpoints and refuses bad paths (cases in disk_offload_cases.py)."""

from __future__ import annotations

import os

import pytest
import torch

import shardengine as se
from disk_offload_cases import (checkpoint_round_trip, disk_matches_memory, muon_disk_matches_memory,
                                optimizer_state_round_trip, per_rank_directories, replan_disk_matches_memory,
                                tier_bytes)
from toy_models import Net


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_disk_tier_trains_exactly_like_memory(rank_pools, tmp_path, world, stage):
    assert rank_pools.get(world).run(disk_matches_memory, stage, str(tmp_path), {}) == [[]] * world


@pytest.mark.parametrize("stage, options", [(1, {"offload_optimizer": "disk"}), (3, {"offload_params": "disk"})],
                         ids=["optimizer", "params"])
def test_each_rank_may_use_a_directory_of_its_own(rank_pools, tmp_path, stage, options):
    """A rank's scratch directory is local (DeepSpeed's nvme_path is per node): ranks passing
    different paths agree in shard() (they agree on the tier) and train as in memory."""
    assert rank_pools.get(2).run(per_rank_directories, stage, str(tmp_path), options) == [[]] * 2


def test_ranks_compare_the_tier_not_the_path():
    from shardengine.state.fingerprint import fingerprint

    net = Net(17, 12, [12], residual=True, buffer=False)
    optimizer = torch.optim.Adam(net.parameters())
    entries = [dict(fingerprint(net, optimizer, se.config.ShardConfig(stage=2, **options), 2))
               for options in ({"offload_optimizer": "disk", "offload_path": "/scratch/rank0"},
                               {"offload_optimizer": "disk", "offload_path": "/scratch/rank1"},
                               {"offload_optimizer": True})]
    assert entries[0] == entries[1]
    differ = {key for key in entries[0] if entries[0][key] != entries[2][key]}
    assert differ == {"option offload_optimizer", "option offload_path"}


@pytest.mark.parametrize("stage", [1, 3])
def test_disk_tier_with_mixed_precision(rank_pools, tmp_path, stage):
    bf16 = {"param_dtype": "bf16"}
    assert rank_pools.get(2).run(disk_matches_memory, stage, str(tmp_path), bf16) == [[]] * 2


@pytest.mark.parametrize("stage", [1, 3])
def test_disk_tier_with_a_whole_tensor_optimizer(rank_pools, tmp_path, stage):
    assert rank_pools.get(2).run(muon_disk_matches_memory, stage, str(tmp_path)) == [[]] * 2


@pytest.mark.parametrize("stage", [2, 3])
def test_disk_tier_when_the_trainable_set_grows(rank_pools, tmp_path, stage):
    assert rank_pools.get(2).run(replan_disk_matches_memory, stage, str(tmp_path)) == [[]] * 2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_report_puts_master_and_moments_on_disk(rank_pools, tmp_path, stage):
    for got in rank_pools.get(2).run(tier_bytes, stage, str(tmp_path)):
        assert got["before"]["disk_optimizer_states"] == 4 * got["shard"]  # the fp32 master, no state yet
        assert got["after"]["disk_optimizer_states"] == 4 * got["shard"] + 8 * got["stepped"]  # + Adam's moments
        assert got["after"]["host_optimizer_states"] == 0  # (the reports leave out step counters)
        assert got["after"]["optimizer_states"] == 0
        assert got["files_left"] == []  # every file is unlinked as soon as it is mapped


@pytest.mark.parametrize("after", [
    {"offload_optimizer": "disk"}, {}, {"offload_optimizer": True}, {"stage": 3}, {"stage": 1}],
    ids=["disk", "memory", "host", "to-stage-3", "to-stage-1"])
def test_checkpoints_round_trip_between_tiers(rank_pools, tmp_path, after):
    after = dict(after)
    if after.get("offload_optimizer") == "disk":
        after["offload_path"] = str(tmp_path)
    got = rank_pools.get(2).run(checkpoint_round_trip, 2, str(tmp_path), str(tmp_path / "ckpt"), after)
    assert got == [[]] * 2


def test_checkpoint_from_disk_resumes_at_three_ranks(rank_pools, tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    got = rank_pools.get(3).run(checkpoint_round_trip, 3, str(tmp_path), checkpoint, {"stage": 1})
    assert got == [[]] * 3


def test_optimizer_state_dict_reads_and_writes_the_files(rank_pools, tmp_path):
    assert rank_pools.get(2).run(optimizer_state_round_trip, str(tmp_path)) == [[]] * 2


@pytest.mark.parametrize("options, message", [
    ({"offload_optimizer": "disk"}, "needs offload_path"),
    ({"offload_optimizer": True, "offload_path": "/tmp"}, "only with offload_optimizer=\"disk\""),
    ({"offload_path": "/tmp"}, "only with offload_optimizer=\"disk\""),
    ({"offload_optimizer": "nvme", "offload_path": "/tmp"}, 'True, False or "disk"'),
    ({"offload_optimizer": "disk", "offload_path": "/no/such/dir"}, "not an existing directory"),
    ({"offload_optimizer": "disk", "offload_path": "/tmp", "stage": 0}, "stage >= 1"),
])
def test_bad_disk_options_are_refused(options, message):
    net = Net(17, 12, [12], residual=True, buffer=False)
    with pytest.raises(se.ConfigError, match=message):
        se.shard(net, torch.optim.Adam(net.parameters()), **{"stage": 2, **options})


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
@pytest.mark.parametrize("options", [{"stage": 2, "offload_optimizer": "disk"},
                                     {"stage": 3, "offload_params": "disk"}], ids=["optimizer", "params"])
def test_unwritable_path_is_refused(tmp_path, options):
    tmp_path.chmod(0o500)
    net = Net(17, 12, [12], residual=True, buffer=False)
    with pytest.raises(se.ConfigError, match="not writable"):
        se.shard(net, torch.optim.Adam(net.parameters()), offload_path=str(tmp_path), **options)
