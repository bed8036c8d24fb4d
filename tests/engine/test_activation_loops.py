"""Activation policies under the loops users write besides one forward and one backward.

Several forwards before their backwards (each checkpointed block and each offloaded block
keeps its own forward's tensors), one graph backpropagated twice with ``retain_graph=True``
(offload's host copies must survive the first backward; checkpointing recomputes twice) and
accumulation that reduces every micro-step (no ``no_sync()``): each trains exactly as the same
loop without the policy (activation_loop_cases.py), at N = 2 and 3, diagonally over stages.
(Selective checkpointing under ``retain_graph=True`` is refused by torch's own selective
checkpoint at the second backward: docs/activations.md says so.)
"""
from __future__ import annotations

import pytest

from activation_loop_cases import loop_with_and_without
from rank_pool import RankPoolRegistry

OFFLOAD_AND_FULL = {"activation_checkpointing": "full", "activation_offload": True}
CASES = [  # (world, stage, loop, policy)
    (2, 3, "forwards_then_backwards", OFFLOAD_AND_FULL),
    (3, 0, "forwards_then_backwards", {"activation_offload": True}),
    (2, 0, "retain_graph", OFFLOAD_AND_FULL),
    (3, 3, "retain_graph", {"activation_checkpointing": "every-k:2", "activation_offload": True}),
    (2, 2, "accumulate_without_no_sync", {"activation_checkpointing": "every-k:2", "activation_offload": True}),
    (3, 1, "accumulate_without_no_sync", {"activation_offload": True}),
]


@pytest.mark.parametrize("world,stage,loop,policy", CASES,
                         ids=[f"N{w}-s{s}-{loop}-{len(p)}" for w, s, loop, p in CASES])
def test_a_policy_trains_like_the_same_loop_without_it(rank_pools: RankPoolRegistry, world: int, stage: int,
                                                      loop: str, policy: dict) -> None:
    results = rank_pools.get(world).run(loop_with_and_without, {"stage": stage, "loop": loop, "policy": policy})
    for rank, result in enumerate(results):
        bad = {key: error for key, error in result["errors"].items() if not error <= 1e-6}
        assert not bad, f"rank {rank}: parameters differ from the same loop without the policy: {bad}"
        plain, policed = result["losses"]
        assert policed == pytest.approx(plain, rel=1e-6, abs=1e-7)
        assert all(host > 0 for host in result["hosts"]), result["hosts"]  # offload did move tensors
