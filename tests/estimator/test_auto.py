"""stage="auto": the estimator's recommendation, taken by every rank alike."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import shardengine as se
from memory_estimator import estimate

WIDTH, DEPTH = 256, 8


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))  # stage-3 units

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def build() -> nn.Module:
    torch.manual_seed(0)
    return Stack()


def inputs(micro_batch: int, seq_len: int) -> torch.Tensor:
    return torch.randn(micro_batch, seq_len, WIDTH)


def budget_for_zero3(world: int) -> int:
    """A memory budget (CPU: no CUDA context) in which only the stage-3 plans fit."""
    net = build()
    result = estimate(module=net, example_inputs=inputs, world_size=world, precision="fp32",
                      optimizer=torch.optim.Adam(net.parameters()), micro_batch=2, seq_len=4,
                      device="cpu", device_memory_bytes=10**12)
    totals = {plan.name: plan.total for plan in result.plans}
    smallest_unsharded = min(totals["ddp"], totals["zero1"], totals["zero2"])
    assert totals["zero3"] < smallest_unsharded
    margin = result.setup.safety_margin
    return int((totals["zero3"] + smallest_unsharded) / 2 / (1 - margin))


def auto_stage(budget: int, shard_group_size=None) -> int:
    net = build()
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters()), stage="auto",
                                micro_batch=2, seq_len=4, example_inputs=inputs,
                                memory_budget_bytes=budget, shard_group_size=shard_group_size)
    model(inputs(2, 4)).sum().backward()
    optimizer.step()
    return model.stage if shard_group_size is None else (model.stage, model.shard_group_size)


def test_auto_picks_the_least_sharded_plan_that_fits_on_every_rank(rank_pools):
    assert rank_pools.get(2).run(auto_stage, budget_for_zero3(2)) == [3, 3]


def test_auto_plans_hybrid_sharding_over_the_group(rank_pools):
    """4 ranks in groups of 2 hold what 2 ranks of plain sharding hold: the budget in which only
    stage 3 fits on 2 ranks gives hybrid stage 3 (sharded over all 4 ranks, stage 1 would fit)."""
    assert rank_pools.get(4).run(auto_stage, budget_for_zero3(2), 2) == [(3, 2)] * 4


def auto_plan_without_resharding(budget: int) -> tuple[int, bool]:
    net = build()
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters()), stage="auto", micro_batch=2, seq_len=4,
                                example_inputs=inputs, memory_budget_bytes=budget, reshard_after_forward=False)
    model(inputs(2, 4)).sum().backward()
    optimizer.step()
    return model.stage, model.engine.config.offload_optimizer


def test_auto_plans_stage_3_without_resharding_on_its_own_peak(rank_pools):
    """reshard_after_forward=False keeps every unit gathered through forward: in the budget where
    stage 3 fits when it reshards, it does not (nor does stage 2), so auto offloads the optimizer."""
    budget = budget_for_zero3(2)
    assert rank_pools.get(2).run(auto_plan_without_resharding, budget) == [(3, True)] * 2


def test_auto_without_process_group_chooses_ddp_when_memory_is_plenty():
    assert auto_stage(10**12) == 0


def test_auto_says_what_would_fit_when_nothing_does():
    net = build()
    with pytest.raises(se.ConfigError, match="no plan fits .* What would fit"):
        se.shard(net, torch.optim.Adam(net.parameters()), stage="auto", micro_batch=2, seq_len=4,
                 example_inputs=inputs, memory_budget_bytes=1000)


def test_auto_needs_the_batch_shape():
    net = build()
    with pytest.raises(se.ConfigError, match="micro_batch"):
        se.shard(net, torch.optim.Adam(net.parameters()), stage="auto")


def test_a_toy_budget_is_said_in_the_unit_that_shows_it():
    net = build()
    with pytest.raises(se.ConfigError, match=r"no plan fits in 1000 B per rank \(ddp \d+\.\d\d [KM]iB"):
        se.shard(net, torch.optim.Adam(net.parameters()), stage="auto", micro_batch=2, seq_len=4,
                 example_inputs=inputs, memory_budget_bytes=1000)


@pytest.mark.parametrize("stage", ["auto", 2])
def test_a_budget_below_one_byte_is_refused_by_name(stage):
    net = build()
    with pytest.raises(se.ConfigError, match=re.escape("memory_budget_bytes is a number of bytes, at least 1, got 0.5")):
        se.shard(net, torch.optim.Adam(net.parameters()), stage=stage, micro_batch=2, seq_len=4,
                 memory_budget_bytes=0.5)


def test_every_plan_the_estimator_gives_shardengine_is_one_auto_can_run():
    """stage='auto' takes the planner's pick among shardengine's plans (its fractions and device
    budgets too): each maps to a stage and the tiers the engine runs it with."""
    from memory_estimator.engines import make_engine
    from memory_estimator.plan.auto_plan import shard_options
    from memory_estimator.plan.search import PlannedRun
    from memory_estimator.terms.model_states import partial_plan

    plans = list(make_engine("shardengine").plans) + [partial_plan(0.25), partial_plan(budget=2**20)]
    assert any(plan.offload_params for plan in plans)
    for plan in plans:
        options = shard_options(PlannedRun(plan.name, plan.stage, plan.offload, 1, "none", 1, 1, 1.0, 1.0, 0))
        config = se.config.ShardConfig(stage=options["stage"], offload_optimizer=options["offload_optimizer"],
                                offload_params=options["offload_params"],
                                offload_device_budget=options["device_budget"])
        assert config.stage == plan.stage, plan.name
        assert config.offload_params == (1.0 if plan.offload_params else (plan.params_fraction or False)) \
            or config.offload_params is True, plan.name
        assert bool(config.offload_optimizer) == plan.offload or plan.partial_params, plan.name


def budget_between_host_and_optimizer_offload(world: int) -> int:
    """A memory budget in which the optimizer's offload does not fit but every parameter on the
    host leaves room: most of the way from zero3-offload-params to zero3-offload."""
    net = build()
    result = estimate(module=net, example_inputs=inputs, world_size=world, precision="fp32",
                      optimizer=torch.optim.Adam(net.parameters()), micro_batch=2, seq_len=4,
                      device="cpu", device_memory_bytes=10**12)
    totals = {plan.name: plan.total for plan in result.plans}
    low, high = totals["zero3-offload-params"], totals["zero3-offload"]
    assert low < high
    return int((low + 0.8 * (high - low)) / (1 - result.setup.safety_margin))


def auto_device_budget(budget: int) -> tuple:
    net = build()
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters()), stage="auto",
                                micro_batch=2, seq_len=4, example_inputs=inputs, memory_budget_bytes=budget)
    model(inputs(2, 4)).sum().backward()
    optimizer.step()
    report = model.memory_report()
    # fp32: a shard is its own master, counted with the optimizer's state on its tier
    return (model.stage, model.engine.config.offload_device_budget, report.optimizer_states > 0,
            report.host_optimizer_states > 0)


def test_auto_keeps_on_the_device_the_units_that_fit_when_parameters_must_go_to_the_host(rank_pools):
    """Where only parameter offload fits, stage='auto' keeps as many units resident as the
    estimator says fit (a device budget), not none: some shards on each tier."""
    results = rank_pools.get(2).run(auto_device_budget, budget_between_host_and_optimizer_offload(2))
    assert results[0] == results[1]
    stage, device_budget, resident, on_host = results[0]
    assert stage == 3 and device_budget > 0 and resident and on_host, results


def broken_inputs(micro_batch: int, seq_len: int) -> torch.Tensor:
    raise ValueError("no such dataset")


def auto_with_broken_inputs() -> str:
    net = build()
    try:
        se.shard(net, torch.optim.Adam(net.parameters()), stage="auto", micro_batch=2, seq_len=4,
                 example_inputs=broken_inputs)
    except Exception as error:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_an_estimate_failing_on_rank_0_fails_every_rank_instead_of_hanging(rank_pools):
    """Rank 0 estimates alone; when that raises, the other ranks get its error, not a wait."""
    rank0, rank1 = rank_pools.get(2).run(auto_with_broken_inputs, timeout=60)
    # one error type on every rank: `except se.ConfigError` catches it wherever it runs
    assert rank0 == rank1 and rank1.startswith("ConfigError") and "no such dataset" in rank1, (rank0, rank1)


def test_auto_builds_the_inputs_an_embedding_implies_and_its_run_stays_within_its_budget(rank_pools):
    """No example_inputs: the GPT's first layer is an embedding, so auto traces token ids. At a
    budget where only offloading plans fit without activation levers, the step holds no more
    than the plan promised (tests/engine/test_auto_activation_levers.py: the same with them)."""
    from auto_cases import auto_step, floor, long_context_candidates, on_host

    candidates = long_context_candidates()[1]
    plain = [run for run in candidates if run.checkpointing == "none" and not run.activation_offload]
    offloads = lambda run: run.offload or on_host(run.plan)  # noqa: E731
    budget = int((floor(plain, offloads) + floor(plain, lambda run: not offloads(run))) / 2 / 0.9)
    results = rank_pools.get(2).run(auto_step, budget)
    assert results[0]["plan"] == results[1]["plan"] and offloads_plan(results[0]["plan"])
    for result in results:
        assert result["held"] <= result["promised"], result


def offloads_plan(name: str) -> bool:
    from memory_estimator.terms.model_states import plan_spec

    return plan_spec(name).offload or plan_spec(name).partial_params


def split_batch(budget: int) -> tuple:
    net = build()
    model, _ = se.shard(net, torch.optim.Adam(net.parameters()), stage="auto", micro_batch=4, seq_len=4,
                        example_inputs=inputs, memory_budget_bytes=budget)
    return model.auto_plan.micro_batch, model.auto_plan.grad_accum, model.stage


def test_auto_splits_the_batch_into_micro_steps_and_says_so_on_the_model():
    """Where the whole batch fits no plan but half of it does, auto keeps the batch per step as
    micro-batch x accumulation; shard() cannot change the loop, so model.auto_plan says it."""
    net = build()
    result = estimate(module=net, example_inputs=inputs, world_size=1, precision="fp32",
                      optimizer=torch.optim.Adam(net.parameters()), micro_batch=4, seq_len=4,
                      device="cpu", device_memory_bytes=10**12)
    halved = estimate(module=net, example_inputs=inputs, world_size=1, precision="fp32",
                      optimizer=torch.optim.Adam(net.parameters()), micro_batch=2, seq_len=4,
                      device="cpu", device_memory_bytes=10**12)
    whole, half = min(p.total for p in result.plans), min(p.total for p in halved.plans)
    assert half < whole
    micro, accumulation, _ = split_batch(int((whole + half) / 2 / 0.9))
    assert (micro, accumulation) == (2, 2)
