"""A fraction or a device budget of stage 3's parameters on the host: the units it moves,
training bit for bit like resident, each tier's bytes in ``memory_report()``, checkpoints
across tiers, and the options refused (cases in partial_offload_cases.py)."""

from __future__ import annotations

import pytest
import torch

import shardengine as se
from param_offload_cases import grown_host_matches_resident, host_matches_resident
from partial_offload_cases import (HALF, budget_reports, checkpoint_across_fractions, choice_problems,
                                   partial_reports)
from toy_models import Net

BF16 = {"param_dtype": "bf16"}
KINDS = ("params", "grads", "optimizer_states")


@pytest.mark.parametrize("fraction", [0.3, 0.5])
def test_the_units_nearest_the_turn_stay_resident(rank_pools, fraction):
    assert rank_pools.get(2).run(choice_problems, fraction) == [[]] * 2


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_half_on_the_host_trains_exactly_like_resident(rank_pools, world, precision):
    assert rank_pools.get(world).run(host_matches_resident, precision, False, HALF) == [[]] * world


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_half_on_the_host_with_a_frozen_block_and_a_block_unfrozen_later(rank_pools, precision):
    assert rank_pools.get(2).run(host_matches_resident, precision, True, HALF) == [[]] * 2
    assert rank_pools.get(2).run(grown_host_matches_resident, precision, HALF) == [[]] * 2


def test_a_device_budget_trains_exactly_like_resident(rank_pools):
    budget = {"offload_device_budget": "3KiB"}
    assert rank_pools.get(3).run(host_matches_resident, BF16, True, budget) == [[]] * 3


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_memory_report_splits_each_kind_between_the_tiers(rank_pools, precision):
    for got in rank_pools.get(2).run(partial_reports, precision):
        report, counted, resident = got["report"], got["counted"], got["resident"]
        for kind in KINDS:
            assert report[kind] == counted["device"][kind], kind
            assert report[f"host_{kind}"] == counted["host"][kind], kind
        assert report["optimizer_states"] and report["host_optimizer_states"]  # both tiers in use
        assert report["grads"] and report["host_grads"]
        assert report["grads"] + report["host_grads"] == resident["grads"]
        # a moved trained bucket's shard is its fp32 master, under host params (as resident
        # fp32's shard is under params); the optimizer's states are its moments
        both = sum(report[k] + report[f"host_{k}"] for k in ("params", "optimizer_states"))
        assert both == resident["params"] + resident["optimizer_states"]


def test_a_device_budget_bounds_the_resident_states(rank_pools):
    # the plan's units cost about 3.0 (the root), 4.5, 0.6 (frozen) and 4.5 KB in turn order
    for got in rank_pools.get(2).run(budget_reports, ["1GiB", 7500, 3000, 0]):
        everything, middle, tighter, none = got["runs"]
        resident, host = got["resident"], got["host"]
        assert everything["moved"] == 0 and everything["report"] == resident
        assert none["report"] == host  # no room: every unit as with offload_params=True
        assert 0 < middle["moved"] < tighter["moved"] < middle["units"]
        for run, budget in ((middle, 7500), (tighter, 3000)):
            device = sum(run["report"][kind] for kind in KINDS)
            assert 0 < device <= budget
            assert sum(run["report"][f"host_{kind}"] for kind in KINDS) > 0


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_checkpoints_round_trip_between_a_fraction_and_either_tier(rank_pools, tmp_path, precision):
    assert rank_pools.get(2).run(checkpoint_across_fractions, str(tmp_path / "ckpt"), precision) == [[]] * 2


class SubclassedAdam(torch.optim.Adam):
    pass


def _shard(optimizer=torch.optim.Adam, **options):
    net = Net(17, 12, [12], residual=True, buffer=False)
    return se.shard(net, optimizer(net.parameters()), **options)


@pytest.mark.parametrize("options, message", [
    ({"offload_params": 0.0}, "for none pass False"),
    ({"offload_params": -0.5}, "a number > 0 and <= 1"),
    ({"offload_params": 1.5}, "a number > 0 and <= 1"),
    ({"offload_params": float("nan")}, "a number > 0 and <= 1"),
    ({"offload_device_budget": -1}, "bytes >= 0"),
    ({"offload_device_budget": "8 parsecs"}, "like '8GiB'"),
    ({"offload_device_budget": True}, "bytes >= 0"),
    ({"offload_params": 0.5, "offload_device_budget": "1GiB"}, "not both"),
    ({"offload_params": True, "offload_device_budget": 0}, "not both"),
    ({"offload_params": 0.5, "stage": 2}, "needs stage=3"),
    ({"offload_device_budget": "1GiB", "stage": 1}, "needs stage=3"),
    ({"offload_params": 0.5, "offload_optimizer": "disk", "offload_path": "/tmp"}, "moves into files"),
    ({"offload_device_budget": 10, "offload_optimizer": "disk", "offload_path": "/tmp"}, "moves into files"),
    ({"offload_params": 0.5, "step_in_backward": True}, "cannot be combined with step_in_backward"),
])
def test_bad_fractions_and_budgets_are_refused(options, message):
    with pytest.raises(se.ConfigError, match=message):
        _shard(**{"stage": 3, **options})


def test_a_budget_needs_an_optimizer_whose_state_is_known():
    with pytest.raises(se.ConfigError, match="SubclassedAdam is not one of them.*offload_params=0.5"):
        _shard(SubclassedAdam, stage=3, offload_device_budget="1MiB", allow_unknown_optimizer=True)


def test_a_fraction_or_budget_is_refused_with_the_auto_stage():
    for options in ({"offload_params": 0.5}, {"offload_device_budget": "1GiB"}):
        with pytest.raises(se.ConfigError, match="offload_device_budget"):
            _shard(stage="auto", micro_batch=1, seq_len=4, **options)


def test_whole_and_empty_fractions_are_the_booleans():
    assert se.Offload(params=1.0).params is True and se.Offload(params=1).optimizer is True
    half = se.config.ShardConfig(stage=3, offload_params=0.5, offload_optimizer=False)
    assert half.offload_params == 0.5 and half.offload_optimizer is False  # resident units as without offload
    assert se.config.ShardConfig(stage=3, offload_device_budget="1.5KiB").offload_device_budget == 1536
