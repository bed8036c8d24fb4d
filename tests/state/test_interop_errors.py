"""Checkpoints from other frameworks that cannot be loaded as asked say why (single process)."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch

import shardengine as se
from shardengine.distributed.dcp_files import read_dcp


def sharded_linear():
    net = torch.nn.Linear(4, 2)
    return se.shard(net, torch.optim.AdamW(net.parameters()), stage=1)


def state_of(groups: list[list[str]]) -> dict:
    source = torch.nn.Linear(4, 2)
    return {"model": source.state_dict(),
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": names} for names in groups]}}


def test_param_groups_that_differ_are_refused_before_anything_changes() -> None:
    model, optimizer = sharded_linear()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(se.errors.CheckpointError, match="same param groups, in the same order"):
        se.interop.load_training_state(model, optimizer, state_of([["bias", "weight"]]))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_state_for_an_unknown_parameter_is_refused() -> None:
    model, optimizer = sharded_linear()
    state = state_of([["weight", "bias"]])
    state["optimizer"]["state"] = {"head.weight": {"step": torch.tensor(1.0)}}
    with pytest.raises(se.errors.CheckpointError, match=r"\['head.weight'\], which are not parameters"):
        se.interop.load_training_state(model, optimizer, state)


def test_a_state_without_model_or_optimizer_entries_is_refused() -> None:
    model, optimizer = sharded_linear()
    with pytest.raises(se.errors.CheckpointError, match=r"no \['optimizer'\] entries"):
        se.interop.load_training_state(model, optimizer, {"model": {}})


def test_a_folder_that_is_not_a_checkpoint_is_named(forked_python) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(se.errors.CheckpointError, match="not a DeepSpeed checkpoint folder"):
            se.interop.deepspeed_training_state(tmp)
        with pytest.raises(se.errors.CheckpointError, match="not a torch.distributed.checkpoint folder"):
            read_dcp(tmp)
        done = subprocess.run([forked_python.python, "-m", "shardengine.convert", tmp, f"{tmp}/out"],
                              env=forked_python.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "not a DeepSpeed checkpoint folder" in done.stderr


def _deepspeed_like_folder(tmp: str, optim_ranks: list[int], optim_value=None) -> str:
    step = os.path.join(tmp, "global_step1")
    os.makedirs(step)
    with open(os.path.join(tmp, "latest"), "w") as f:
        f.write("global_step1")
    torch.save({"module": {}, "param_shapes": [{"w": torch.Size([3])}], "buffer_names": []},
               os.path.join(step, "mp_rank_00_model_states.pt"))
    for rank in optim_ranks:
        torch.save(optim_value if optim_value is not None else {"optimizer_state_dict": {}},
                   os.path.join(step, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    return step


def test_a_missing_rank_file_is_named() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _deepspeed_like_folder(tmp, [0, 2])
        with pytest.raises(se.errors.CheckpointError, match=r"the rank files present are \[0, 2\]"):
            se.interop.deepspeed_training_state(tmp)


class Surprise:
    """An object DeepSpeed never writes: reading it must not unpickle (run) anything."""


def test_a_file_holding_other_objects_is_refused_not_unpickled() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _deepspeed_like_folder(tmp, [0], {"optimizer_state_dict": {"zero_stage": 1, "x": Surprise()}})
        with pytest.raises(se.errors.CheckpointError, match="without running code from it"):
            se.interop.deepspeed_training_state(tmp)


def test_latest_may_not_lead_outside_the_folder() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(f"{tmp}/ckpt")
        _deepspeed_like_folder(tmp, [0])
        with open(f"{tmp}/ckpt/latest", "w") as f:
            f.write("../global_step1")
        with pytest.raises(se.errors.CheckpointError, match="leads outside"):
            se.interop.deepspeed_training_state(f"{tmp}/ckpt")


def test_tensor_parallel_deepspeed_checkpoints_are_refused() -> None:
    """mp_rank_01 holds another slice of every weight: reading mp_rank_00 alone would be half a model."""
    with tempfile.TemporaryDirectory() as tmp:
        step = _deepspeed_like_folder(tmp, [0])
        torch.save({}, os.path.join(step, "mp_rank_01_model_states.pt"))
        with pytest.raises(se.errors.CheckpointError, match="tensor- or pipeline-parallel files"):
            se.interop.deepspeed_training_state(tmp)


def test_weights_of_another_shape_are_refused_before_the_optimizer_is_touched() -> None:
    model, optimizer = sharded_linear()
    state = state_of([["weight", "bias"]])
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    state["model"]["weight"] = torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match=r"weight: \[3, 4\] given, \[2, 4\] in the model"):
        se.interop.load_training_state(model, optimizer, state)
    assert optimizer.param_groups[0]["lr"] != 0.5
