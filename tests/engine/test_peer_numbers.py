"""Peers' own tests where this engine once gave a silent wrong number, restated on this API.

(issue 39, items 2-4.) Each test names the peer test it restates; where torch's object runs
here (DDP on Gloo) the workers train it side by side on the same data and the test compares.
"""

from __future__ import annotations

import pytest
import torch

from peer_numbers_cases import WithCounts, integer_parameter, reassigned_buffer, zero_gradients_are_stepped
from rank_pool import RankPoolRegistry

pytestmark = pytest.mark.prestart(2, 3)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_integer_parameter_keeps_its_dtype_under_bf16(rank_pools: RankPoolRegistry, stage: int, world: int,
                                                      tmp_path) -> None:
    """FSDP2 keeps an int64 parameter int64 under MixedPrecisionPolicy(bf16, fp32): so here, in the
    forward, in full_state_dict() and state_dict(), and through a checkpoint."""
    counts = list(WithCounts.COUNTS)
    for rank, result in enumerate(rank_pools.get(world).run(integer_parameter,
                                                            {"stage": stage, "path": str(tmp_path / "ckpt")})):
        assert result["seen"] == [(torch.int64, counts)] * 2, f"rank {rank}: the forward read {result['seen']}"
        assert result["full"] == (torch.int64, counts), rank
        assert result["state_dict"] == (torch.int64, counts), rank
        assert result["loaded_seen"] == (torch.int64, counts), rank
        assert result["loaded_full"] == counts, rank


def _assert_same(ours: dict, theirs: dict, what: str) -> None:
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, {key}: {m}")


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("stage,world", [(0, 2), (1, 3), (2, 2), (3, 3), (0, 3), (1, 2), (2, 3), (3, 2)])
def test_zero_gradient_is_stepped_as_torch_steps_it(rank_pools: RankPoolRegistry, stage: int, world: int,
                                                    set_to_none: bool) -> None:
    """FSDP2's test_unused_forward_output: two outputs, the second unused after the first step.
    With zero_grad(set_to_none=False) its layer holds a zero gradient and Adam still moves it (torch on
    one process, DDP(find_unused_parameters=True), FSDP2); with set_to_none=True it is left alone.
    A layer that never had a gradient is never stepped either way."""
    results = rank_pools.get(world).run(zero_gradients_are_stepped,
                                        {"stage": stage, "set_to_none": set_to_none, "steps": 3})
    for rank, result in enumerate(results):
        _assert_same(result["ours"], result["ddp"], f"rank {rank} against DDP")
        _assert_same(result["ours"], result["reference"], f"rank {rank} against one process")
    never = results[0]["reference"]["never.weight"]
    assert torch.equal(results[0]["ours"]["never.weight"], never)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reassigned_buffer_is_the_one_broadcast(rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    """torch DDP's test_ddp_broadcast_buffer: rank 0 re-assigns a buffer before each forward; after each
    backward every rank holds rank 0's current buffer, the values DDP holds."""
    results = rank_pools.get(world).run(reassigned_buffer, {"stage": stage})
    for rank, result in enumerate(results):
        for step, (ours, ddp) in enumerate(zip(result["ours"], result["ddp"])):
            assert torch.equal(ours, results[0]["ours"][step]), f"rank {rank}, step {step}: not rank 0's buffer"
            assert torch.equal(ours, ddp), f"rank {rank}, step {step}: DDP holds {ddp}, this engine {ours}"
        assert torch.equal(result["state"], results[0]["ours"][-1])
