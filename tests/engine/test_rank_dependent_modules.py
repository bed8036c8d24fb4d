"""Ranks that run different modules at stage 3 train exactly as one process (issue 39, item 1).

A rank gathers a unit when its forward calls the unit, so ranks whose forwards call different
units once paired one rank's gather with another's: silently mixed parameters (DeepSpeed's
test_choose_module_by_rank, restated below; FSDP2 does the same, DeepSpeed hangs). Now every
stage-3 collective is agreed on first and the gathers other ranks need are served
(distributed/sequence.py), so these models train as on one process, with the default units
(each ModuleList element a unit) and with wrap_min_params.
"""

from __future__ import annotations

import pytest

from rank_modules_cases import train_rank_dependent
from rank_pool import RankPoolRegistry

pytestmark = pytest.mark.prestart(2, 3)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("options", [{}, {"wrap_min_params": 40}], ids=["default_units", "wrap_min_params"])
@pytest.mark.parametrize("model", ["choose", "experts"])
def test_ranks_running_different_units_train_as_one_process(rank_pools: RankPoolRegistry, model: str,
                                                            options: dict, world: int) -> None:
    """DeepSpeed's test_choose_module_by_rank (rank r runs linears[r % 2]), and a mixture of experts
    routed per token, whose ranks run different experts."""
    results = rank_pools.get(world).run(train_rank_dependent,
                                        {"model": model, "stage": 3, "steps": 3, "options": options})
    assert len(results[0]["units"]) > 2, results[0]["units"]  # the choice is between units
    for rank, result in enumerate(results):
        worst = max(result["errors"].values())
        assert worst < 1e-5, f"rank {rank}: {result['errors']}"
    assert sum(result["served"] for result in results) > 0  # the ranks did run different units


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ranks_running_different_modules_at_stages_0_to_2(rank_pools: RankPoolRegistry, stage: int) -> None:
    """The same models where parameters are whole on every rank: the fixed bucket order pairs them."""
    for model in ("choose", "experts"):
        for rank, result in enumerate(rank_pools.get(2).run(train_rank_dependent,
                                                            {"model": model, "stage": stage, "steps": 2})):
            assert max(result["errors"].values()) < 1e-5, f"{model}, rank {rank}: {result['errors']}"
