"""Gradient accumulation as users write it, at every stage, against one process on the global batch.

Accumulation by repeated ``loss.backward()`` (with and without ``no_sync``), with
clipping, mixed precision and uneven per-rank batch sizes; and forwards and
backwards in any order (FairScale's fwd-fwd-bwd-bwd, backwards reversed, an
evaluation forward or a dropped forward in between): each backward must count
with the batch weight of its own forward. Workers: ``accumulation_cases.py``.
"""

from __future__ import annotations

import pytest

from accumulation_cases import train_accumulating
from engine_cases import check_equivalence
from rank_pool import RankPoolRegistry

STAGES = [0, 1, 2, 3]


def uneven_sizes(world: int, steps: int = 2) -> list:
    """Per step, three micro-batches whose per-rank sizes differ (rank order)."""
    micro = [[3 + r for r in range(world)], [2] * world, [4 - r for r in range(world)]]
    return [micro] * steps


def spec_for(world: int, **overrides) -> dict:
    spec = dict(seed=0, vocab=11, dim=7, hidden=[5, 3], optimizer="sgd", stage=0,
                order="interleaved", no_sync=False, max_norm=None, sizes=uneven_sizes(world))
    spec.update(overrides)
    return spec


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("no_sync", [False, True], ids=["repeated_backward", "no_sync"])
@pytest.mark.parametrize("max_norm", [None, 0.5], ids=["no_clip", "clip"])
def test_accumulation_by_repeated_backward(rank_pools: RankPoolRegistry, world: int, stage: int,
                                           no_sync: bool, max_norm) -> None:
    """Three micro-batches, ``loss.backward()`` on each, then clip and step."""
    spec = spec_for(world, stage=stage, no_sync=no_sync, max_norm=max_norm)
    check_equivalence(rank_pools.get(world).run(train_accumulating, spec))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("order", ["fwd_fwd_bwd_bwd", "reversed", "auxiliary"])
@pytest.mark.parametrize("no_sync", [False, True], ids=["repeated_backward", "no_sync"])
def test_each_backward_counts_with_its_own_forward(rank_pools: RankPoolRegistry, world: int, stage: int,
                                                   order: str, no_sync: bool) -> None:
    spec = spec_for(world, stage=stage, order=order, no_sync=no_sync)
    check_equivalence(rank_pools.get(world).run(train_accumulating, spec))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("when", ["before", "after"])
def test_batch_weight_set_before_or_after_its_forward(rank_pools: RankPoolRegistry, world: int,
                                                      stage: int, when: str) -> None:
    """Padding-masked losses, weights from ``set_batch_weight``, forwards before backwards."""
    spec = spec_for(world, stage=stage, order="fwd_fwd_bwd_bwd", no_sync=True, set_weight=when,
                    max_norm=0.5)
    check_equivalence(rank_pools.get(world).run(train_accumulating, spec))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dtype, reduce, tol", [("bf16", None, 2e-3), ("fp16", None, 5e-4), ("bf16", "fp32", 2e-3)],
                         ids=["bf16", "fp16", "bf16-reduced-in-fp32"])
def test_accumulation_under_mixed_precision(rank_pools: RankPoolRegistry, world: int, stage: int,
                                            dtype: str, reduce, tol: float) -> None:
    """Repeated backward, forwards first, clipping; 16-bit compute against the fp32 reference
    (reduced in fp32: the 16-bit gradients wait for their bucket's reduction at stages 2-3)."""
    options = {"param_dtype": dtype, **({"reduce_dtype": reduce} if reduce else {})}
    spec = spec_for(world, stage=stage, order="fwd_fwd_bwd_bwd", max_norm=0.5, buffer=False, options=options)
    check_equivalence(rank_pools.get(world).run(train_accumulating, spec), tol=tol, norm_tol=tol)
