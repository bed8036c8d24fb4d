"""Stage 3's parameters on disk (``offload_params="disk"``): trains bit for bit like in memory,
holds only the units in flight, reports each kind's bytes on its tier, round-trips checkpoints,
leaves no file behind and refuses what it cannot run (cases in disk_params_cases.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import shardengine as se
from disk_offload_cases import muon_disk_matches_memory
from disk_params_cases import (checkpoint_between_tiers, disk_matches_memory, grown_disk_matches_memory, residency,
                               resumed_in_memory, tier_reports)
from rank_pool import run_local, scripts_pythonpath
from toy_models import Net

HERE = os.path.dirname(os.path.abspath(__file__))

BF16 = {"param_dtype": "bf16"}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_params_on_disk_train_exactly_like_memory(rank_pools, tmp_path, world, precision):
    assert rank_pools.get(world).run(disk_matches_memory, str(tmp_path), precision, False) == [[]] * world


def test_a_frozen_block_keeps_its_shard_in_a_file(rank_pools, tmp_path):
    assert rank_pools.get(2).run(disk_matches_memory, str(tmp_path), BF16, True) == [[]] * 2


def test_a_whole_tensor_optimizer_trains_from_the_files(rank_pools, tmp_path):
    assert rank_pools.get(2).run(muon_disk_matches_memory, 3, str(tmp_path), True) == [[]] * 2


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_a_block_unfrozen_after_shard_trains_from_its_file(rank_pools, tmp_path, precision):
    assert rank_pools.get(2).run(grown_disk_matches_memory, str(tmp_path), precision) == [[]] * 2


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_memory_report_puts_the_shards_in_files(rank_pools, tmp_path, precision):
    for got in rank_pools.get(2).run(tier_reports, str(tmp_path), precision):
        disk, host = got["disk"], got["host"]
        for kind in ("params", "grads", "optimizer_states", "host_params", "host_optimizer_states"):
            assert disk[kind] == 0, kind  # (the reports leave out Adam's step counters)
        # a trained bucket's only parameter shard is its master: a parameter, in a file
        assert disk["disk_params"] == got["frozen_shard"] + got["master_shards"] == host["host_params"]
        assert disk["disk_optimizer_states"] == host["host_optimizer_states"]  # the moments
        assert disk["host_grads"] == host["host_grads"]  # reduced gradients wait on the host
        assert got["files_left"] == []  # every file is unlinked as soon as it is mapped


def test_host_memory_holds_only_the_units_in_flight(rank_pools, tmp_path):
    for got in rank_pools.get(2).run(residency, str(tmp_path), BF16):
        page = 4096
        assert got["after"] == [0] * 4  # after shard() and after every step: all written and dropped
        # at any unit's forward or backward: the one unit read ahead (each file rounds up to pages)
        largest = max(got["units"]) + 2 * page * 2  # two buckets a unit, each its file's last page
        assert max(got["samples"]) <= largest, (got["samples"], got["units"])
        assert max(got["samples"]) > 0  # the read-ahead does read
        assert got["in_files"] >= 5 * max(got["units"])  # ... out of far more on disk


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
def test_checkpoints_round_trip_between_disk_and_memory(rank_pools, tmp_path, precision):
    got = rank_pools.get(2).run(checkpoint_between_tiers, str(tmp_path), str(tmp_path / "ckpt"), precision)
    assert got == [[]] * 2


@pytest.mark.parametrize("point", ["forward", "step"])
def test_a_killed_run_leaves_nothing_but_its_checkpoint(tmp_path, point):
    """SIGKILLed while a shard is read ahead, or between the step's write-behinds: no file is
    left under the path, and the last checkpoint resumes in memory with the weights it saved."""
    files, checkpoint, record = tmp_path / "files", str(tmp_path / "ckpt"), str(tmp_path / "saved.pt")
    files.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": scripts_pythonpath(os.environ.get("PYTHONPATH", ""))}
    done = subprocess.run([sys.executable, os.path.join(HERE, "disk_params_crash.py"), str(files), checkpoint,
                           record, point], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    assert os.listdir(files) == []  # every file was unlinked when it was made: the kernel freed them
    assert run_local(resumed_in_memory, checkpoint, record) == [[]]


@pytest.mark.parametrize("options, message", [
    ({"stage": 2}, 'needs stage=3.*at stages 1-2 use offload_optimizer="disk"'),
    ({"stage": 1}, "needs stage=3"),
    ({"stage": 3, "offload_path": None}, 'offload_params="disk" needs offload_path'),
    ({"stage": 3, "offload_optimizer": True}, 'use offload_optimizer="disk"'),
    ({"stage": 3, "offload_path": "/no/such/dir"}, "not an existing directory"),
    ({"stage": 3, "offload_params": "nvme"}, 'True, False, "disk" or the fraction'),
    ({"stage": 3, "offload_device_budget": "1KiB"}, "offload_params='disk' or offload_device_budget=1024, not both"),
])
def test_bad_disk_param_options_are_refused(tmp_path, options, message):
    net = Net(17, 12, [12], residual=True, buffer=False)
    options = {"offload_params": "disk", "offload_path": str(tmp_path), **options}
    with pytest.raises(se.ConfigError, match=message):
        se.shard(net, torch.optim.Adam(net.parameters()), **options)


def test_offload_params_on_disk_implies_the_optimizer_on_disk(tmp_path):
    assert se.Offload(params="disk", path=str(tmp_path)).optimizer == "disk"
    assert se.config.ShardConfig(stage=3, offload_params="disk", offload_path=str(tmp_path)).offload_optimizer == "disk"
