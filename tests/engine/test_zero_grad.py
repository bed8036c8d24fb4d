"""``zero_grad(set_to_none=True)`` frees the engine's gradient storage at every stage.

torch drops ``param.grad`` on ``optimizer.zero_grad()`` (``set_to_none=True`` is its
default) and ``model.zero_grad()``; the engine drops its flat gradient buffers with
it, so ``memory_report().grads`` is 0 until the next backward allocates them again,
and training is bitwise what it is when the storage is kept
(``set_to_none=False``, which keeps it, zeroed). Equivalence with a single-process
reference, with ``optimizer.zero_grad()`` between steps, is tests/engine/test_engine_equivalence.py.
"""

from __future__ import annotations

import pytest
import torch

from rank_pool import RankPoolRegistry
from zero_grad_cases import zero_grad_runs

pytestmark = pytest.mark.prestart(2, 3)


def spec(stage: int, buffer: bool = True, **options) -> dict:
    # bucket_mb=0.0005 (131 floats): several buckets at stages 0-2.
    return dict(seed=0, vocab=11, dim=7, hidden=[5, 13], frozen=False, buffer=buffer, stage=stage,
                optimizer="adam", per_rank_batch=3, bucket_mb=0.0005, steps=3, options=options)


def check(results: list[dict]) -> None:
    for rank, runs in enumerate(results):
        kept = runs["keep"]
        assert all(grads > 0 for grads in kept["after_step"]), rank
        assert kept["after_zero"] == kept["after_step"], f"rank {rank}: set_to_none=False keeps the storage"
        for how in ("optimizer", "model"):
            run = runs[how]
            assert run["after_zero"] == [0] * len(run["after_zero"]), f"rank {rank}, {how}: bytes left"
            assert run["held_after_zero"] == [0] * len(run["held_after_zero"]), f"rank {rank}, {how}"
            assert run["after_step"] == kept["after_step"], f"rank {rank}, {how}: the next backward allocates"
            for key, value in kept["state"].items():
                assert torch.equal(run["state"][key], value), f"rank {rank}, {how}: {key}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_frees_gradients_and_the_next_backward_allocates(
        rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    check(rank_pools.get(world).run(zero_grad_runs, spec(stage)))


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_zero_grad_frees_under_mixed_precision(rank_pools: RankPoolRegistry, stage: int) -> None:
    """bf16 compute, fp32 masters: stage 0 then absorbs gradients instead of adopting them."""
    # buffer=False: the toy model's fp32 shift buffer would meet bf16 activations.
    check(rank_pools.get(2).run(zero_grad_runs, spec(stage, buffer=False, param_dtype="bf16")))
