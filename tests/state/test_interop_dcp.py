"""torch DCP checkpoints in FSDP2's / torchtitan's layout, in and out.

In: FSDP2 (``fully_shard``, CPU, Gloo, N = 2) trains 3 steps, saves
``{"model": get_model_state_dict, "optimizer": get_optimizer_state_dict}`` with
``dcp.save`` (optimizer state nested, and flattened as torchtitan saves it) and trains on to step 6; shardengine loads the folder at N = 1, 2, 3 and
stages 0-3 and trains the same steps 3-5. Out: shardengine (N = 1, 3) trains 3 steps,
``save_dcp_checkpoint``, and trains on; FSDP2 at N = 2 restores model and optimizer with
``dcp.load`` + ``set_model_state_dict`` / ``set_optimizer_state_dict`` and trains on.

Both sides end within 1e-6 of each other: the same fp32 AdamW from the same state on the
same global batches, differing only in the order gradients are summed over 1-3 ranks
(~1e-7 relative, which Adam's scale-invariant update passes on as ~1e-7 of lr per step;
see tests/state/test_interop_deepspeed.py). A run that lost the optimizer state ends
more than 1e-3 away.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import interop_cases as cases
from rank_pool import RankPoolRegistry

pytestmark = pytest.mark.prestart(1, 2, 3)
FIRST, TOTAL = 3, 6


def assert_close(actual: dict, expected: dict, context: str) -> None:
    assert list(actual) == list(expected), context
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=1e-6, msg=lambda m: f"{context}: {key}: {m}")


@pytest.fixture(scope="module", params=[False, True], ids=["nested", "flattened"])
def fsdp2_checkpoint(rank_pools: RankPoolRegistry, request):
    """FSDP2's checkpoint, its optimizer state nested or flattened (torchtitan's ``state.<name>.<key>``)."""
    with tempfile.TemporaryDirectory() as tmp:
        final = rank_pools.get(2).run(cases.fsdp2_save_dcp_and_continue, f"{tmp}/dcp", FIRST, TOTAL,
                                      request.param)[0]
        yield f"{tmp}/dcp", final


@pytest.mark.parametrize("world,stage", [(1, 0), (2, 1), (2, 3), (3, 2), (3, 3)])
def test_shardengine_resumes_fsdp2_dcp(rank_pools: RankPoolRegistry, fsdp2_checkpoint, world: int,
                                       stage: int) -> None:
    path, final = fsdp2_checkpoint
    result = rank_pools.get(world).run(cases.shard_resume, stage, path, "dcp", FIRST, TOTAL)[0]
    assert result["rest"] == []
    assert_close(result["weights"], final, f"FSDP2 N=2 -> shardengine N={world} stage {stage}")


@pytest.mark.parametrize("world,stage", [(1, 2), (3, 3), (2, 0)])
def test_fsdp2_resumes_shardengine_dcp(rank_pools: RankPoolRegistry, world: int, stage: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/dcp"
        final = rank_pools.get(world).run(cases.shard_save_dcp_and_continue, stage, path, FIRST, TOTAL)[0]
        assert os.path.isfile(f"{path}/.metadata")
        result = rank_pools.get(2).run(cases.fsdp2_load_dcp_and_continue, path, FIRST, TOTAL)[0]
    assert result["optimizer_steps"] == [float(FIRST)] and result["step"] == FIRST
    assert_close(result["weights"], final, f"shardengine N={world} stage {stage} -> FSDP2 N=2")


def test_weights_alone_would_fail_the_tolerance(rank_pools: RankPoolRegistry, fsdp2_checkpoint) -> None:
    path, final = fsdp2_checkpoint
    from shardengine.distributed.dcp_files import read_dcp

    state = read_dcp(path)
    state["optimizer"] = {key: value for key, value in state["optimizer"].items()
                          if not key.startswith("state")}  # nested: {"param_groups": ...}; flattened: no state.*
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(state, f"{tmp}/weights_only.pt")
        result = rank_pools.get(2).run(cases.shard_resume, 2, f"{tmp}/weights_only.pt", "pt", FIRST, TOTAL)[0]
    assert max((result["weights"][k] - v).abs().max().item() for k, v in final.items()) > 1e-3
