"""stage="auto" runs the activation levers it picks, and the run stays within the budget it planned.

NEEDS THE ENGINE'S ACTIVATION LEVERS (shard(activation_checkpointing=..., activation_offload=...),
branch ``act``): skipped until shard() takes them. The choices themselves are tested without
the engine in tests/estimator/test_estimator_auto_plan.py, on the same cases (auto_cases.py):
an 8-layer GPT at sequence 2048 on 2 CPU ranks, at the budget where nothing with fewer levers
fits (checkpointing; activation offload; both with parameters on the host). Each rank takes
one step; on CPU the device is host RAM, so what the run holds (its model states before the
step, host tiers included, plus what the step allocates, as the allocator reports it) must
stay within what the plan promised: its device budget plus its host bytes per rank.
"""
from __future__ import annotations

import pytest

from auto_cases import auto_step, lever_budgets, long_context_candidates, on_host
from shardengine.config import known_options

pytestmark = pytest.mark.skipif("activation_checkpointing" not in known_options(),
                                reason="needs the engine's activation levers (branch act)")


@pytest.fixture(scope="module")
def budgets():
    return lever_budgets(long_context_candidates()[1])


def check(results: list[dict]) -> dict:
    first = results[0]
    assert all({k: r[k] for k in ("checkpointing", "activation_offload", "plan")}
               == {k: first[k] for k in ("checkpointing", "activation_offload", "plan")} for r in results)
    for result in results:
        assert result["applied"] == (result["checkpointing"], result["activation_offload"]), result
        assert result["held"] <= result["promised"], result
    return first


def test_auto_checkpoints_where_nothing_without_it_fits_and_stays_within_its_budget(rank_pools, budgets):
    chosen = check(rank_pools.get(2).run(auto_step, budgets["checkpointing"]))
    assert chosen["checkpointing"] != "none"


def test_auto_offloads_activations_where_nothing_without_it_fits_and_stays_within_its_budget(rank_pools, budgets):
    chosen = check(rank_pools.get(2).run(auto_step, budgets["offload"]))
    assert chosen["activation_offload"]


def test_auto_checkpoints_offloads_and_moves_parameters_at_the_tightest_budget(rank_pools, budgets):
    chosen = check(rank_pools.get(2).run(auto_step, budgets["all"]))
    assert chosen["checkpointing"] != "none" and chosen["activation_offload"] and on_host(chosen["plan"])
