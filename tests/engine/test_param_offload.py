"""Stage 3's parameters on the host (``offload_params=True``): trains bit for bit like resident,
reports each kind's bytes on its tier, round-trips checkpoints, refuses what it cannot run
(cases in param_offload_cases.py)."""

from __future__ import annotations

import pytest
import torch

import shardengine as se
from param_offload_cases import (checkpoint_between_tiers, grown_host_matches_resident, host_matches_resident,
                                 tier_reports)
from toy_models import Net

BF16 = {"param_dtype": "bf16"}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_params_on_the_host_train_exactly_like_resident(rank_pools, world, precision):
    assert rank_pools.get(world).run(host_matches_resident, precision, False) == [[]] * world


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_a_frozen_block_keeps_its_shard_on_the_host(rank_pools, precision):
    assert rank_pools.get(2).run(host_matches_resident, precision, True) == [[]] * 2


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_a_block_unfrozen_after_shard_trains_from_the_host(rank_pools, precision):
    assert rank_pools.get(2).run(grown_host_matches_resident, precision) == [[]] * 2


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_memory_report_moves_every_kind_to_the_host(rank_pools, world, precision):
    for got in rank_pools.get(world).run(tier_reports, precision):
        host, resident = got["host"], got["resident"]
        for kind in ("params", "grads", "optimizer_states"):
            assert host[kind] == 0, kind  # nothing of the model states stays on the device
        # a trained bucket's only parameter shard is its fp32 master: a parameter, as resident
        # fp32's shard is; the optimizer's states are its moments alone (issue 39, item 11)
        assert host["host_params"] == got["frozen_shard"] + got["master_shards"]
        assert host["host_grads"] == resident["grads"] == got["grad_shards"]
        assert host["host_optimizer_states"] == got["moments"]
        if not precision:  # fp32: the same bytes in the same categories as resident
            assert (host["host_params"], host["host_optimizer_states"]) == \
                (resident["params"], resident["optimizer_states"])
        assert host["host_params"] + host["host_optimizer_states"] == \
            resident["params"] + resident["optimizer_states"]


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_checkpoints_round_trip_between_host_and_device(rank_pools, tmp_path, precision):
    assert rank_pools.get(2).run(checkpoint_between_tiers, str(tmp_path / "ckpt"), precision) == [[]] * 2


@pytest.mark.parametrize("options, message", [
    ({"offload_params": True, "stage": 2}, "needs stage=3"),
    ({"offload_params": True, "stage": 1}, "needs stage=3"),
    ({"offload_params": "yes", "stage": 3}, "True, False, \"disk\" or the fraction"),
    ({"offload_params": True, "offload_optimizer": "disk", "offload_path": "/tmp", "stage": 3},
     "offload_optimizer=True"),
])
def test_bad_param_offload_options_are_refused(options, message):
    net = Net(17, 12, [12], residual=True, buffer=False)
    with pytest.raises(se.ConfigError, match=message):
        se.shard(net, torch.optim.Adam(net.parameters()), **options)


def test_offload_params_implies_the_optimizer_on_the_host():
    assert se.Offload(params=True).optimizer is True
    assert se.config.ShardConfig(stage=3, offload_params=True).offload_optimizer is True


def test_auto_stage_chooses_the_parameters_tier_itself():
    net = Net(17, 12, [12], residual=True, buffer=False)
    with pytest.raises(se.ConfigError, match="pass stage=3 with offload_params=True"):
        se.shard(net, torch.optim.Adam(net.parameters()), stage="auto", micro_batch=1, seq_len=4,
                 offload_params=True)


@pytest.mark.parametrize("offload", [{"offload_params": True}, {"offload_params": 0.5}], ids=["all", "half"])
def test_a_whole_tensor_optimizer_steps_on_the_host_like_resident(rank_pools, offload):
    from param_offload_cases import muon_tier_matches_resident

    results = rank_pools.get(2).run(muon_tier_matches_resident, offload)
    assert [differ for differ, _ in results] == [[]] * 2
    on_device = any(device for _, (device, _) in results)
    assert all(host for _, (_, host) in results) and on_device == (offload["offload_params"] is not True), results
