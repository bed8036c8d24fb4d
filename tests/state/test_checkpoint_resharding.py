"""Resharding: a checkpoint saved at N ranks and stage s loads at M ranks and stage t.

Property over (N, s, M, t) with N, M in 1..4 and every stage pair. The saving
and the loading run in the session's pools of N and M ranks (the file system
is shared), so no example spawns processes. Checked per example:

* exact re-partitioning: the checkpoint re-saved right after loading at
  (M, t) holds bit-identical values and optimizer state, parameter by
  parameter, to the original saved at (N, s);
* training continues correctly: one more step at (M, t) matches a plain
  single-process model + optimizer continuing from the consolidated state on
  the union of the M ranks' batches (within 2e-4: different summation order).
"""

from __future__ import annotations

import tempfile
from typing import Optional

import pytest
import torch
from hypothesis import given, settings, strategies as st

import checkpoint_cases as cases
from rank_pool import RankPoolRegistry
from shardengine.state.checkpoint.reading import read_manifest
from shardengine.state.checkpoint.index import read_sidecar
from shardengine.state.consolidate import consolidate, consolidated_optimizer_state
from toy_models import make_optimizer

WORLDS = st.integers(min_value=1, max_value=4)


pytestmark = pytest.mark.prestart(1, 2, 3, 4)  # start-ups overlap (conftest.py)

STAGES = st.integers(min_value=0, max_value=3)


def reference_step(ckpt_dir: str, world: int, seed: int) -> dict[str, torch.Tensor]:
    """A plain model and optimizer continuing from the checkpoint, one step on all ranks' batches."""
    net = cases.make_net()
    net.load_state_dict(consolidate(ckpt_dir))
    optimizer = make_optimizer(net, **cases.OPTIMIZER)
    states = consolidated_optimizer_state(ckpt_dir)
    for name, param in net.named_parameters():
        if name in states:
            optimizer.state[param] = states[name]
    batches = [cases.step_batches(seed, rank) for rank in range(world)]
    idx, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    cases.loss_of(net, idx, targets).backward()  # equal batch sizes: mean of the ranks' means
    optimizer.step()
    return net.state_dict()


def assert_close(actual: dict, expected: dict, context: str) -> None:
    assert list(actual) == list(expected), context
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=2e-4, atol=2e-4,
                                   msg=lambda m: f"{context}: {key}: {m}")


@settings(max_examples=14)
@given(saved_world=WORLDS, saved_stage=STAGES, world=WORLDS, stage=STAGES,
       steps=st.integers(min_value=1, max_value=2))
def test_resharded_checkpoint_is_exact_and_trains_on(rank_pools: RankPoolRegistry, saved_world: int,
                                                     saved_stage: int, world: int, stage: int,
                                                     steps: int) -> None:
    check_resharding(rank_pools, saved_world, saved_stage, world, stage, steps)


def check_resharding(rank_pools: RankPoolRegistry, saved_world: int, saved_stage: int, world: int, stage: int,
                     steps: int, saved_options: Optional[dict] = None, options: Optional[dict] = None) -> None:
    """Save at (N, s), load at (M, t) (``options`` to ``shard()`` on each side); see the module doc."""
    saved_options, options = saved_options or {}, options or {}
    context = (f"saved at N={saved_world} stage {saved_stage} {saved_options}, loaded at M={world} "
               f"stage {stage} {options}")
    with tempfile.TemporaryDirectory() as tmp:
        original, resaved = f"{tmp}/original", f"{tmp}/resaved"
        rank_pools.get(saved_world).run(cases.train_and_save, saved_stage, original, steps, **saved_options)
        results = rank_pools.get(world).run(cases.load_resave_and_step, stage, original, resaved, steps,
                                            **options)
        assert all(r["extra"] == {"step": steps} for r in results), context
        for checkpoint in (original, resaved):  # every element saved once (replica groups write nothing)
            step_dir = f"{checkpoint}/step_{steps}"
            sidecars = [read_sidecar(step_dir, rank) for rank in range(read_manifest(step_dir)["rank_files"])]
            saved = [(name, start, end) for sidecar in sidecars for name, start, end in sidecar["index"]]
            assert len(saved) == len(set(saved)), context
        assert cases.same(consolidate(resaved), consolidate(original)), context
        assert cases.same(consolidated_optimizer_state(resaved),
                          consolidated_optimizer_state(original)), context
        assert_close(results[0]["after_step"], reference_step(original, world, steps), context)


def test_every_stage_pair_at_two_to_three_ranks(rank_pools: RankPoolRegistry) -> None:
    """The explicit corners the property may not draw: each s -> t once, N=2 -> M=3 and back."""
    for saved_stage in range(4):
        for stage in range(4):
            saved_world, world = (2, 3) if (saved_stage + stage) % 2 else (3, 2)
            test_resharded_checkpoint_is_exact_and_trains_on.hypothesis.inner_test(
                rank_pools, saved_world, saved_stage, world, stage, 2)


@pytest.mark.parametrize("saved,loaded", [((4, 3, 2), (2, 1, None)), ((2, 2, None), (4, 1, 2)), ((4, 2, 2), (4, 3, 1))],
                         ids=["hybrid-to-plain", "plain-to-hybrid", "hybrid-to-hybrid"])
def test_hybrid_sharding_checkpoints_reshard(rank_pools: RankPoolRegistry, saved: tuple, loaded: tuple) -> None:
    """(world, stage, shard_group_size) on each side: hybrid layouts save and load like any other."""
    (saved_world, saved_stage, saved_k), (world, stage, k) = saved, loaded
    check_resharding(rank_pools, saved_world, saved_stage, world, stage, 2,
                     {"shard_group_size": saved_k}, {"shard_group_size": k})


def test_bf16_checkpoint_resumes_in_fp32_on_another_layout(rank_pools: RankPoolRegistry) -> None:
    """The fp32 masters are what travels: precision is a property of the run, not the checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        original, resaved = f"{tmp}/original", f"{tmp}/resaved"
        rank_pools.get(2).run(cases.train_and_save, 1, original, 2, param_dtype="bf16")
        results = rank_pools.get(3).run(cases.load_resave_and_step, 3, original, resaved, 2)
        assert cases.same(consolidated_optimizer_state(resaved), consolidated_optimizer_state(original))
        trained = {k: v for k, v in consolidate(original).items() if k != "blocks.0.bias"}  # frozen: bf16
        assert all(v.dtype == torch.float32 for v in trained.values())
        assert cases.same({k: consolidate(resaved)[k] for k in trained}, trained)
        assert_close(results[0]["after_step"], reference_step(original, 3, 2), "bf16 (2, 1) -> fp32 (3, 3)")


@pytest.mark.parametrize("saved,loaded", [((2, 3, {"offload_params": 0.5}), (3, 3, {"offload_params": True})),
                                          ((3, 3, {"offload_device_budget": "1KiB"}), (2, 3, {"offload_params": 0.5})),
                                          ((2, 3, {"offload_params": 0.5}), (3, 1, {}))],
                         ids=["half-to-all", "budget-to-half", "half-to-stage-1"])
def test_parameters_partly_on_the_host_reshard_across_tiers_and_world_sizes(rank_pools: RankPoolRegistry,
                                                                            saved: tuple, loaded: tuple) -> None:
    """(world, stage, offload) on each side: which units lived on the host is not in the checkpoint."""
    (saved_world, saved_stage, saved_options), (world, stage, options) = saved, loaded
    check_resharding(rank_pools, saved_world, saved_stage, world, stage, 2, saved_options, options)
